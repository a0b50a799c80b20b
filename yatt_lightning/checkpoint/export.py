"""``yatt export``: a checkpoint to a Hugging Face model folder (safetensors, config, tokenizer).

Reads only the model tensors of the Megatron distributed checkpoint, in one process without a process
group, whatever TP/PP/DP layout wrote it: the checkpoint stores each tensor in its global (unsharded)
layout, with the layers stacked along a leading dimension. The result loads in transformers and vLLM. A LoRA
checkpoint holds adapters only: they are written as a PEFT folder and merged into the base they name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from yatt_lightning.checkpoint import folder as ckpt
from yatt_lightning.checkpoint import lora_base
from yatt_lightning.models import convert, lora, vlm
from yatt_lightning.models.families import arch_of, family_for
from yatt_lightning.models.lora import LoRASettings

# Names in Megatron's checkpoints (Transformer-Engine style) -> names of the local layer spec.
_CHECKPOINT_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export(ckpt_dir: str, out: str, dtype: str | None = None, max_shard_size: str = "5GB", base: str | None = None) -> Path:
    """Write the policy of a checkpoint as a Hugging Face model folder; for a LoRA checkpoint (adapters only), the
    base with the adapters merged in, and the adapters as a PEFT folder in ``<out>/adapter``.

    Args:
        ckpt_dir: A checkpoint folder (``.../step-00000020``) or a checkpoint directory holding ``latest``.
        out: Output folder (created; must be empty or absent).
        dtype: Tensor dtype to write (``float32``, ``bfloat16``, ``float16``); default: as trained.
        max_shard_size: Largest safetensors file before the weights are split into several.
        base: A LoRA checkpoint's base model folder, when it is no longer where the run read it (its weights
            must be the same: their SHA-256 is checked).
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
    arch = arch_of(hf_config)
    vision_language = vlm.is_vision_language(hf_config)
    saved = lora_base.read(folder)
    if saved is not None:
        return _export_lora(folder, out_dir, saved, base, vision_language, dtype, max_shard_size)
    hf_tensors = {}
    for name, tensor in read_model_tensors(folder / ckpt.WEIGHTS).items():
        for local_name, full in _unstack(name, tensor):
            if vision_language:  # the vision parts keep their names, the LM gets the family's prefix
                pairs = vlm.export_names(local_name, full, arch, 0, names=family_for(hf_config).vision_names)
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


def _export_lora(folder: Path, out_dir: Path, saved: dict, base: str | None, vision_language: bool, dtype: str | None,
                 max_shard_size: str) -> Path:  # fmt: skip
    """A LoRA checkpoint: the adapters as a PEFT folder (``<out>/adapter``), and merged into the base they were
    trained on by ``peft`` (``merge_and_unload``) as the model folder ``out``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    base_path = Path(base or saved["base"])
    if not base_path.is_dir():
        raise ckpt.CheckpointError(
            f"{folder} holds LoRA adapters trained on {saved['base']}, which no longer exists; pass the base model "
            "folder with `--base DIR`."
        )
    if lora_base.base_sha256(base_path) != saved["base_sha256"]:
        raise ckpt.CheckpointError(
            f"`--base`: {base_path} is not the base the adapters in {folder} were trained on ({saved['base']}; "
            "the weights' SHA-256 differ); pass that base with `--base DIR`."
        )
    settings = LoRASettings(rank=saved["rank"], alpha=saved["alpha"], dropout=saved["dropout"],
                            target_modules=saved["target_modules"])  # fmt: skip
    adapter = {}
    for name, tensor in read_model_tensors(folder / ckpt.WEIGHTS).items():
        for local_name, full in _unstack(name, tensor):
            peft = lora.peft_name(local_name.removeprefix("language_model."), 0, vision_language)
            adapter[peft] = (full.to(getattr(torch, dtype)) if dtype else full).contiguous().clone()
    lora.save_peft(out_dir / "adapter", adapter, settings, base_path, vision_language)
    auto = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    model = auto.from_pretrained(base_path, dtype=getattr(torch, dtype) if dtype else "auto")
    merged = PeftModel.from_pretrained(model, out_dir / "adapter").merge_and_unload()
    merged.save_pretrained(out_dir, max_shard_size=max_shard_size)
    for path in (folder / "hf").iterdir():
        if not (out_dir / path.name).exists():  # the tokenizer's and processor's files
            shutil.copy2(path, out_dir / path.name)
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
    yield ``decoder.layers.<i>.X`` per layer. A mixture of experts' checkpoint keeps its layers apart
    (``decoder.layers.<i>.X``) and stacks each layer's experts (``mlp.experts.experts.linear_fc1.weight``
    ``[experts, ...]``): yield ``mlp.experts.local_experts.<e>.linear_fc1.weight`` per expert, by global number."""
    prefix = "language_model." if name.startswith("language_model.decoder.layers.") else ""
    if not name.startswith(prefix + "decoder.layers."):
        yield name, tensor
        return
    suffix = name.removeprefix(prefix + "decoder.layers.")
    layer, _, rest = suffix.partition(".")
    if layer.isdigit():  # one layer's tensor
        rest = _CHECKPOINT_TO_LOCAL.get(rest, rest)
        if rest.startswith(_STACKED_EXPERTS):
            for e in range(tensor.shape[0]):
                yield f"{prefix}decoder.layers.{layer}.mlp.experts.local_experts.{e}.{rest.removeprefix(_STACKED_EXPERTS)}", tensor[e]
            return
        yield f"{prefix}decoder.layers.{layer}.{rest}", tensor
        return
    suffix = _CHECKPOINT_TO_LOCAL.get(suffix, suffix)
    for i in range(tensor.shape[0]):
        yield f"{prefix}decoder.layers.{i}.{suffix}", tensor[i]


_STACKED_EXPERTS = "mlp.experts.experts."


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI

    CLI(export, args=argv, as_positional=False)
