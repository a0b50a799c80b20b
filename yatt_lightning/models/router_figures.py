"""A mixture-of-experts policy's routing figures over its training forwards: ``moe/aux_loss`` (the
load-balancing loss before its coefficient, Megatron's: 1.0 when tokens and probabilities are spread evenly)
and ``moe/expert_load_max_over_mean`` (per MoE layer, the busiest expert's tokens over the mean, then the mean
over layers: 1.0 is perfectly balanced, ``num_experts / top_k`` is every token on the same experts).

Counted by forward hooks on Megatron's routers (training forwards only, as Megatron tracks its aux loss), summed
over every training rank when taken, so each rank returns the same figures.
"""

from __future__ import annotations

import torch


class RouterFigures:
    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.forwards = torch.zeros(num_layers, dtype=torch.float64)
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._hook)

    @classmethod
    def attach(cls, model: torch.nn.Module, arch) -> RouterFigures | None:
        """Counting on ``model``'s routers; None for a dense ``arch``."""
        return cls(model, arch.num_layers, arch.moe.num_experts) if arch.moe is not None else None

    def _hook(self, router, inputs, output) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        _, routing_map = output
        layer = router.layer_number - 1
        self.counts[layer] += routing_map.detach().sum(dim=0).to(device="cpu", dtype=torch.float64)
        self.forwards[layer] += 1

    def take(self) -> dict[str, float]:
        """The figures since the last take, over every training rank (a collective: every training rank
        calls it); then starts counting again."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        aux = tracked["values"].detach().to("cpu", torch.float64) if tracked is not None else torch.zeros(len(self.forwards))
        both = torch.cat([self.counts.flatten(), self.forwards, aux])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(both)
        layers, experts = self.counts.shape
        counts = both[: layers * experts].view(layers, experts)
        forwards, aux = both[layers * experts : layers * experts + layers], both[layers * experts + layers :]
        used = forwards > 0
        self.counts.zero_()
        self.forwards.zero_()
        clear_aux_losses_tracker()
        if not bool(used.any()):
            return {}
        load = counts[used]
        return {
            "moe/aux_loss": float((aux[used] / forwards[used]).mean()),
            "moe/expert_load_max_over_mean": float((load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)).mean()),
        }
