"""The base a LoRA checkpoint was trained on: a checkpoint of adapters holds them and their optimizer only, and
``lora_base.json`` names the model folder under them, the SHA-256 of its weight files and the adapters' shape.

A resume (and ``yatt export``) checks it before anything loads: the same adapters on another base would train
or export a model nobody trained. A LoRA checkpoint resumed without ``model.lora``, a full checkpoint resumed
with it, or adapters of another rank, scale or other projections are refused the same way, naming both sides.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from yatt_lightning.checkpoint.listing import TRACKER, tracked

BASE_FILE = "lora_base.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")
_HASHES: dict[tuple, str] = {}


def weight_files(model_path: Path) -> list[Path]:
    """The weight files of a Hugging Face model folder (what a checkpoint's ``hf/`` leaves out)."""
    return sorted(p for p in Path(model_path).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def base_sha256(model_path: Path) -> str:
    """SHA-256 over the names and bytes of the model folder's weight files (read once per process and folder
    state: a 7B model in bf16 takes about 15 s)."""
    files = weight_files(model_path)
    key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if key not in _HASHES:
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def reference(model_path: Path, settings) -> dict[str, Any]:
    """What ``lora_base.json`` holds for adapters of ``settings`` (:class:`~yatt_lightning.models.lora.LoRASettings`)
    on the model in ``model_path``."""
    return {
        "base": str(Path(model_path).resolve()), "base_sha256": base_sha256(model_path), "rank": settings.rank,
        "alpha": settings.alpha, "dropout": settings.dropout, "target_modules": settings.targets(),
    }  # fmt: skip


def read(folder: Path) -> dict[str, Any] | None:
    """The base reference of a checkpoint folder (``None``: it holds full weights)."""
    path = Path(folder) / BASE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def check(folder: Path, model_path: Path, settings) -> None:
    """Raise a ``ValueError`` naming both sides when the checkpoint in ``folder`` (a checkpoint, or the folder of
    its ``latest`` tracker) cannot be resumed by a run of ``model_path`` with LoRA ``settings`` (``None``: full
    weights)."""
    folder = Path(folder)
    if folder.name == TRACKER or (folder / TRACKER).is_file():
        folder = tracked(folder.parent if folder.name == TRACKER else folder)
        if folder is None:
            return
    saved = read(folder)
    if saved is None and settings is None:
        return
    if saved is None:
        raise ValueError(
            f"`--ckpt_path`: {folder} holds the full weights (written without `model.lora`), and this run sets "
            "`model.lora`: train adapters from it by exporting it (`yatt export --ckpt_dir ... --out DIR`) and setting "
            "`model.policy.path: DIR`, or remove `model.lora` to resume it."
        )
    if settings is None:
        raise ValueError(
            f"`--ckpt_path`: {folder} holds LoRA adapters (rank {saved['rank']} on {saved['base']}), and this run "
            "has no `model.lora`: resume it with the `model.lora` it was written with, or train the full weights from "
            "its merged export (`yatt export`)."
        )
    ours = reference(model_path, settings)
    for key in ("rank", "alpha", "target_modules"):
        name = f"model.lora.{key}"
        if saved[key] != ours[key]:
            raise ValueError(
                f"`{name}`: the adapters in {folder} have {key} {saved[key]}, this run {ours[key]}: they do not fit; "
                f"set `{name}` to {saved[key]} to resume them."
            )
    if saved["base_sha256"] != ours["base_sha256"]:
        raise ValueError(
            f"`model.policy.path`: the adapters in {folder} were trained on {saved['base']} (weights SHA-256 "
            f"{saved['base_sha256'][:16]}...), and this run's base is {ours['base']} ({ours['base_sha256'][:16]}...): "
            f"a different base. Set `model.policy.path` to the base they were trained on."
        )
