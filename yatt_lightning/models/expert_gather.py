"""Every expert of a mixture-of-experts layer, from the expert-parallel ranks that each hold some of them.

Each rank holds ``local`` whole experts (``...local_experts.<i>...``, expert ``rank * local + i``); an engine
needs them all. One layer at a time (never the whole model on one rank at once), the layer's local expert
tensors travel as one flat buffer in one all-gather over the expert-parallel group (per-tensor collectives
cost a round trip each), and come back under their global numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from yatt_lightning.models.hf_weights import global_expert


def _layer_of(name: str) -> str:
    return name.split(".local_experts.", 1)[0]


def gather_experts(named: list[tuple[str, torch.Tensor]], local: int, group) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name with the global expert number, full tensor) for every expert of every layer in ``named``
    (this rank's local expert tensors, in parameter order); collective over ``group``."""
    layers: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        layers.setdefault(_layer_of(name), []).append((name, tensor))
    ranks = torch.distributed.get_world_size(group)
    for tensors in layers.values():
        flat = torch.cat([t.reshape(-1) for _, t in tensors])
        gathered = [torch.empty_like(flat) for _ in range(ranks)]
        torch.distributed.all_gather(gathered, flat, group=group)
        for rank, buffer in enumerate(gathered):
            offset = 0
            for name, t in tensors:
                yield global_expert(name, rank * local), buffer[offset : offset + t.numel()].view(t.shape)
                offset += t.numel()
