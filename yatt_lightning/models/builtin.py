"""Which folder a model key names: a user's Hugging Face folder, or a built-in model built on first use."""

from __future__ import annotations

from pathlib import Path

from yatt_lightning.models.tiny import BUILTIN_SHAPES, TINY_QWEN2, build_tiny_qwen2
from yatt_lightning.models.tiny_llava import TINY_LLAVA, build_tiny_llava

BUILTIN_PREFIX = "builtin:"


def resolve_model_path(path: str, key: str = "model.policy.path") -> Path:
    """Turn a config value into a Hugging Face model folder, building the built-in model if named.

    Raises:
        ValueError: if ``path`` names an unknown built-in model, or is not a folder with ``config.json``.
    """
    if path.startswith(BUILTIN_PREFIX):
        if path == TINY_LLAVA:
            return build_tiny_llava()
        if path not in BUILTIN_SHAPES:
            raise ValueError(
                f"`{key}`: unknown built-in model {path!r}; built-in models: {', '.join([*BUILTIN_SHAPES, TINY_LLAVA])}."
            )
        return build_tiny_qwen2(shape=BUILTIN_SHAPES[path])
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"`{key}`: model folder {str(folder)!r} does not exist. Pass a Hugging Face model folder "
            f"(with config.json, *.safetensors and the tokenizer files) or {TINY_QWEN2!r}."
        )
    if not (folder / "config.json").is_file():
        raise ValueError(f"`{key}`: {str(folder)!r} has no config.json; it is not a Hugging Face model folder.")
    return folder
