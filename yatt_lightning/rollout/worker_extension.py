"""Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``) for in-place weight updates."""

from __future__ import annotations

import torch


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker.

    ``reload_weights`` (not ``model.load_weights``) is used because vLLM repacks some weights after
    loading (for oneDNN on CPU, for quantised kernels on GPU) and only the reload path repeats that.
    """

    def yatt_reload_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        return len(weights)

    def yatt_named_parameter(self, name: str) -> torch.Tensor:
        """A copy of one of the engine's parameters (tests compare it with the pushed tensor)."""
        return dict(self.model_runner.model.named_parameters())[name].detach().clone().cpu()
