"""One run per checkpoint folder: rank 0 of a run holds an OS file lock on ``<folder>/.lock`` for the run's life.

Two runs writing one folder would delete each other's ``.tmp`` folders and point ``latest`` at one run's
step among the other's. The lock is ``flock`` on a file that also names its holder (host, pid, when), so a
second run is refused at start naming who holds it. The operating system drops the lock when its holder
dies (a crash, SIGKILL, a preempted job), so a new run takes the folder over and logs whose lock it took
over. (``flock`` on a network filesystem depends on the filesystem's own locking; where a stale lock
remains, removing ``.lock`` frees the folder.)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("yatt_lightning.checkpoint.folder")

LOCK = ".lock"


class FolderLocked(RuntimeError):
    """Another live run holds the checkpoint folder."""


class FolderLock:
    """The lock on ``folder``, taken by :meth:`acquire` and kept until :meth:`release` or the process ends."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise FolderLocked(
                f"{self.path.parent} is in use by another run ({_who(holder)}): two runs writing one checkpoint "
                "folder would delete each other's saves. Give this run its own folder "
                "(`--trainer.callbacks.init_args.dirpath`, or another `--trainer.default_root_dir` / logger name), "
                "or stop the other run first."
            ) from None
        previous = _read(fd)
        if previous:
            log.info("checkpoint folder %s: taking over the lock of a run that ended (%s)", self.path.parent,
                     _who(previous))  # fmt: skip
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)  # no holder named: the next run takes it without a takeover line
                os.close(self.fd)
            self.fd = None


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


def _who(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
