"""A family's weight table: the one list of rows that maps Megatron's parameters to Hugging Face tensors and
back (loading a folder, the push into an engine, the disaggregated rename, ``yatt export``).

A row names a Megatron parameter (per layer ``decoder.layers.{L}.``, per expert ``...local_experts.{E}.``),
the Hugging Face tensors it holds and how they combine:

* ``copy``: one tensor, the same values;
* ``gate_up``: Megatron's ``linear_fc1`` is ``[gate; up]``;
* ``qkv``: Megatron's ``linear_qkv`` interleaves q, k and v by key/value group
  (:func:`merge_qkv`).

``tp_dim`` is the dimension tensor parallelism splits (None: replicated). Expert rows carry the expert's
global number: the loader and the exporters translate the local experts of an expert-parallel rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from yatt_lightning.models.families.arch import HFArch


@dataclass(frozen=True)
class Row:
    megatron: str
    hf: tuple[str, ...]
    kind: str = "copy"  # copy | gate_up | qkv
    tp_dim: int | None = None


def dense_rows(qkv_bias: bool) -> list[Row]:
    """The Llama block: attention (fused QKV, optional bias), SwiGLU MLP, two RMSNorms; embeddings and head."""
    attn = "model.layers.{L}.self_attn."
    rows = [
        Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0),
        Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Row("output_layer.weight", ("lm_head.weight",), tp_dim=0),
        Row("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",)),
        Row("decoder.layers.{L}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",)),
        Row("decoder.layers.{L}.self_attention.linear_proj.weight", (attn + "o_proj.weight",), tp_dim=1),
        Row("decoder.layers.{L}.self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), "qkv", 0),  # fmt: skip
        Row("decoder.layers.{L}.mlp.linear_fc1.weight",
            ("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"), "gate_up", 0),  # fmt: skip
        Row("decoder.layers.{L}.mlp.linear_fc2.weight", ("model.layers.{L}.mlp.down_proj.weight",), tp_dim=1),
    ]
    if qkv_bias:
        rows.append(Row("decoder.layers.{L}.self_attention.linear_qkv.bias",
                        (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), "qkv", 0))  # fmt: skip
    return rows


QK_NORM_ROWS = [
    Row("decoder.layers.{L}.self_attention.q_layernorm.weight", ("model.layers.{L}.self_attn.q_norm.weight",)),
    Row("decoder.layers.{L}.self_attention.k_layernorm.weight", ("model.layers.{L}.self_attn.k_norm.weight",)),
]
# Experts are whole on each expert-parallel rank (expert tensor parallelism 1): not split by TP.
MOE_ROWS = [
    Row("decoder.layers.{L}.mlp.router.weight", ("model.layers.{L}.mlp.gate.weight",)),
    Row("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
        ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight"), "gate_up"),  # fmt: skip
    Row("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
        ("model.layers.{L}.mlp.experts.{E}.down_proj.weight",)),  # fmt: skip
]


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)") + "$")


class WeightTable:
    """Megatron name <-> Hugging Face names, through the same rows both ways."""

    def __init__(self, rows: list[Row]) -> None:
        seen = [r.megatron for r in rows]
        if len(set(seen)) != len(seen):
            raise ValueError(f"a weight table names a Megatron parameter twice: {seen}")
        self.rows = tuple(rows)
        self._compiled = [(_pattern(r.megatron), r) for r in self.rows]
        # name -> (row, numbers): a push looks each parameter up several times (TP dim, gating, names), every push
        self._found: dict[str, tuple[Row, dict[str, int]]] = {}

    def row(self, name: str) -> tuple[Row, dict[str, int]]:
        """The row of the Megatron parameter ``name`` and its layer / expert numbers (a dict of the caller's)."""
        if name not in self._found:
            for pattern, row in self._compiled:
                m = pattern.match(name)
                if m:
                    self._found[name] = row, {k: int(v) for k, v in m.groupdict().items()}
                    break
            else:
                raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")
        row, numbers = self._found[name]
        return row, dict(numbers)

    def tp_dim(self, name: str) -> int | None:
        try:
            return self.row(name)[0].tp_dim
        except KeyError:
            return None

    def is_gated(self, name: str) -> bool:
        try:
            return self.row(name)[0].kind == "gate_up"
        except KeyError:
            return False

    def hf_names(self, name: str, layer_offset: int = 0) -> tuple[Row, list[str]]:
        row, numbers = self.row(name)
        if "L" in numbers:
            numbers["L"] += layer_offset
        return row, [h.format(**numbers) for h in row.hf]

    def to_hf(self, name: str, full: torch.Tensor, arch, layer_offset: int = 0,
              grouped: bool = False) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
        """Hugging Face (name, tensor) pairs for one full (TP-gathered) Megatron tensor; ``grouped``: q, k and
        v as views of the fused tensor, by query group."""
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            return []  # tied: the engine reuses embed_tokens
        row, hf = self.hf_names(name, layer_offset)
        if row.kind == "gate_up":
            return list(zip(hf, full.chunk(2, dim=0), strict=True))
        if row.kind == "qkv":
            return list(zip(hf, split_qkv(full, arch, grouped), strict=True))
        return [(hf[0], full)]

    def from_hf(self, name: str, get: Callable[[str], torch.Tensor], arch, layer_offset: int = 0) -> torch.Tensor:
        """The full Megatron tensor ``name`` built from Hugging Face tensors read with ``get(hf_name)``."""
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            return get("model.embed_tokens.weight")
        row, hf = self.hf_names(name, layer_offset)
        if row.kind == "gate_up":
            return torch.cat([get(h) for h in hf], dim=0)
        if row.kind == "qkv":
            return merge_qkv(*(get(h) for h in hf), arch)
        return get(hf[0])


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
