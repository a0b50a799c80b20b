"""A trained policy's parameters in one storage per device and dtype, so that a disaggregated trainer sends
its whole policy as one message without a copy (:mod:`~yatt_lightning.placement.weight_channel`)."""

from __future__ import annotations

import torch


def into_one_storage(module: torch.nn.Module) -> None:
    """Move ``module``'s parameters into one storage per device and dtype, in their order (values,
    identities and ties kept), so that the whole policy can be sent as one message without a copy."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for param in module.parameters():  # each parameter once (a tied one is one object)
        groups.setdefault((param.device, param.dtype), []).append(param)
    with torch.no_grad():
        for (device, dtype), params in groups.items():
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            offset = 0
            for p in params:
                view = flat[offset : offset + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view
                offset += p.numel()
