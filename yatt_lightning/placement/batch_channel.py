"""Disaggregated placement's batch channel: scored rollouts from a rollout rank to its trainers.

A rollout rank sends each step's :class:`Produced` (the scored batch, stamped with the policy version of
its tokens) to every trainer rank it serves, without waiting; on a trainer a thread receives them as they
come into its inbox (gloo's point-to-point receives cannot be polled: a posted ``irecv`` reports completion
only once waited on), so ``queue_depth`` is what has arrived and not yet been trained on. A rollout
rank that fails sends :class:`ProducerFailure` instead; the trainer raises :class:`ProducerFailed` (a
:class:`~yatt_lightning.distributed.failures.RankFailure`) naming it, once it has trained every batch sent
before, and keeps receiving: a rollout rank that raised (and is alive) joins the trainers' save after it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from yatt_lightning.distributed import collectives, wire
from yatt_lightning.distributed.failures import RankFailure
from yatt_lightning.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class Produced:
    """One step's scored rollouts for one data-parallel rank, and the producer's figures of them."""

    step: int
    version: int  # the policy version the engine generated with
    batch: RolloutBatch
    reward_metrics: dict[str, float]
    times: dict[str, float]  # rollout, sync (applying weights), reward, producer_idle
    figures: dict[str, float] = field(default_factory=dict)  # the producer's other figures, logged as named


@dataclass(frozen=True)
class ProducerFailure:
    origin: int
    cause: str
    joins_save: bool = False  # the rollout rank raised and waits to join the trainers' save after it


class ProducerFailed(RankFailure):
    """Raised on a trainer whose rollout rank failed, when the trainer asks for the batch it never sent:
    the trainer has trained every batch before it, so its state is consistent. ``joins_save``: the rollout
    rank is alive and joins a save of that state (its own after its last batch)."""

    def __init__(self, failure: ProducerFailure) -> None:
        super().__init__(failure.origin, failure.cause, agreed=False, how="a rollout rank failed")
        self.joins_save = failure.joins_save


@dataclass(frozen=True)
class SaveMarker:
    """Sent as the rollout rank joins a checkpoint: the batches before it belong in the trainers' checkpoint."""

    step: int  # the rollout rank's last produced step


@dataclass(frozen=True)
class StopRequest:
    """The rollout rank received ``signal``: the trainers stop (and save) at their next safe point."""

    signal: int


@dataclass(frozen=True)
class EndOfRun:
    """The producer's last message: the trainer's receiving thread ends."""


class BatchSender:
    """A rollout rank's end. A send returns at once; the previous one's bytes must have left first (the
    trainer's thread is always receiving, so that wait is the transfer's time, bounded by ``timeout_s``)."""

    def __init__(self, group, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.requests: list = []

    def send(self, message: Produced | ProducerFailure | SaveMarker | StopRequest | EndOfRun, dst: int) -> None:
        self.flush()
        with wire.category("rollout"):
            self.requests += collectives.isend_object(message, dst, self.group)

    def flush(self) -> None:
        for request in self.requests:
            request.wait(timeout=timedelta(seconds=self.timeout_s))
        self.requests = []


class BatchInbox:
    """A trainer rank's end: batches from rollout rank ``src``, in order, received by a thread. ``held``:
    batches taken off the channel for a checkpoint (or restored from one), trained on first."""

    def __init__(self, group, src: int, held: list[Produced] | None = None) -> None:
        self.group, self.src = group, src
        self.arrived: queue.Queue = queue.Queue()
        self.held: collections.deque[Produced] = collections.deque(held or [])
        self.stop_requested: int | None = None  # the signal a StopRequest named
        self.failed: ProducerFailure | None = None  # met while holding batches for a save: raised after them
        self.thread = threading.Thread(target=self._receive, name=f"yatt-batches-from-{src}", daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while True:
            try:
                with wire.category("rollout"):
                    message = collectives.recv_object(self.src, self.group)
            except Exception as err:  # the channel broke (the producer died): the trainer raises it
                self.arrived.put(ProducerFailure(self.src, f"{type(err).__name__}: {err}"))
                return
            if isinstance(message, StopRequest):
                self.stop_requested = message.signal
                continue
            self.arrived.put(message)
            if isinstance(message, EndOfRun) or (isinstance(message, ProducerFailure) and not message.joins_save):
                return  # a producer that joins the save after its failure still sends its checkpoint marker

    def _next(self, what: str, timeout_s: float, marker: bool = False):
        """The next message; a failure is raised (``marker``: one whose rank joins the save is kept, and
        raised when the trainer next asks for a batch, after the ones held for the save)."""
        while True:
            if self.failed is not None and not marker:
                raise ProducerFailed(self.failed)
            try:
                message = self.arrived.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"trainer waited {timeout_s:.0f} s for rollout rank {self.src}'s {what}") from None
            if not isinstance(message, ProducerFailure):
                return message
            if not (marker and message.joins_save):
                raise ProducerFailed(message)
            self.failed = message

    def close(self, timeout_s: float) -> None:
        """At the end of the run: the rollout rank's :class:`EndOfRun` (or its failure) has ended the receiving
        thread, so no receive is left open on the channel when the process group goes (a trainer that left
        with one open aborted at exit, and the rollout rank's send of EndOfRun waited out its timeout)."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"trainer waited {timeout_s:.0f} s for rollout rank {self.src}'s end of the run")

    def take(self, step: int, timeout_s: float) -> tuple[Produced, float, int]:
        """The batch of ``step``, the seconds waited for it, and how many batches had arrived (with it)."""
        t0 = time.monotonic()
        depth = self.arrived.qsize() + len(self.held)
        message = self.held.popleft() if self.held else self._next(f"batch of step {step}", timeout_s)
        if not isinstance(message, Produced) or message.step != step:
            sent = f"step {message.step}'s" if isinstance(message, Produced) else type(message).__name__
            raise RuntimeError(f"the trainer expected the batch of step {step}, rollout rank {self.src} sent {sent}")
        return message, time.monotonic() - t0, max(depth, 1)

    def hold_until_marker(self, timeout_s: float) -> list[Produced]:
        """For a checkpoint: every batch the rollout rank sent before it joined the save (its
        :class:`SaveMarker`), held here to be trained on next; returns all held batches."""
        while not isinstance(message := self._next("checkpoint marker", timeout_s, marker=True), SaveMarker):
            if not isinstance(message, Produced):
                raise RuntimeError(f"the trainer expected batches and a checkpoint marker, rollout rank {self.src} sent {message}")
            self.held.append(message)
        return list(self.held)
