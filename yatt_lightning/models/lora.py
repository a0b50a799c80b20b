"""Low-rank adapters on the Megatron policy's linear layers, under tensor and pipeline parallelism.

megatron-core has no LoRA of its own. Each targeted projection (named as users know them: ``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``; ``all-linear`` for all) gets
``A [rank, in]`` and ``B [out, rank]`` and adds ``scale * B A x`` (``scale = alpha / rank``) to the output of
the Megatron linear layer holding it, through a forward hook: the base layers and their parameter names are
untouched (the weight export and the checkpoints' base tensors read them as before), and the base weights are
frozen (no gradients, no optimizer state). Megatron fuses what Hugging Face keeps apart, so one layer may
carry several adapters: ``linear_qkv`` the q, k and v ones (their outputs interleaved by key/value group as the
fused weight is), ``linear_fc1`` gate and up (``[gate_r; up_r]`` on each TP rank).

Tensor parallelism, equal to one process:

- column-parallel layers (``linear_qkv``, ``linear_fc1``): ``A`` whole on every rank, ``B`` split by output as
  the base weight is; ``h = A x`` passes Megatron's ``copy_to_tensor_model_parallel_region`` (all-reduce of its
  gradient), so ``A``'s gradient sums every rank's output shard;
- row-parallel layers (``linear_proj``, ``linear_fc2``): ``A`` split by input, ``B`` whole; ``h = A_r x_r`` is
  all-reduced (``reduce_from_tensor_model_parallel_region``) before ``B``.

A split tensor carries Megatron's tensor-parallel attributes (so the gradient norm counts it once per shard,
a whole one once). Initialisation is PEFT's (``A`` uniform in +-1/sqrt(in), ``B`` zero), drawn whole from a
generator seeded by the seed, the global layer and the projection, then cut: every layout starts equal.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

from yatt_lightning.models.families.arch import HFArch

# Hugging Face projection -> (Megatron layer under decoder.layers.N, part of a fused layer, HF module path)
PROJECTIONS = {
    "q_proj": ("self_attention.linear_qkv", "q", "self_attn"),
    "k_proj": ("self_attention.linear_qkv", "k", "self_attn"),
    "v_proj": ("self_attention.linear_qkv", "v", "self_attn"),
    "o_proj": ("self_attention.linear_proj", None, "self_attn"),
    "gate_proj": ("mlp.linear_fc1", "gate", "mlp"),
    "up_proj": ("mlp.linear_fc1", "up", "mlp"),
    "down_proj": ("mlp.linear_fc2", None, "mlp"),
}
ROW_PARALLEL = ("o_proj", "down_proj")
LORA = "lora"  # the child module of a targeted Megatron layer holding its adapters


@dataclass
class LoRASettings:
    """``model.lora``.

    Args:
        rank: Rank of the adapters.
        alpha: Scale numerator: the update is ``alpha / rank * B A x``.
        dropout: Dropout on the adapters' input while training (0 under tensor parallelism: the ranks of a
            column-parallel layer share its input).
        target_modules: Projections to adapt (``q_proj`` ... ``down_proj``), or ``all-linear``.
        merge: Push merged weights to the rollout engine instead of the adapter (for engines or kernels
            without LoRA).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: "all-linear")
    merge: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"`model.lora.rank` must be >= 1, got {self.rank}.")
        if self.alpha <= 0:
            raise ValueError(f"`model.lora.alpha` must be > 0, got {self.alpha}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`model.lora.dropout` must be in [0, 1), got {self.dropout}.")
        targets = [self.target_modules] if isinstance(self.target_modules, str) else list(self.target_modules)
        unknown = [t for t in targets if t not in PROJECTIONS and t != "all-linear"]
        if unknown or not targets:
            raise ValueError(
                f"`model.lora.target_modules`: {unknown or 'none given'} is not a projection of the policy; choose from "
                f"{', '.join(PROJECTIONS)}, or all-linear."
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets(self) -> list[str]:
        """The targeted projections, in :data:`PROJECTIONS` order."""
        wanted = [self.target_modules] if isinstance(self.target_modules, str) else list(self.target_modules)
        return [p for p in PROJECTIONS if p in wanted or "all-linear" in wanted]


def full_shapes(arch: HFArch) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection's whole weight, as Hugging Face stores it."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, f = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}  # fmt: skip


def initial_adapter(
    seed: int, layer: int, proj: str, rank: int, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's initialisation of one projection's whole ``A [rank, in]`` and ``B [out, rank]``, from a
    generator of its own (the same under any layout)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/{proj}".encode()))
    out_features, in_features = shape
    bound = 1.0 / math.sqrt(in_features)
    a = (torch.rand(rank, in_features, generator=g, dtype=torch.float64) * 2 - 1) * bound
    return a.float(), torch.zeros(out_features, rank)


def split_dim(proj: str, which: str) -> int | None:
    """The dim tensor parallelism splits ``proj``'s ``A`` or ``B`` along (``None``: whole on every rank)."""
    if proj in ROW_PARALLEL:
        return 1 if which == "A" else None
    return 0 if which == "B" else None


class LayerAdapters(torch.nn.Module):
    """The adapters of one Megatron linear layer: parameters ``<proj>_A`` and ``<proj>_B`` (this TP rank's
    part of each), and the delta they add to the layer's output."""

    def __init__(self, parts: dict[str, tuple[torch.Tensor, torch.Tensor]], settings: LoRASettings, arch: HFArch,
                 tp: int, dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        from megatron.core import tensor_parallel

        self.projections = list(parts)
        self.scale, self.tp, self.arch = settings.scale, tp, arch
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else torch.nn.Identity()
        for proj, (a, b) in parts.items():
            for which, tensor in (("A", a), ("B", b)):
                param = torch.nn.Parameter(tensor.to(dtype).contiguous())
                dim = split_dim(proj, which)
                if dim is not None:
                    tensor_parallel.set_tensor_model_parallel_attributes(param, True, dim, 1)
                self.register_parameter(f"{proj}_{which}", param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region as copy_to
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as reduce_from

        x = self.dropout(x)
        first = self.projections[0]
        if first in ROW_PARALLEL:  # o_proj or down_proj: alone in its layer
            a, b = getattr(self, f"{first}_A"), getattr(self, f"{first}_B")
            h = torch.nn.functional.linear(x, a)
            return torch.nn.functional.linear(reduce_from(h) if self.tp > 1 else h, b) * self.scale
        deltas = {}
        for proj in self.projections:
            h = torch.nn.functional.linear(x, getattr(self, f"{proj}_A"))
            deltas[proj] = torch.nn.functional.linear(copy_to(h) if self.tp > 1 else h, getattr(self, f"{proj}_B"))
        lead = x.shape[:-1]
        if first in ("gate_proj", "up_proj"):  # [gate_r; up_r]
            f = self.arch.intermediate_size // self.tp
            parts = [deltas.get(p, x.new_zeros((*lead, f))) for p in ("gate_proj", "up_proj")]
            return torch.cat(parts, dim=-1) * self.scale
        groups = self.arch.num_kv_heads // self.tp  # q, k and v interleaved by key/value group
        hn, per_group = self.arch.head_dim, self.arch.num_heads // self.arch.num_kv_heads
        widths = {"q_proj": per_group * hn, "k_proj": hn, "v_proj": hn}
        parts = [
            deltas[p].reshape(*lead, groups, w) if p in deltas else x.new_zeros((*lead, groups, w))
            for p, w in widths.items()
        ]
        return torch.cat(parts, dim=-1).reshape(*lead, -1) * self.scale


def _add_delta(module: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
    out, bias = output
    return out + getattr(module, LORA)(inputs[0]).to(out.dtype), bias


def attach(gpt: torch.nn.Module, settings: LoRASettings, arch: HFArch, tp_rank: int, tp: int, layer_offset: int,
           seed: int) -> int:  # fmt: skip
    """Add the adapters of ``settings`` to the layers of ``gpt`` (a Megatron GPT: this rank's stage and TP
    shard; the caller froze it); returns this rank's number of adapter parameters."""
    if settings.dropout > 0 and tp > 1:
        raise ValueError(
            "`model.lora.dropout` > 0 with `trainer.strategy.tensor_model_parallel_size` > 1: the ranks of a "
            "column-parallel layer would drop different entries of the input they share; set it to 0."
        )
    shapes, trainable = full_shapes(arch), 0
    for local, layer in enumerate(gpt.decoder.layers):
        by_module: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for proj in settings.targets():
            a, b = initial_adapter(seed, layer_offset + local, proj, settings.rank, shapes[proj])
            a = a.chunk(tp, dim=1)[tp_rank] if split_dim(proj, "A") == 1 else a
            b = b.chunk(tp, dim=0)[tp_rank] if split_dim(proj, "B") == 0 else b
            by_module.setdefault(PROJECTIONS[proj][0], {})[proj] = (a, b)
        for path, parts in by_module.items():
            module = layer.get_submodule(path)
            dtype = next(module.parameters()).dtype
            module.add_module(LORA, LayerAdapters(parts, settings, arch, tp, dtype))
            module.register_forward_hook(_add_delta)
            trainable += sum(p.numel() for p in getattr(module, LORA).parameters())
    return trainable


def is_lora(name: str) -> bool:
    return f".{LORA}." in name


def checkpoint_state(model_sd: dict) -> dict:
    """The adapters' entries of a Megatron sharded state dict (a LoRA checkpoint holds nothing else: the base
    is the model folder it references), each split tensor marked split along its TP dim. Megatron's linear
    layers describe their whole ``state_dict`` (ours included) as replicated over TP but for their own weight
    and bias; so one rank's shard would be written for all."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    out = {}
    for key, st in model_sd.items():
        if not is_lora(key):
            continue
        proj, which = key.rsplit(".", 1)[-1].rsplit("_", 1)
        dim = split_dim(proj, which)
        if dim is not None and tp > 1:  # as megatron.core.utils.make_tp_sharded_tensor_for_checkpoint does
            pre = st.prepend_axis_num
            layer_axes = [(i, st.global_offset[i], st.axis_fragmentations[i]) for i in range(pre)]
            st = ShardedTensor.from_rank_offsets(st.key, st.data, *layer_axes, (pre + dim, tp_rank, tp),
                                                 replica_id=(0, 0, dp_rank), prepend_axis_num=pre)  # fmt: skip
        out[key] = st
    return out


def peft_name(name: str, layer_offset: int, vision_language: bool = False) -> str:
    """PEFT's name of a full adapter tensor ``decoder.layers.N.<layer>.lora.<proj>_<A|B>``."""
    parts = name.split(".")
    layer = int(parts[parts.index("layers") + 1]) + layer_offset
    proj, which = parts[-1].rsplit("_", 1)
    model = "model.language_model" if vision_language else "model"
    return f"base_model.model.{model}.layers.{layer}.{PROJECTIONS[proj][2]}.{proj}.lora_{which}.weight"


def save_peft(folder, tensors: dict[str, torch.Tensor], settings: LoRASettings, base, vision_language: bool = False) -> None:
    """A PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) of the full adapter
    ``tensors`` (:meth:`~yatt_lightning.models.policy.MegatronPolicy.export_adapter`), for the model in
    ``base``; ``peft`` and vLLM load it onto that model. In a LLaVA the targets are the language model's
    projections only (a pattern: the vision tower has projections of the same names)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": settings.rank,
        "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "bias": "none", "use_rslora": False,
        "target_modules": settings.targets(), "fan_in_fan_out": False, "inference_mode": True,
    }  # fmt: skip
    if vision_language:
        layers = r"model\.language_model\.layers\.\d+\.(self_attn|mlp)"
        config["target_modules"] = rf"{layers}\.({'|'.join(settings.targets())})"
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
