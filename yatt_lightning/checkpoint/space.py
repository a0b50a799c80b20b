"""Disk space for checkpoints: checked before each save; a disk that fills during one is one screen.

Before a save, rank 0 compares the free space of the checkpoint folder's filesystem with what the save
needs: the size of the newest complete checkpoint there (its manifest lists every file's size) or, before
the first, an estimate from the policy's parameters (weights plus the optimizer's two moments and, for
16-bit weights, its 32-bit master copy). Short of space it warns in one line or, with
``on_no_space: stop``, stops the run before writing anything (:class:`NoSpaceError`).

A write that fails with ``ENOSPC`` anyway (the estimate was low, another job filled the disk) becomes a
:class:`NoSpaceError` naming the folder, the bytes needed and free, once its ``.tmp`` folder is removed:
``latest`` was never touched, so it still names an intact checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

from yatt_lightning.checkpoint.listing import complete_checkpoints, read_manifest, tracked

log = logging.getLogger("yatt_lightning.checkpoint.folder")


class NoSpaceError(RuntimeError):
    """The checkpoint folder's filesystem has no room for a checkpoint (before or while it is written)."""


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def checkpoint_bytes(folder: Path) -> int | None:
    """The size of a complete checkpoint, from its manifest."""
    manifest = read_manifest(folder)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return None
    try:
        return sum(int(entry["size"]) for entry in manifest["files"].values())
    except (KeyError, TypeError, ValueError):  # a manifest of another format: the estimate serves
        return None


def estimate_bytes(parameters, model_parallel: int, extra_files: list[Path] = ()) -> int:
    """About what a checkpoint of these parameters (this rank's shard; ``model_parallel`` shards make the
    model) takes: weights, Adam's two fp32 moments, an fp32 master copy of 16-bit weights, the other files."""
    total = 0
    for p in parameters:
        size = p.element_size()
        total += p.numel() * (size + 8 + (4 if size < 4 else 0))
    return total * model_parallel + sum(f.stat().st_size for f in extra_files if f.is_file())


def needed_bytes(dirpath: Path, estimate) -> tuple[int, str]:
    """(bytes the next save needs, how that was found): the newest complete checkpoint's size, else
    ``estimate()``."""
    for folder in complete_checkpoints(dirpath):
        size = checkpoint_bytes(folder)
        if size:
            return size, f"the size of {folder.name}"
    return estimate(), "an estimate from the policy's parameters"


def before_save(strategy, dirpath: Path, name: str, on_no_space: str) -> tuple[int, NoSpaceError | None]:
    """Rank 0, before writing checkpoint ``name``: (the bytes it needs, the error that stops the run or
    ``None``; a warning is logged instead with ``on_no_space: warn``)."""
    from yatt_lightning.checkpoint.folder import hf_files

    module = strategy.lightning_module
    layout = getattr(strategy, "layout", None)
    mp = layout.model_parallel if layout is not None else 1

    def estimate() -> int:
        params = [p for m in (module.policy, getattr(module, "critic_model", None)) if m is not None for p in m.parameters()]
        return estimate_bytes(params, mp, hf_files(Path(module.model_path)))

    needed, how = needed_bytes(dirpath, estimate)
    return needed, check(dirpath, name, needed, how, on_no_space)


@contextlib.contextmanager
def one_screen(dirpath: Path, final: Path, needed: int, remove_tmp: bool) -> Iterator[None]:
    """A write of ``final`` that ran out of space raises :func:`write_failed`'s error (its ``.tmp`` removed)."""
    try:
        yield
    except BaseException as err:
        if isinstance(err, NoSpaceError) or not (is_no_space(err) or _short(dirpath, needed)):
            raise
        raise write_failed(dirpath, final, needed, remove_tmp) from None


def _short(dirpath: Path, needed: int) -> bool:
    """The disk has less room than a save needs: why a write failed whose error does not say (torch's
    serialiser reports a full disk as "unexpected pos", Megatron's writer wraps that again)."""
    try:
        return needed > 0 and free_bytes(dirpath) < needed
    except OSError:
        return False


def free_bytes(dirpath: Path) -> int:
    return shutil.disk_usage(dirpath).free


def check(dirpath: Path, name: str, needed: int, how: str, on_no_space: str) -> NoSpaceError | None:
    """Rank 0, before writing ``name``: warn when the free space is short of ``needed``, or return the
    error that stops the run (``on_no_space: stop``)."""
    free = free_bytes(dirpath)
    if free >= needed:
        return None
    text = f"{name} needs about {human(needed)} ({how}) and {dirpath} has {human(free)} free"
    if on_no_space == "stop":
        return NoSpaceError(
            f"stopping before saving {name}: it needs about {human(needed)} ({how}) and {dirpath} has {human(free)} "
            f"free (`on_no_space: stop`); `latest` still names {_latest(dirpath)}. Free some space, point "
            "`dirpath` at a larger disk, or lower `keep_last`",
        )
    log.warning("%s: the save will likely fail (`on_no_space: stop` stops cleanly instead)", text)
    return None


def is_no_space(err: BaseException) -> bool:
    """True when ``err`` or a cause of it is a full disk (``ENOSPC``, or its message as another rank reported it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, NoSpaceError) or (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)):
            return True
        if "No space left on device" in str(err) or "Disk quota exceeded" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def write_failed(dirpath: Path, final: Path, needed: int, remove_tmp: bool) -> NoSpaceError:
    """The error of a save that ran out of space; its ``.tmp`` folder is removed first (by rank 0)."""
    tmp = final.with_name(final.name + ".tmp")
    if remove_tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        free = human(free_bytes(dirpath))
    except OSError:
        free = "unknown"
    return NoSpaceError(
        f"no space left on the disk of {dirpath} while saving {final.name}: it needs about {human(needed)} and "
        f"{free} is free now that its partial write ({tmp.name}) is removed; `latest` still names "
        f"{_latest(dirpath)}. Free some space, point `dirpath` at a larger disk, or lower `keep_last`; then "
        "resume with `--ckpt_path last`",
    )


def _latest(dirpath: Path) -> str:
    latest = tracked(dirpath)
    return latest.name if latest is not None else "no checkpoint (none was saved)"
