"""Weight names and layouts: Hugging Face (Qwen2 / Llama) <-> Megatron-Core GPT (local layer spec).

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

import re
from collections.abc import Callable

import torch

from yatt_lightning.models.gpt import HFArch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> HF per-layer suffix, for the one-to-one tensors.
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP_SIMPLE = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def tp_split_dim(name: str) -> int | None:
    """The dim TP splits ``name`` along, or None if it is replicated."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return 0
    if name.endswith("linear_fc1.weight"):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def is_gated_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


# ------------------------------------------------------------------------------------ TP shards
def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's shard of a full Megatron tensor."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return full
    if is_gated_fc1(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from all TP ranks' shards (in TP rank order)."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if is_gated_fc1(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


# ------------------------------------------------------------------------------------ names
def megatron_to_hf(
    name: str, full: torch.Tensor, arch: HFArch, layer_offset: int = 0, grouped: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs for one full (TP-gathered) Megatron tensor; ``grouped``: q, k and v
    as views of the fused tensor, by query group (:func:`split_qkv`)."""
    if name in _TOP_SIMPLE:
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            return []  # tied: the engine reuses embed_tokens
        return [(_TOP_SIMPLE[name], full)]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")
    layer, suffix = int(m.group(1)) + layer_offset, m.group(2)
    prefix = f"model.layers.{layer}."
    if suffix in _LAYER_SIMPLE:
        return [(prefix + _LAYER_SIMPLE[suffix], full)]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(full, arch, grouped)
        attn = prefix + "self_attn."
        return [(attn + f"q_proj.{kind}", q), (attn + f"k_proj.{kind}", k), (attn + f"v_proj.{kind}", v)]
    raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")


def hf_to_megatron(name: str, get: Callable[[str], torch.Tensor], arch: HFArch, layer_offset: int = 0) -> torch.Tensor:
    """The full Megatron tensor ``name`` built from Hugging Face tensors read with ``get(hf_name)``."""
    if name in _TOP_SIMPLE:
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            return get("model.embed_tokens.weight")
        return get(_TOP_SIMPLE[name])
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no Hugging Face tensor for Megatron parameter {name!r}")
    layer, suffix = int(m.group(1)) + layer_offset, m.group(2)
    prefix = f"model.layers.{layer}."
    if suffix in _LAYER_SIMPLE:
        return get(prefix + _LAYER_SIMPLE[suffix])
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")], dim=0)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        attn = prefix + "self_attn."
        return merge_qkv(get(attn + f"q_proj.{kind}"), get(attn + f"k_proj.{kind}"), get(attn + f"v_proj.{kind}"), arch)
    raise KeyError(f"no Hugging Face tensor for Megatron parameter {name!r}")


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArch) -> torch.Tensor:
    groups, per_group, hd = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, arch: HFArch, grouped: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of Megatron's fused tensor (interleaved by query group). ``grouped``: views of shape
    (query groups, rows per group, ...); the Hugging Face tensors are those flattened (a copy when there is
    more than one group)."""
    groups, per_group, hd = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    rest = qkv.shape[1:]
    qkv = qkv.reshape(groups, (per_group + 2) * hd, *rest)
    q, k, v = qkv.split([per_group * hd, hd, hd], dim=1)
    if grouped:
        return q, k, v
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
