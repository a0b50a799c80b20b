"""The cache of built-in models: built once, by whichever process gets there first, whole or not at all.

``$YATT_CACHE`` (default ``~/.cache/yatt_lightning``) holds one folder per built-in model and shape. Any
number of processes may ask for the same one at once (every rank of a run, several runs): one builds it
under a file lock into a temporary folder, which is checked, sealed with a manifest of its files and
sizes, and renamed into place in one step; the others wait and then use it. A folder whose manifest does
not match its files is moved aside, named in the log, and built again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
BUILD_MANIFEST = ".yatt-build.json"  # written last: the folder's files and sizes


def cache_dir() -> Path:
    """Folder for built artefacts: ``$YATT_CACHE`` or ``~/.cache/yatt_lightning``."""
    return Path(os.environ.get("YATT_CACHE", Path.home() / ".cache" / "yatt_lightning"))


def build_once(out: Path, write: Callable[[Path], None]) -> Path:
    """``out``, written by ``write(folder)`` the first time (the module's docstring: the lock, the check, the
    manifest, the one rename; an incomplete folder moved aside and built again)."""
    from filelock import FileLock

    if not incomplete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        problem = incomplete(out)
        if not problem:
            return out
        if out.exists():
            stamp = time.strftime("%Y%m%d-%H%M%S")
            aside = Path(tempfile.mkdtemp(prefix=f"{out.name}.incomplete-{stamp}-", dir=out.parent))
            os.replace(out, aside)  # onto the empty folder just made: a name no other build takes
            log.warning(
                "built-in model folder %s is incomplete (%s): moved it aside to %s; building it again",
                out,
                problem,
                aside,
            )
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            write(tmp)
            _seal(tmp)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from the machine's other users
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s", out)
    return out


def incomplete(folder: Path) -> str | None:
    """Why ``folder`` is not a finished build (``None`` when it is)."""
    if not folder.is_dir():
        return "absent"
    try:
        files = json.loads((folder / BUILD_MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        held = sorted(p.name for p in folder.iterdir())
        return f"no build manifest; it holds {', '.join(held) or 'nothing'}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is {'missing' if not path.is_file() else f'{path.stat().st_size} bytes, not {size}'}"
    return None


def _seal(folder: Path) -> None:
    """Check what ``write`` left in ``folder`` and record it in the manifest, or raise naming what is missing."""
    names = {p.name for p in folder.iterdir() if p.is_file()}
    needed = {"config.json": "config.json", "weights": "model.safetensors", "tokenizer": "tokenizer.json"}
    missing = [what for what, name in needed.items() if name not in names]
    if missing:
        raise RuntimeError(f"building {folder} wrote no {', '.join(missing)} (it holds {', '.join(sorted(names))})")
    files = {name: (folder / name).stat().st_size for name in sorted(names)}
    (folder / BUILD_MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def save_pretrained(model: Any, folder: Path) -> None:
    """``model.save_pretrained(folder)`` on whichever process builds. transformers 5.19 writes nothing on a rank
    other than 0 of an initialised process group (``DistributedMixin.should_save_on_this_rank``), while the
    tokenizer's ``save_pretrained`` still writes: a judge built on rank 1 left a cache folder holding only the
    tokenizer's files. The builder is the folder's only writer (under :func:`build_once`'s lock)."""
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(folder, safe_serialization=True)
