"""What a preemption signal or a Ctrl-C does to a run that saves checkpoints (see :class:`~callbacks.AsyncCheckpoint`).

The handlers only record the signal; the decision to save is taken at the step's safe point. Three
things happen outside that rule, each in bounded time:

- a second Ctrl-C exits at once (``os._exit(130)``): nothing is renamed or tracked outside a checkpoint's
  finalisation, so ``latest`` keeps naming the newest complete checkpoint;
- a step that does not reach its safe point within ``grace_s`` of the first Ctrl-C is given up: the
  main thread gets a ``KeyboardInterrupt`` (a signal sent to it, so a blocking system call returns), and
- if the main thread cannot unwind (blocked inside a collective) the process exits ``UNWIND_S`` later.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger("yatt_lightning.checkpoint.folder")

PREEMPTION_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
UNWIND_S = 15  # after a Ctrl-C's grace period, the main thread's time to unwind before the process exits


class PreemptionSignals:
    """Args:
    grace_s: After a Ctrl-C, the longest the step in flight may take to reach its safe point.
    where: The checkpoint folder, as the log lines name it (called when they are written).
    """

    def __init__(self, grace_s: float, where: Callable[[], object]) -> None:
        self.grace_s = grace_s
        self.where = where
        self.received: int | None = None  # the first signal since the run started
        self.gave_up = False  # the grace period ended: the step in flight is not saved
        self._grace: threading.Timer | None = None
        self._old: dict = {}

    def install(self) -> None:
        """Replace the handlers (Lightning's SIGTERM handler runs collectives inside the handler and kills
        the run)."""
        for sig in PREEMPTION_SIGNALS:
            self._old[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        if not self.gave_up:
            self.reached_safe_point()
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()

    def reached_safe_point(self) -> None:
        """The step in flight at a Ctrl-C ended in time: no more giving up."""
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def _on_signal(self, signum, frame) -> None:
        if self.gave_up and signum == signal.SIGINT:
            raise KeyboardInterrupt  # sent by _give_up: unwind the main thread
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            log.warning("second Ctrl-C: stopping at once; `latest` in %s is unchanged", self.where())
            os._exit(128 + signal.SIGINT)
        first = self.received is None
        self.received = signum
        if first and signum == signal.SIGINT:
            log.warning(
                "Ctrl-C: finishing this step (at most %g s, `interrupt_grace_s`), then saving and stopping "
                "(Ctrl-C again stops at once)", self.grace_s,
            )  # fmt: skip
            self._grace = threading.Timer(self.grace_s, self._give_up)
            self._grace.daemon = True
            self._grace.start()

    def _give_up(self) -> None:
        """The grace timer's thread: the step did not reach its safe point in time."""
        log.warning(
            "Ctrl-C: the step did not finish within %g s (`interrupt_grace_s`); stopping without saving it; "
            "`latest` in %s is unchanged", self.grace_s, self.where(),
        )  # fmt: skip
        self.gave_up = True
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(UNWIND_S)
        log.warning("the main thread did not unwind within %d s (blocked in a collective?): exiting", UNWIND_S)
        logging.shutdown()
        os._exit(128 + signal.SIGINT)
