"""Megatron's optimizer seen through ``torch.optim.Optimizer``, so Lightning counts its steps.

Lightning advances ``trainer.global_step`` when a ``LightningOptimizer`` steps, and reads learning
rates from ``param_groups``. Megatron-Core's optimizer is not a ``torch.optim.Optimizer``; this adapter
forwards ``step`` and ``zero_grad`` to it. Its state is saved sharded with the model by the strategy's
checkpoint code, so ``state_dict`` here is empty.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class MegatronOptimizerAdapter(torch.optim.Optimizer):
    def __init__(self, policy, step_index: Callable[[], int]) -> None:
        params = [p for p in policy.local_module().parameters() if p.requires_grad]
        super().__init__(params, {"lr": policy.settings.lr})
        self.policy = policy
        self.step_index = step_index
        self.last_grad_norm = float("nan")
        self.last_applied = False
        self.count_only = False  # a step Lightning counts but that applies nothing (a dropped batch)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.count_only:
            return loss
        step = self.step_index()
        self.last_applied, self.last_grad_norm = self.policy.optimizer_step(step)
        for group in self.param_groups:
            group["lr"] = self.policy.settings.lr_at(step)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.policy.zero_grad_buffers()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass
