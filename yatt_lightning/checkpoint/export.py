"""``yatt export``: a checkpoint to a Hugging Face model folder (safetensors, config, tokenizer).

Reads only the model tensors of the Megatron distributed checkpoint, in one process without a process
group, whatever TP/PP/DP layout wrote it: the checkpoint stores each tensor in its global (unsharded)
layout, with the layers stacked along a leading dimension. The result loads in transformers and vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from yatt_lightning.checkpoint import folder as ckpt
from yatt_lightning.models import convert, vlm
from yatt_lightning.models.gpt import HFArch

# Names in Megatron's checkpoints (Transformer-Engine style) -> names of the local layer spec.
_CHECKPOINT_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export(ckpt_dir: str, out: str, dtype: str | None = None, max_shard_size: str = "5GB") -> Path:
    """Write the policy of a checkpoint as a Hugging Face model folder.

    Args:
        ckpt_dir: A checkpoint folder (``.../step-00000020``) or a checkpoint directory holding ``latest``.
        out: Output folder (created; must be empty or absent).
        dtype: Tensor dtype to write (``float32``, ``bfloat16``, ``float16``); default: as trained.
        max_shard_size: Largest safetensors file before the weights are split into several.
    """
    from transformers import AutoConfig

    if dtype not in (None, *EXPORT_DTYPES):
        raise ValueError(f"`--dtype` must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}.")
    folder = Path(ckpt_dir)
    if not folder.is_dir():
        raise ckpt.CheckpointError(f"`--ckpt_dir`: {folder} does not exist; pass a checkpoint folder or the folder of `latest`.")
    directory = folder if (folder / ckpt.TRACKER).is_file() else None
    if directory is not None:
        folder = ckpt.tracked(directory)
    problems = ckpt.verify(folder)
    if problems:
        intact = [c for c in ckpt.complete_checkpoints(folder.parent) if c != folder and not ckpt.verify(c)]
        hint = f"; the newest intact checkpoint is {intact[0]} (`--ckpt_dir {intact[0]}`)" if intact else ""
        raise ckpt.CheckpointError(f"cannot export {folder}: {'; '.join(problems[:5])}{hint}")
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"`--out`: {out_dir} is not empty; choose a new folder.")
    hf_config = AutoConfig.from_pretrained(folder / "hf")
    arch = HFArch.from_hf_config(hf_config)
    vision_language = vlm.is_vision_language(hf_config)
    hf_tensors = {}
    for name, tensor in read_model_tensors(folder / ckpt.WEIGHTS).items():
        for local_name, full in _unstack(name, tensor):
            if vision_language:  # LLaVA: the tower and projector keep their names, the LM gets language_model.
                pairs = vlm.export_names(local_name, full, arch, layer_offset=0)
            else:
                pairs = convert.megatron_to_hf(local_name, full, arch)
            for hf_name, t in pairs:
                t = t.to(getattr(torch, dtype)) if dtype else t
                hf_tensors[hf_name] = t.contiguous().clone()  # own storage: layers were views of a stack
    out_dir.mkdir(parents=True, exist_ok=True)
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(hf_tensors, str(out_dir), max_shard_size=max_shard_size)
    for path in (folder / "hf").iterdir():
        shutil.copy2(path, out_dir / path.name)
    if dtype:
        config = json.loads((out_dir / "config.json").read_text())
        config["dtype"] = config["torch_dtype"] = dtype
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def read_model_tensors(weights_dir: Path) -> dict[str, torch.Tensor]:
    """The ``model.*`` tensors of a Megatron distributed checkpoint, loaded without a process group."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the intent
    reader = FileSystemReader(str(weights_dir))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): t for key, t in state.items()}


def _unstack(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``decoder.layers.X`` tensors (``language_model.decoder.layers.X`` in a LLaVA) are stacked over layers;
    yield ``decoder.layers.<i>.X`` per layer."""
    prefix = "language_model." if name.startswith("language_model.decoder.layers.") else ""
    if not name.startswith(prefix + "decoder.layers."):
        yield name, tensor
        return
    suffix = name.removeprefix(prefix + "decoder.layers.")
    suffix = _CHECKPOINT_TO_LOCAL.get(suffix, suffix)
    for i in range(tensor.shape[0]):
        yield f"{prefix}decoder.layers.{i}.{suffix}", tensor[i]


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI

    CLI(export, args=argv, as_positional=False)
