"""The built-in models, by name (``builtin:...``), each built on first use into the cache of built models."""

from __future__ import annotations

from pathlib import Path

from yatt_lightning.models.builtin_sft import SFT_STEPS, build_tiny_qwen2_sft
from yatt_lightning.models.tiny import BUILTIN_SHAPES, build_tiny_qwen2
from yatt_lightning.models.tiny_llava import TINY_LLAVA, build_tiny_llava
from yatt_lightning.models.tiny_qwen3 import QWEN3_MODELS, build_tiny_qwen3

BUILTIN_PREFIX = "builtin:"


def build_builtin(path: str, key: str = "model.policy.path") -> Path:
    """The folder of the built-in model ``path`` (``builtin:...``), built on first use.

    Raises:
        ValueError: if ``path`` names no built-in model (naming the key and the built-in models).
    """
    if path == TINY_LLAVA:
        return build_tiny_llava()
    if path in SFT_STEPS:
        return build_tiny_qwen2_sft(path)
    if path in QWEN3_MODELS:
        return build_tiny_qwen3(path)
    if path not in BUILTIN_SHAPES:
        known = ", ".join([*BUILTIN_SHAPES, *SFT_STEPS, TINY_LLAVA, *QWEN3_MODELS])
        raise ValueError(f"`{key}`: unknown built-in model {path!r}; built-in models: {known}.")
    return build_tiny_qwen2(shape=BUILTIN_SHAPES[path])
