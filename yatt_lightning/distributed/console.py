"""The terminal of a run: yatt's own lines there, everything the libraries print in a log file.

vLLM, Megatron-Core, Lightning, torch's C++ warnings and the loaders' tqdm bars write to the process's
file descriptors 1 and 2 directly, from Python and from C++. :class:`Capture` points both descriptors
at a file and keeps a stream to the real terminal for yatt's logger, its progress bar and its summary,
so nothing printed by a library is lost (it is in the file) and nothing of it reaches the terminal.
``YATT_VERBOSE=1`` (``yatt fit --verbose``) leaves the descriptors alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

VERBOSE_ENV = "YATT_VERBOSE"
last_capture: Path | None = None  # the newest capture file of this process (the CLI appends a traceback there)
capture_to_come = False  # a RunConsole will open a Capture in this process (set by its constructor)
held = ""  # what the libraries printed in :func:`hold_output`, written first into the next Capture's file


def verbose() -> bool:
    """True when the user asked for every library's output on the terminal."""
    return os.environ.get(VERBOSE_ENV, "0") not in ("", "0", "false", "False")


class Capture:
    """While open, file descriptors 1 and 2 write to ``path``; :attr:`terminal` writes where they wrote before."""

    def __init__(self, path: Path) -> None:
        global last_capture
        self.path = last_capture = path
        path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the capture)
        global held
        if held:
            self._file.write(held)
            held = ""
        os.dup2(self._file.fileno(), 1)
        os.dup2(self._file.fileno(), 2)
        self.terminal: TextIO = os.fdopen(os.dup(self._saved[1]), "w", buffering=1)
        self._handlers = route_yatt_logger(self.terminal, copy_to=self._file)

    def close(self) -> None:
        """Put the descriptors back (idempotent)."""
        if self._file is None:
            return
        for stream in (sys.stdout, sys.stderr, self.terminal):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        unroute_yatt_logger(self._handlers)
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self.terminal.close()
        self._file.close()
        self._file = None


@contextlib.contextmanager
def hold_output() -> Iterator[None]:
    """File descriptors 1 and 2 into a temporary file while the block runs, when a Capture is to come (else as
    they are): what the libraries print then (the imports before the local ranks are forked) goes into the run's
    log once it opens, as it would have had they printed it after, and not on the terminal."""
    global held
    if not capture_to_come or verbose():
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile("w+") as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            tmp.seek(0)
            held += tmp.read()


class _FileCopy(logging.StreamHandler):
    """yatt's lines in the capture file too (never re-routed to a terminal)."""


Routing = list[tuple[logging.Handler, "TextIO | None"]]  # (handler, its stream before); None: remove it


def route_yatt_logger(terminal: TextIO, copy_to: TextIO | None = None) -> Routing:
    """yatt's log lines go to ``terminal`` (and into ``copy_to``); returns what :func:`unroute_yatt_logger` undoes."""
    logger = logging.getLogger("yatt_lightning")
    changed: Routing = []
    for handler in logger.handlers:
        if type(handler) is logging.StreamHandler:
            changed.append((handler, handler.stream))
            handler.setStream(terminal)
    if copy_to is not None:
        copy = _FileCopy(copy_to)
        copy.setFormatter(logging.Formatter("[yatt %(levelname)s] %(message)s"))
        logger.addHandler(copy)
        changed.append((copy, None))
    return changed


def unroute_yatt_logger(changed: Routing) -> None:
    logger = logging.getLogger("yatt_lightning")
    for handler, previous in reversed(changed):
        if previous is None:
            logger.removeHandler(handler)
        else:
            handler.setStream(previous)
