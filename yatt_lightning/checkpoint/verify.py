"""Is a checkpoint folder complete and intact? Its manifest lists every file with its size and CRC-32."""

from __future__ import annotations

import json
import os
from pathlib import Path

from isal.isal_zlib import crc32  # zlib's CRC-32 (the same values), ~7x faster here

MANIFEST = "manifest.json"


def verify(folder: Path, rank: int = 0, world: int = 1) -> list[str]:
    """Problems found in ``folder`` (empty: complete and intact). Checks every file's size, and the
    CRC-32 of the files whose index in the manifest is ``rank`` modulo ``world``."""
    if not Path(folder).is_dir():
        return [f"{folder}: no such checkpoint folder"]
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing (the save did not finish)"]
    try:
        files = json.loads(manifest_path.read_text())["files"]
        for want in files.values():
            int(want["size"]), int(want["crc32"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # garbled: another checkpoint is tried
        return [f"{manifest_path}: unreadable ({type(err).__name__}: {err})"]
    problems = []
    for i, (rel, want) in enumerate(sorted(files.items())):
        path = folder / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)")
        elif i % world == rank and _crc32(path) != want["crc32"]:
            problems.append(f"{path}: checksum mismatch (corrupted)")
    return problems


def _crc32(path: Path, fsync: bool = False) -> int:
    crc, chunk = 0, memoryview(bytearray(1 << 22))  # one buffer per file: no fresh pages per chunk
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            crc = crc32(chunk[:n], crc)
        if fsync:  # Megatron writes some files (common.pt, metadata.json) without fsync
            os.fsync(f.fileno())
    return crc
