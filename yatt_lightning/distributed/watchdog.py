"""The watchdog: a rank that does not arrive is named, long before the collective's timeout.

A rank that never reaches a collective (stuck in a loop, a dead server without a deadline, a lost
message) leaves its peers waiting inside the collective, where no Python code runs, until the process
group's timeout (``timeout_minutes``) ends them with a message that names neither the rank nor the
stage. So each rank marks where its step is (:meth:`Watchdog.enter`: ``rollout``, ``reward``, ``train``,
``checkpoint``), and a thread posts that position to the process group's store and reads its peers'.

When a rank has stood at one position for ``deadline_s`` and a peer is behind it, it is waiting for that
peer. Both sides then act: every thread's stack goes to the log (the waiting rank's shows the collective,
the late rank's shows where it is stuck), the lowest waiting rank shows one screen naming the late rank,
its stage and step and for how long, and every process exits with code 1 (``os._exit``: a thread blocked in a collective cannot be
unwound). Peers are the ranks that step together (all ranks; in a disaggregated placement, the ranks of
one side), so the two sides of an asynchronous run, which never meet at a step, are never compared.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_KEY = "yatt/watchdog/{}"
# A step's stages, in order; "scored": this rank's rewards are done and it waits for every rank's.
STAGES = ("rollout", "reward", "scored", "train", "checkpoint")


def write_stacks(header: str) -> str:
    """``header`` and every thread's stack to standard error: the library output's file while the run
    console captures it (else the terminal). Returns where that is, for the screen (a full disk loses
    the stacks, never the screen)."""
    from yatt_lightning.distributed import console

    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"\n{header}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    return f"in {console.last_capture}" if console.last_capture else "above"


@dataclass(frozen=True)
class Position:
    """Where a rank's step is: ``stage`` of ``step``; ``seq`` orders positions (step, then stage)."""

    seq: int
    stage: str
    step: int
    since: float  # wall-clock time it entered the stage

    def describe(self, now: float) -> str:
        return f"'{self.stage}' of step {self.step} (for {now - self.since:.0f} s)"


class Watchdog:
    """Args:
    deadline_s: How long a rank may stand at one position while a peer is behind it.
    rank: This process's global rank.
    peers: The global ranks that step together with this one (itself included).
    store: A ``torch.distributed.Store`` every peer reaches (default: the process group's own).
    poll_s: How often positions are posted and compared.
    """

    def __init__(
        self,
        deadline_s: float,
        rank: int,
        peers: list[int],
        store=None,
        poll_s: float | None = None,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"the watchdog's deadline must be > 0 seconds, got {deadline_s}.")
        self.deadline_s, self.rank, self.peers = deadline_s, rank, [p for p in peers if p != rank]
        self.store = store if store is not None else torch.distributed.distributed_c10d._get_default_store()
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.1, deadline_s / 10))
        self._position = Position(-1, "start", 0, time.time())
        self._entered = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the main thread
    def enter(self, stage: str, step: int) -> None:
        """This rank's step ``step`` enters ``stage`` (one of :data:`STAGES`). Positions order by step, then
        by the stage's place in a step, so a rank that skips a stage (no rollout finished this step) still
        compares right with its peers."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; the stages: {', '.join(STAGES)}")
        self._position = Position(step * len(STAGES) + STAGES.index(stage), stage, step, time.time())
        self._entered = time.monotonic()

    def start(self) -> Watchdog:
        if self.peers and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="yatt-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread = None

    # ------------------------------------------------------------------ the watchdog's thread
    def _watch(self) -> None:
        posted, unreachable = None, None
        while not self._stop.wait(self.poll_s):
            mine, entered = self._position, self._entered
            try:
                if mine != posted:
                    self.store.set(_KEY.format(self.rank), json.dumps(mine.__dict__))
                    posted = mine
                if time.monotonic() - entered < self.deadline_s:
                    continue
                theirs = self._peers()
                unreachable = None
            except Exception as err:  # noqa: BLE001 (the store's host, rank 0, is gone, or going at the end)
                unreachable = unreachable or time.monotonic()
                if time.monotonic() - unreachable > min(self.deadline_s, 30.0) and not self._stop.is_set():
                    self._report(mine, {}, {}, show=False, why=f"the process group's store is unreachable ({err})")
                continue
            if self._stop.is_set() or mine is not self._position:
                continue
            behind = {r: p for r, p in theirs.items() if p.seq < mine.seq}
            ahead = {r: p for r, p in theirs.items() if p.seq > mine.seq}
            if behind or ahead:
                low = min(p.seq for p in theirs.values())
                waiting = [r for r, p in theirs.items() if p.seq > low] + ([self.rank] if mine.seq > low else [])
                self._report(mine, behind, ahead, show=bool(behind) and self.rank == min(waiting))

    def _peers(self) -> dict[int, Position]:
        out = {}
        for rank in self.peers:
            key = _KEY.format(rank)
            if self.store.check([key]):
                out[rank] = Position(**json.loads(self.store.get(key)))
        return out

    def _report(self, mine: Position, behind: dict, ahead: dict, show: bool, why: str = "") -> None:
        now = time.time()
        if why:
            message = f"rank {self.rank} stops at {mine.describe(now)}: {why}"
        elif behind:
            late = ", ".join(f"rank {r} is still at {p.describe(now)}" for r, p in sorted(behind.items()))
            message = (
                f"rank {self.rank} has waited {now - mine.since:.0f} s at '{mine.stage}' of step {mine.step} for its "
                f"peers: {late}; it never arrived"
            )
        else:
            waiting = ", ".join(f"rank {r} (at {p.describe(now)})" for r, p in sorted(ahead.items()))
            message = f"rank {self.rank} is late: it is still at {mine.describe(now)} while {waiting} wait for it"
        where = write_stacks(f"watchdog: {message}")
        if show:
            logging.getLogger("yatt_lightning").error(
                "watchdog: %s. Every thread's stack of each rank is in its log (rank %d's %s); the deadline is "
                "`trainer.strategy.watchdog_minutes`.", message, self.rank, where,
            )  # fmt: skip
        # Before exiting, time for the other side to read this position (this rank may host the store) and,
        # on a late rank, for the waiting ranks to show their screen (its exit fails their collective).
        time.sleep(3 * self.poll_s + (0.5 if behind else 2.0))
        logging.shutdown()
        os._exit(1)
