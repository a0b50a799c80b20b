"""Failing together: an error on one rank stops every rank at the same point, naming where it began.

A rank that raises on its own leaves the others waiting in their next collective until the timeout. So
wherever a step can fail on some ranks only (a reward function, a prompt that does not tokenize, a NaN
loss, a checkpoint write, the rollout/judge stream), the ranks first agree: :func:`agree` (or the block
form :func:`fail_together`) all-reduces one flag; if any rank failed, every rank learns every failed
rank's cause and raises the same :class:`RankFailure`, chained to the local exception where there is one.
After an agreed failure the ranks are still in step, so collectives (a save) remain possible; code that
must know checks ``isinstance(err, RankFailure) and err.agreed``.

On one process there is nobody to tell: :func:`agree` re-raises the error itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class RankFailure(RuntimeError):
    """Raised on every rank when any rank failed.

    Attributes:
        origin: The rank where the failure began (the lowest, when several failed on their own).
        cause: ``"<type>: <message>"`` of the error there.
        agreed: True when every rank raises it at the same point (see :func:`agree`); False when one
            rank learned of another's failure by a message (the rollout/judge stream) and has yet to agree.
    """

    def __init__(
        self,
        origin: int,
        cause: str,
        *,
        agreed: bool,
        here: bool = False,
        how: str = "another rank failed",
        others: dict[int, str] | None = None,
    ) -> None:
        self.origin, self.cause, self.agreed, self.how = origin, cause, agreed, how
        self.others = others or {}
        more = "".join(f"; rank {r}: {c}" for r, c in sorted(self.others.items()))
        who = f"rank {origin} failed" if here else f"{how} (rank {origin})"
        super().__init__(f"{who}: {cause}{more}")


def describe(error: BaseException) -> str:
    """``"<type>: <message>"``, the form a cause travels in."""
    return error.cause if isinstance(error, RankFailure) else f"{type(error).__name__}: {error}"


def agree(error: BaseException | None, group=None) -> None:
    """Collective over ``group`` (default: all ranks): raise :class:`RankFailure` on every rank if ``error``
    is not ``None`` on any. The failure's origin is the lowest rank whose own error it was (a rank that
    only heard of another's failure, by a :class:`RankFailure` from the stream, points at that one)."""
    world = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
    if world == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0.0 if error is None else 1.0])
    torch.distributed.all_reduce(flag, group=group)
    if flag.item() == 0:
        return
    mine = None
    if error is not None:
        heard = isinstance(error, RankFailure)
        mine = (error.origin if heard else torch.distributed.get_rank(), describe(error), heard)
    every: list = [None] * world
    torch.distributed.all_gather_object(every, mine, group=group)
    reports = [r for r in every if r is not None]
    own = sorted((r for r in reports if not r[2]), key=lambda r: r[0]) or sorted(reports, key=lambda r: r[0])
    origin, cause, _ = own[0]
    others = {r: c for r, c, heard in own[1:] if not heard and r != origin}
    me = torch.distributed.get_rank()
    how = error.how if isinstance(error, RankFailure) else "another rank failed"
    failure = RankFailure(origin, cause, agreed=True, here=origin == me, how=how, others=others)
    if error is not None and not isinstance(error, RankFailure):
        raise failure from error
    raise failure


@contextlib.contextmanager
def fail_together(group=None) -> Iterator[None]:
    """Collective: run the block, then :func:`agree` on whether it raised on any rank (before the
    collectives that follow, which a failed rank would never reach). An agreed failure passes through."""
    error = None
    try:
        yield
    except RankFailure as err:
        if err.agreed:
            raise
        error = err
    except Exception as err:
        error = err
    agree(error, group)


class NonFiniteLossError(FloatingPointError):
    """The policy loss became NaN or infinite."""


def check_finite(outputs: list[dict], step: int, what: str = "the policy loss", group=None) -> None:
    """Collective over ``group`` (default: all ranks): a NaN/inf loss in any micro-batch (``outputs[i]["finite"]``)
    on any rank stops every rank; ``what``: the loss, as the message names it."""
    bad = sum(1 for o in outputs if not bool(o["finite"]))
    error = None
    if bad:
        error = NonFiniteLossError(
            f"{what} is NaN/inf at step {step} ({bad} micro-batches). Check the rewards (finite?), "
            "lower `model.optimizer.lr`, or keep `model.optimizer.clip_grad` > 0."
        )
    agree(error, group)
