"""A deadline on each engine step: an engine that never returns from a step stops the run, named.

vLLM runs in the training process here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a step that never
returns (a kernel that hangs, a tensor-parallel peer that is gone, a scheduler bug) blocks the main
thread, where no deadline of ours can run, and the run sits there until its job's time limit. One step
decodes one token for every running sequence, or prefills a batch of prompts: milliseconds to seconds.
:class:`StepDeadline` stamps each step's start; a daemon thread compares the stamp with the deadline
and, past it, writes every thread's stack to the log, shows one screen naming the engine, the rank, the
requests in flight and the key, and exits the process with code 1 (``os._exit``: the main thread
cannot be unwound from inside the engine). The peers' collectives then fail, and they stop too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

from yatt_lightning.distributed.watchdog import write_stacks

log = logging.getLogger("yatt_lightning")


class StepDeadline:
    """Args:
    timeout_s: How long one engine step may take.
    key: The config key that sets it (named on the screen).
    """

    def __init__(self, timeout_s: float, key: str) -> None:
        self.timeout_s, self.key = timeout_s, key
        self._since: float | None = None
        self._what = ""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Time one engine step; ``what`` says what it was doing (shown if it never returns)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="yatt-engine-deadline", daemon=True)
                self._thread.start()
            self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        poll = min(5.0, max(0.05, self.timeout_s / 20))
        while True:
            time.sleep(poll)
            since = self._since
            if since is None or time.monotonic() - since < self.timeout_s:
                continue
            rank = os.environ.get("RANK", "0")
            message = (
                f"the rollout engine's step did not return within {self.timeout_s:g} s (`{self.key}`) on rank "
                f"{rank}, while {self._what}"
            )
            where = write_stacks(f"engine deadline: {message}")
            log.error(
                "engine deadline: %s. The engine, or a peer it waits for, is stuck; every thread's stack is in "
                "the log (%s). Raise `%s` if a step can take this long.", message, where, self.key,
            )  # fmt: skip
            logging.shutdown()
            os._exit(1)
