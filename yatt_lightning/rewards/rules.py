"""Rule-based rewards for the built-in tasks."""

from __future__ import annotations

import re
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


def colour_reward(prompt: str, completion: str, answer: str, **row) -> float:
    """Reward for :class:`yatt_lightning.datamodules.tasks.ColourTask`: 1.0 when the first word is the
    square's colour, else 0.0. A policy blind to the image scores at most 1 in 4 (one colour always).
    No credit for naming a wrong colour: with it, the policy settles on one colour word for every image
    (all samples of a group then score alike and GRPO stops learning) before it learns to look."""
    words = completion.split()
    first = words[0].strip(".,:;!?").lower() if words else ""
    return 1.0 if first == answer else 0.0


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def math_answer_reward(prompt: str, completion: str, answer: str, **row) -> float:
    """1.0 when the completion's final answer equals ``answer``, else 0.0.

    The final answer is the last ``\\boxed{...}`` if there is one, else the last number in the completion.
    Numbers compare by value (``1,000`` = ``1000.0``); anything else compares as stripped text.
    """
    boxed = _BOXED.findall(completion)
    if boxed:
        got = boxed[-1]
    else:
        numbers = _NUMBER.findall(completion)
        if not numbers:
            return 0.0
        got = numbers[-1]
    return 1.0 if _normalise(got) == _normalise(str(answer)) else 0.0


def _normalise(text: str) -> str:
    text = text.strip().rstrip(".").replace("$", "")
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return text
    return repr(value)
