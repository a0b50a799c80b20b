"""Calls into user code under a deadline: a reward function, a judge, later a tool.

A Python thread cannot be stopped from outside, so the call runs on a daemon worker thread and the caller
waits for it at most ``timeout_s`` seconds. A call past its deadline raises :class:`DeadlineExceeded` in
the caller; its worker is abandoned (it may return later, unheard, and then ends; or never: it is a daemon,
so it never holds up the process's exit) and the next call gets a fresh worker.

A worker lives as long as its caller: :meth:`TimedCaller.close`, or the caller being garbage-collected,
ends it (a caller made per call, e.g. one per tool call, leaves no thread behind: before, each waited on
its queue forever and an agent run piled up tens of thousands of them). Waiting is interruptible: a signal
handler that raises (a Ctrl-C's grace period ending, see :class:`~callbacks.AsyncCheckpoint`) stops the
wait at once.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any


class DeadlineExceeded(TimeoutError):
    """A call did not return within its deadline."""


class WorkerLost(RuntimeError):
    """The process could not run the call at all: its worker thread could not start, or died before the
    call (the process is out of threads or memory). Not the called code's failure: the run must stop."""


class _Worker(threading.Thread):
    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            call = self.calls.get()
            if call is None:  # its caller closed it, was collected, or abandoned it
                return
            fn, args, kwargs, done = call
            try:
                done.append((True, fn(*args, **kwargs)))
            except BaseException as err:  # noqa: BLE001 (handed to the caller, who decides)
                done.append((False, err))
            done.event.set()
            # Hold nothing of the call while waiting for the next: a frame that kept a teacher's tensors, woken
            # at the interpreter's exit, freed them there, and torch, re-taking the GIL of a finalizing
            # interpreter, ended the thread through C++ frames: "terminate called without an active exception".
            del call, fn, args, kwargs, done


class _Done(list):
    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()


class TimedCaller:
    """Runs calls one at a time on a worker thread, each with a deadline.

    Args:
        timeout_s: The longest a call may take; ``None`` waits without a deadline (still on the worker, so
            that a signal can interrupt the wait).
        name: The worker thread's name (in a stack dump).
    """

    def __init__(self, timeout_s: float | None, name: str = "deadline") -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"a deadline must be > 0 seconds, got {timeout_s}.")
        self.timeout_s = timeout_s
        self.name = name
        self._worker: _Worker | None = None
        self._ends: weakref.finalize | None = None
        self.abandoned = 0  # workers left behind in a call past its deadline

    def __call__(self, fn: Callable, *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)``, or :class:`DeadlineExceeded` after ``timeout_s`` seconds."""
        if self._worker is None:
            try:
                self._worker = _Worker(self.name)
            except RuntimeError as err:  # "can't start new thread"
                raise WorkerLost(f"{self.name}: no thread to run the call on ({err})") from err
            # the worker must not hold its caller (else the caller is never collected): only its queue
            self._ends = weakref.finalize(self, self._worker.calls.put, None)
            self._ends.atexit = False  # at the interpreter's exit the daemon worker is left waiting, not woken
        done = _Done()
        worker = self._worker
        worker.calls.put((fn, args, kwargs, done))
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while not done.event.wait(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))):
            if not worker.is_alive():  # it died before the call (a thread that could not allocate its stack)
                self._worker, self._ends = None, None
                raise WorkerLost(f"{self.name}: its worker thread died before running the call")
            if deadline is not None and time.monotonic() >= deadline:
                self.close()  # stuck in the call: it ends when (if) the call returns; a new worker serves the next
                self.abandoned += 1
                raise DeadlineExceeded(f"did not return within {self.timeout_s:g} s")
        ok, value = done[0]
        if ok:
            return value
        raise value

    def close(self) -> None:
        """End the worker (after the call it is in, if any); a later call starts a new one."""
        if self._ends is not None:
            self._ends()  # puts the end on the worker's queue, once
        self._worker, self._ends = None, None

    def __enter__(self) -> TimedCaller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
