"""Partial colocation's roles: which ranks generate, which judge, and who is paired with whom."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Pairing:
    """The rollout and judge ranks of partial colocation, and the stream's own process group.

    Each judge rank is paired with rollout rank ``index % len(rollout)``; ``min_judge_batch``: see
    :class:`~yatt_lightning.placement.PartialColocation`.
    """

    rollout: list[int]
    judge: list[int]
    min_judge_batch: int | None = None
    group: Any = None

    def partner_rollout(self, rank: int) -> int:
        return self.rollout[self.judge.index(rank) % len(self.rollout)]

    def partner_judges(self, rank: int) -> list[int]:
        return [j for j in self.judge if self.partner_rollout(j) == rank]

    def judge_for(self, owner: int, own_turns: Iterator[int]) -> int:
        """The judge rank a finished group goes to: its owner when that is a judge rank (its scores and
        samples are then where it trains), else the next of the rollout rank's judges in turn."""
        return owner if owner in self.judge else next(own_turns)

    def judge_batch(self, rank: int, n_prompts: int, n_samples: int) -> int:
        """Samples the judge on ``rank`` holds before judging while idle (see ``min_judge_batch``)."""
        if self.min_judge_batch is not None:
            return self.min_judge_batch
        source = self.partner_rollout(rank)
        judges = len(self.partner_judges(source))
        expected = n_prompts * n_samples * (judges + 1) / judges  # its own groups and a share of the source's
        return max(1, int(expected) // 4)
