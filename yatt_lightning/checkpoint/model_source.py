"""Which folder a model key names (``model.policy.path``, a reward model's, a teacher's): a user's Hugging Face
folder, a built-in model built on first use, or a checkpoint of yatt, exported once (any stage's checkpoint
starts the next stage directly); the policy's :class:`ModelSpec` (that folder and its training dtype) and its
tokenizer. Above both the models (which build the built-ins) and the checkpoints (which export)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from yatt_lightning.checkpoint import folder as ckpt
from yatt_lightning.checkpoint.export import export
from yatt_lightning.models.build_cache import build_once, cache_dir
from yatt_lightning.models.builtin import BUILTIN_PREFIX, build_builtin
from yatt_lightning.models.tiny import TINY_QWEN2


@dataclass
class ModelSpec:
    """Args:
    path: A Hugging Face model folder (config.json, *.safetensors, tokenizer files), or
        ``builtin:tiny-qwen2`` for the tiny model built locally on first use.
    dtype: Parameter dtype for training: ``auto`` is float32 on CPU and bfloat16 on GPU.
    """

    path: str = TINY_QWEN2
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    def __post_init__(self) -> None:
        if not self.path.startswith(BUILTIN_PREFIX):
            resolve_model_path(self.path)  # fail at parse time for a missing folder

    def resolve(self) -> Path:
        return resolve_model_path(self.path)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return getattr(torch, self.dtype)


def policy_tokenizer(path):
    """The tokenizer of the model folder ``path``, padding with its end-of-text token when it names no pad
    token (the micro-batches are right-padded)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_model_path(path: str, key: str = "model.policy.path") -> Path:
    """Turn a config value into a Hugging Face model folder, building the built-in model if named.

    Raises:
        ValueError: if ``path`` names an unknown built-in model, or is not a folder with ``config.json``.
    """
    if path.startswith(BUILTIN_PREFIX):
        return build_builtin(path, key)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"`{key}`: model folder {str(folder)!r} does not exist. Pass a Hugging Face model folder "
            f"(with config.json, *.safetensors and the tokenizer files) or {TINY_QWEN2!r}."
        )
    if (folder / "latest").is_file() or ((folder / "manifest.json").is_file() and (folder / "hf").is_dir()):
        return exported_checkpoint(folder, key)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"`{key}`: {str(folder)!r} has no config.json; it is not a Hugging Face model folder (nor a checkpoint "
            "folder of yatt, which holds manifest.json, or a folder of them with `latest`)."
        )
    return folder


def exported_checkpoint(folder: Path, key: str) -> Path:
    """The policy of the yatt checkpoint ``folder`` (a ``step-N`` folder, or a folder of them whose ``latest``
    names one) as a Hugging Face folder, exported once into the cache of built models (``yatt export``'s
    code)."""
    step = ckpt.tracked(folder) if (folder / "latest").is_file() else folder
    if step is None or ckpt.verify(step):
        problems = "; ".join(ckpt.verify(step)[:3]) if step is not None else "its `latest` names no checkpoint"
        raise ValueError(f"`{key}`: the checkpoint {folder} cannot start a run: {problems}.")
    manifest = (step / ckpt.MANIFEST).read_bytes()
    digest = hashlib.sha256(str(step.resolve()).encode() + manifest).hexdigest()[:12]
    return build_once(cache_dir() / f"checkpoint-{step.name}-{digest}", lambda tmp: export(str(step), str(tmp)))
