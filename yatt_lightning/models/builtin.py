"""Which folder a model key names: a user's Hugging Face folder, or a built-in model built on first use."""

from __future__ import annotations

from pathlib import Path

from yatt_lightning.models.builtin_sft import SFT_STEPS, build_tiny_qwen2_sft
from yatt_lightning.models.tiny import BUILTIN_SHAPES, TINY_QWEN2, build_tiny_qwen2
from yatt_lightning.models.tiny_llava import TINY_LLAVA, build_tiny_llava
from yatt_lightning.models.tiny_qwen3 import QWEN3_MODELS, build_tiny_qwen3

BUILTIN_PREFIX = "builtin:"


def resolve_model_path(path: str, key: str = "model.policy.path") -> Path:
    """Turn a config value into a Hugging Face model folder, building the built-in model if named.

    Raises:
        ValueError: if ``path`` names an unknown built-in model, or is not a folder with ``config.json``.
    """
    if path.startswith(BUILTIN_PREFIX):
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
    code): any stage's checkpoint starts the next stage directly."""
    import hashlib

    from yatt_lightning.checkpoint import folder as ckpt
    from yatt_lightning.checkpoint.export import export
    from yatt_lightning.models.build_cache import build_once, cache_dir

    step = ckpt.tracked(folder) if (folder / "latest").is_file() else folder
    if step is None or ckpt.verify(step):
        problems = "; ".join(ckpt.verify(step)[:3]) if step is not None else "its `latest` names no checkpoint"
        raise ValueError(f"`{key}`: the checkpoint {folder} cannot start a run: {problems}.")
    manifest = (step / ckpt.MANIFEST).read_bytes()
    digest = hashlib.sha256(str(step.resolve()).encode() + manifest).hexdigest()[:12]
    return build_once(cache_dir() / f"checkpoint-{step.name}-{digest}", lambda tmp: export(str(step), str(tmp)))
