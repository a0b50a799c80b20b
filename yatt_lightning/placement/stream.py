"""The messages of partial colocation's rollout/judge stream, typed, over :mod:`yatt_lightning.distributed.collectives`.

A judge rank sends its rollout rank :class:`JudgeWork` (its prompts) at the start of a step; the rollout
rank streams a :class:`FinishedGroup` per group as it finishes, then :class:`EndOfStream`; the judge answers
with :class:`JudgedScores`. Either side that fails sends :class:`StreamFailure` instead, and the other
side raises :class:`~yatt_lightning.distributed.failures.RankFailure` naming it, then both agree (the strategy's end of
the reward phase).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yatt_lightning.distributed import collectives, wire
from yatt_lightning.distributed.failures import RankFailure
from yatt_lightning.engines.base import Completion


@dataclass(frozen=True)
class JudgeWork:
    """A judge rank's own prompts, generated on its rollout rank."""

    prompt_ids: list[list[int]]
    rows: list[dict]
    seeds: list[int]
    keep: int
    max_new_tokens: list[int] | None = None  # the long-tail policy's budget per prompt, if it set one


@dataclass(frozen=True)
class FinishedGroup:
    """One prompt's samples, to be judged; ``group`` travels only when the judge rank owns the prompt."""

    owner: int
    index: int  # the prompt's index among its owner's prompts
    prompt: str
    texts: list[str]
    row: dict
    group: list[Completion] | None


@dataclass(frozen=True)
class EndOfStream:
    """No more groups this step."""


@dataclass(frozen=True)
class JudgedScores:
    """The judge's scores of the rollout rank's own groups: {reward name: {prompt index: scores}}."""

    scores: dict[str, dict[int, list[float]]] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamFailure:
    """The sender failed; ``cause`` is ``"<type>: <message>"``."""

    origin: int
    cause: str


def send(message, dst: int, group) -> list:
    with wire.category("rollout"):
        return collectives.isend_object(message, dst, group)


def receive(src: int, group) -> Any:
    with wire.category("rollout"):
        return checked(collectives.recv_object(src, group))


class Incoming:
    """The next message from ``src``, posted now and polled while the judge works."""

    def __init__(self, src: int, group) -> None:
        with wire.category("rollout"):
            self.pending = collectives.PendingObject(src, group)

    def ready(self) -> bool:
        return self.pending.ready()

    def take(self) -> Any:
        with wire.category("rollout"):
            return checked(self.pending.take())


def checked(message) -> Any:
    """``message``, unless it reports the sender's failure: then raise it here (not yet agreed)."""
    if isinstance(message, StreamFailure):
        raise RankFailure(
            message.origin, message.cause, agreed=False, how="the other side of the rollout/judge stream failed"
        )
    return message


def tell_failure(error: BaseException, me: int, dst: int, group) -> None:
    """Tell ``dst`` that this side failed with ``error`` (it waits for the stream)."""
    from yatt_lightning.distributed.failures import describe

    origin = error.origin if isinstance(error, RankFailure) else me
    for request in send(StreamFailure(origin, describe(error)), dst, group):
        request.wait()
