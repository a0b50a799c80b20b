"""What a rank does in its placement: the one type every rank-dependent branch asks (never a string)."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """``COLOCATED``: the whole step, in turn (full and partial colocation). ``TRAINER`` and ``ROLLOUT``: the two
    sides of a disaggregated placement, a bounded number of policy versions apart. A string enum, so that a
    user's callback comparing ``strategy.role == "rollout"`` still works; the library asks the properties."""

    COLOCATED = "colocated"
    TRAINER = "train"
    ROLLOUT = "rollout"

    @property
    def trains(self) -> bool:
        """Holds the Megatron policy and its optimizer (a rollout rank holds only its engines)."""
        return self is not Role.ROLLOUT

    @property
    def split(self) -> bool:
        """The step runs across processes: batches and weights go over channels, saves follow the trainers'
        decisions."""
        return self is not Role.COLOCATED

    @property
    def only_trains(self) -> bool:
        """A disaggregated trainer: trains on batches it receives, publishes the weights it made."""
        return self is Role.TRAINER

    @property
    def only_rolls_out(self) -> bool:
        """A disaggregated rollout rank: generates and scores ahead of the trainers, follows their saves."""
        return self is Role.ROLLOUT
