"""Checkpoint files written past the page cache, with their CRC-32 computed as they are written.

A buffered write of a 582 MiB checkpoint first needs 582 MiB of fresh page cache. On a virtual machine
whose freed memory goes back to the host (virtio-balloon free page reporting, as on the machine these
figures come from) every one of those pages faults on the host first: measured here, 2.0 s of the
writer's CPU for 604 MB, against 0.3 s written with ``O_DIRECT`` from one reused, page-aligned chunk
(``bench/RESULTS.md``). It also keeps a checkpoint from pushing the run's own data out of the cache; on
bare metal the gain is smaller. DeepSpeed's FastPersist writes checkpoints with ``O_DIRECT`` too.

:class:`DirectFile` is a write-only stream: ``torch.save`` (through torch DCP's ``_write_item``) writes
into a chunk buffer; each full chunk gets its CRC-32 (while it is in cache) and goes to the file with
``O_DIRECT``; :meth:`DirectFile.close` writes the tail padded to the block size, truncates the file to
its real size and fsyncs it. The file's size and CRC-32 are then recorded for the manifest
(:func:`take_description`), which so never reads the file back.

The writer is a thread of the training process, so its work reaches training twice: through the GIL
(after each of its many short torch calls the training thread needs the GIL back, and waits whenever the
writer holds it) and through the memory and the cache the two cores share. So the copy into the chunk goes
through numpy, which releases the GIL (a memoryview assignment holds it for the whole memcpy), and the
CRC-32 is ISA-L's (``isal``: the same values as zlib's, ~14 GB/s against ~1.9 GB/s here, the GIL released
too): the writer's CPU in the step after a 582 MiB save fell from 450-520 ms to 300-320 ms, most of the
rest being the copy and the writes. The chunk stays at 4 MiB: at 16-32 MiB it no longer stays in the shared
cache for its CRC and write, and the writer's CPU rose to 500-700 ms (``bench/RESULTS.md``, 2026-12-05).

Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems) the same stream writes through
the page cache.
"""

from __future__ import annotations

import errno
import fcntl
import io
import mmap
import os
import threading
from pathlib import Path

import numpy as np
from isal.isal_zlib import crc32  # zlib's CRC-32 (the same values): ~14 GB/s here, zlib's ~1.9 GB/s

CHUNK = 4 << 20  # bytes; a multiple of any block size O_DIRECT asks for (why this size: above)
BLOCK = 4096  # the tail is padded to this before its O_DIRECT write, then the file is truncated

_described: dict[str, tuple[int, int]] = {}  # path -> (size, CRC-32) of files closed and not yet described
_lock = threading.Lock()
_chunks = threading.local()  # one reused chunk per writing thread: fresh pages cost a host fault each here


def _chunk() -> mmap.mmap:
    """This thread's chunk (page-aligned, as O_DIRECT needs), or a new one while it is in use."""
    if getattr(_chunks, "busy", False):
        return mmap.mmap(-1, CHUNK)
    if getattr(_chunks, "buf", None) is None:
        _chunks.buf = mmap.mmap(-1, CHUNK)
    _chunks.busy = True
    return _chunks.buf


class DirectFile(io.RawIOBase):
    """A new file at ``path``, written sequentially (``write``, ``tell``), durable once closed."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = str(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self._fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0), 0o644)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self._fd, self.direct = os.open(self.path, flags, 0o644), False  # tmpfs and the like
        self._buf = _chunk()
        self._array = np.frombuffer(self._buf, dtype=np.uint8)  # the chunk; its copies, CRC and writes free the GIL
        self._fill = 0
        self._size = 0
        self._crc = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data) -> int:
        src = np.frombuffer(data, dtype=np.uint8)  # no copy; numpy's copies below release the GIL
        done = 0
        while done < src.size:
            n = min(src.size - done, CHUNK - self._fill)
            self._array[self._fill : self._fill + n] = src[done : done + n]
            self._fill, done = self._fill + n, done + n
            if self._fill == CHUNK:
                self._write_chunk(CHUNK)
        self._size += src.size
        return src.size

    def flush(self) -> None:  # torch DCP flushes after each item; a chunk goes out when it is full
        pass

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._fill:
                tail = self._fill
                padded = tail + (-tail % BLOCK) if self.direct else tail
                self._array[tail:padded] = 0
                self._write_chunk(padded, crc_bytes=tail)
                if padded != tail:
                    os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            del self._array  # it exports the chunk's buffer (a chunk made while the thread's was busy can go)
            if self._buf is getattr(_chunks, "buf", None):
                _chunks.busy = False
            super().close()
        with _lock:
            _described[os.path.abspath(self.path)] = (self._size, self._crc)

    def _write_chunk(self, nbytes: int, crc_bytes: int | None = None) -> None:
        self._crc = crc32(self._array[: nbytes if crc_bytes is None else crc_bytes], self._crc)
        out = self._array[:nbytes]
        while out.size:
            try:
                written = os.write(self._fd, out)
            except OSError as err:
                if err.errno != errno.EINVAL or not self.direct:
                    raise
                # Opened with O_DIRECT, refused on write (an alignment this filesystem does not take):
                # the rest goes through the page cache.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
                continue
            out = out[written:]
        self._fill = 0


def take_description(path: Path) -> tuple[int, int] | None:
    """(size, CRC-32) of ``path`` if a :class:`DirectFile` wrote it and it was not changed since (the size
    still matches); ``None`` otherwise. Each description is given once."""
    with _lock:
        found = _described.pop(os.path.abspath(path), None)
    if found is None or Path(path).stat().st_size != found[0]:
        return None
    return found
