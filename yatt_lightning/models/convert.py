"""Weight layouts: Hugging Face <-> Megatron-Core GPT (local layer spec); the names are each family's weight
table (:mod:`yatt_lightning.models.families.weights`).

Megatron fuses what Hugging Face keeps apart, and tensor parallelism (TP) splits it again:

* ``linear_qkv`` holds, per key/value group, that group's query heads, then its key, then its value
  head; TP splits whole groups along dim 0.
* ``linear_fc1`` holds ``[gate; up]``; TP splits gate and up *separately*, so each shard is
  ``[gate_r; up_r]`` and gathering must split each shard in halves before concatenating.
* Column-parallel weights (``linear_qkv``, ``linear_fc1``, embeddings, output layer) split dim 0;
  row-parallel ones (``linear_proj``, ``linear_fc2``) split dim 1; norms are replicated.

Pipeline parallelism (PP) gives each stage a contiguous block of layers numbered from 0 locally;
``layer_offset`` turns local numbers into global ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from yatt_lightning.models.families.arch import HFArch
from yatt_lightning.models.families.weights import merge_qkv, split_qkv  # noqa: F401 (the fused layouts, used here and by callers)


def tp_split_dim(name: str, arch: HFArch | None = None) -> int | None:
    """The dim TP splits ``name`` along, or None if it is replicated (by ``arch``'s weight table; without an arch,
    by the dense rows every family shares)."""
    return _table(arch).tp_dim(name)


def is_gated_fc1(name: str, arch: HFArch | None = None) -> bool:
    return _table(arch).is_gated(name)


@functools.lru_cache(maxsize=1)
def _dense_table():
    from yatt_lightning.models.families.weights import WeightTable, dense_rows

    return WeightTable(dense_rows(qkv_bias=True))


def _table(arch: HFArch | None):
    from yatt_lightning.models.families import weight_table

    return weight_table(arch) if arch is not None else _dense_table()


# ------------------------------------------------------------------------------------ TP shards
def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int, arch: HFArch | None = None) -> torch.Tensor:
    """This TP rank's shard of a full Megatron tensor."""
    dim = tp_split_dim(name, arch)
    if dim is None or tp == 1:
        return full
    if is_gated_fc1(name, arch):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(name: str, shards: list[torch.Tensor], arch: HFArch | None = None) -> torch.Tensor:
    """The full Megatron tensor from all TP ranks' shards (in TP rank order)."""
    dim = tp_split_dim(name, arch)
    if dim is None or len(shards) == 1:
        return shards[0]
    if is_gated_fc1(name, arch):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


# ------------------------------------------------------------------------------------ names
def megatron_to_hf(
    name: str, full: torch.Tensor, arch: HFArch, layer_offset: int = 0, grouped: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs for one full (TP-gathered) Megatron tensor, by ``arch``'s family's
    weight table; ``grouped``: q, k and v as views of the fused tensor, by query group (:func:`split_qkv`)."""
    return _table(arch).to_hf(name, full, arch, layer_offset, grouped)


def hf_to_megatron(name: str, get: Callable[[str], torch.Tensor], arch: HFArch, layer_offset: int = 0) -> torch.Tensor:
    """The full Megatron tensor ``name`` built from Hugging Face tensors read with ``get(hf_name)``."""
    return _table(arch).from_hf(name, get, arch, layer_offset)
