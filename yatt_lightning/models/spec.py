"""Which model to load: a Hugging Face folder (or the built-in tiny model) and its training dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from yatt_lightning.models.builtin import BUILTIN_PREFIX, resolve_model_path
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
