"""A Hugging Face folder's safetensors weights read by name, and copied into this rank's shard of a Megatron
GPT (the TP split, the tensor-parallel attributes Megatron's initialisers would have set)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from yatt_lightning.models import convert
from yatt_lightning.models.families.arch import HFArch


def load_hf_weights(
    gpt: torch.nn.Module,
    get: Callable[[str], torch.Tensor],
    arch: HFArch,
    tp_rank: int,
    tp: int,
    layer_offset: int,
    source: Path,
    expert_offset: int = 0,
) -> None:
    """Copy this rank's shards of the Hugging Face checkpoint read by ``get(hf name)`` into ``gpt``.

    Also tags each parameter as TP-sharded or replicated. Megatron-Core tags them only inside its
    weight initialisers, which are skipped here (``perform_initialization=False``, the checkpoint
    provides the values); untagged sharded weights would count as replicated in the gradient norm, so
    clipping under TP > 1 would differ from TP = 1. ``expert_offset``: the global number of this
    expert-parallel rank's first expert.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    with torch.no_grad():
        for name, param in gpt.named_parameters():
            dim = convert.tp_split_dim(name, arch)
            if not hasattr(param, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(param, dim is not None, -1 if dim is None else dim, 1)
            full = convert.hf_to_megatron(global_expert(name, expert_offset), get, arch, layer_offset)
            part = convert.shard(name, full, tp_rank, tp, arch)
            if part.shape != param.shape:
                raise ValueError(
                    f"`model.policy.path`: {source}: tensor for {name} has shape {tuple(part.shape)} after TP "
                    f"sharding, the model expects {tuple(param.shape)}; does config.json match the weights?"
                )
            param.copy_(part.to(param.dtype))


def safetensors_reader(folder: Path) -> Callable[[str], torch.Tensor]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").is_file():
        weight_map = None
    else:
        raise ValueError(
            f"`model.policy.path`: {folder} has no model.safetensors (or index); only safetensors weights load."
        )
    handles: dict[str, object] = {}

    def get(name: str) -> torch.Tensor:
        file = weight_map.get(name) if weight_map is not None else "model.safetensors"
        if file is None:
            raise KeyError(f"`model.policy.path`: {folder} has no tensor {name!r}")
        if file not in handles:
            handles[file] = safe_open(str(folder / file), framework="pt")
        try:
            return handles[file].get_tensor(name)
        except Exception as err:
            raise KeyError(f"`model.policy.path`: {folder / file} has no tensor {name!r}") from err

    return get


_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def global_expert(name: str, expert_offset: int) -> str:
    """``name`` with a local expert's number made global (``expert_offset`` + local)."""
    if not expert_offset or ".local_experts." not in name:
        return name
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}{m.group(3)}", name)
