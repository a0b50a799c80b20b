"""Rule-based rewards for the built-in tasks."""

from __future__ import annotations

import string

_LETTERS = set(string.ascii_lowercase)


def alphabet_reward(prompt: str, completion: str, answer: str, **row) -> float:
    """Reward for :class:`yatt_lightning.datamodules.tasks.AlphabetTask`, in [0, 1].

    Half the reward is format (the share of the expected positions holding a single lowercase letter),
    half is correctness (the share of positions equal to the expected letter). Words beyond the
    expected length are ignored; missing ones score 0. The format half gives a dense signal from a
    random-initialised model; the correctness half is the task.
    """
    expected = answer.split()
    got = completion.split()[: len(expected)]
    letters = sum(1 for w in got if w in _LETTERS)
    correct = sum(1 for w, e in zip(got, expected, strict=False) if w == e)
    return 0.5 * letters / len(expected) + 0.5 * correct / len(expected)
