"""Readers of the live training state, told before the state changes.

An asynchronous checkpoint on CPU writes the parameters and the optimizer's state from the training
tensors themselves while the next step runs, instead of copying them all in the step that saves
(:class:`~yatt_lightning.checkpoint.writer.LiveSnapshot`). Those tensors only change in an optimizer
step, so :meth:`MegatronPolicy.optimizer_step` calls :func:`before_update` first: every registered
reader then copies what it has not read yet (and waits for the tensor it is reading), and from then on
reads its copies. A reader is anything with ``settle()``; it unregisters itself when done.
"""

from __future__ import annotations

import threading
from typing import Protocol


class Reader(Protocol):
    def settle(self) -> None: ...


_readers: list[Reader] = []
_lock = threading.Lock()


def register(reader: Reader) -> None:
    with _lock:
        _readers.append(reader)


def unregister(reader: Reader) -> None:
    with _lock:
        if reader in _readers:
            _readers.remove(reader)


def before_update() -> None:
    """Called before the training state changes in place: each reader stops reading the live tensors."""
    with _lock:
        readers = list(_readers)
    for reader in readers:
        reader.settle()
        unregister(reader)
