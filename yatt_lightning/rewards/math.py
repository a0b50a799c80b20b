"""Verifiable math rewards on `math-verify` (Hugging Face's answer verifier): the completion's final answer,
compared symbolically with the row's ``answer`` (``\\boxed{1/2}``, ``0.5`` and ``\\frac{1}{2}`` are one answer),
and a format reward beside it.

math-verify bounds its own parsing with ``signal.alarm``, which works only on a process's main thread; a reward
here runs on the reward deadline's worker thread (``timeout_s`` / ``model.reward_timeout_s``), so math-verify's
timeouts are off and the deadline bounds each call instead.

    rewards:
      - class_path: yatt_lightning.rewards.math.MathReward      # 1 for the right answer, else 0
        init_args: {extract: boxed}
      - class_path: yatt_lightning.rewards.math.BoxedFormatReward
        init_args: {weight: 0.1}
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

from yatt_lightning.rewards.base import RewardFunction, RuleReward

EXTRACTIONS = ("boxed", "last_number")
_BOXED = re.compile(r"\\boxed\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` in ``text``, braces balanced (``\\boxed{\\frac{1}{2}}``)."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def final_answer(completion: str, extract: str) -> str | None:
    """The completion's final answer as text: the last ``\\boxed{...}`` (``boxed``), or the last number,
    commas and fractions included (``last_number``: a boxed answer still wins); ``None`` if it has none."""
    boxed = boxed_contents(completion)
    if boxed:
        return boxed[-1]
    if extract == "boxed":
        return None
    numbers = _NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


def answer_text(prompt: str, completion: str) -> str:
    """The text that holds the answer: the completion, after the box the prompt opened if it ends inside one
    (a prompt ending ``\\boxed{`` asks for the answer in it, and the completion closes it)."""
    start = prompt.rfind("\\boxed{")
    if start >= 0 and not boxed_contents(prompt[start:]):
        return "\\boxed{" + completion
    return completion


@lru_cache(maxsize=65536)
def _parsed(text: str) -> tuple:
    """math-verify's parse of an answer (cached: a group's samples share their gold answer)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return tuple(parse(f"${text}$", extraction_config=configs, parsing_timeout=None))


def equivalent(answer: str, gold: str) -> bool:
    """Whether ``answer`` and ``gold`` are the same mathematical answer (math-verify's ``verify``)."""
    from math_verify import verify

    got, want = _parsed(answer.strip()), _parsed(str(gold).strip())
    if not got or not want:
        return False
    return bool(verify(list(want), list(got), timeout_seconds=None))


class MathReward(RuleReward):
    """1.0 when the completion's final answer equals the row's ``answer`` symbolically, else 0.0 (an answer in a
    box the prompt opened is read in it: :func:`answer_text`).

    Args:
        extract: ``boxed`` (the last ``\\boxed{...}``; no box scores 0) or ``last_number`` (the last box, else
            the last number in the completion).
        weight, on_error, name, timeout_s: As :class:`~yatt_lightning.rewards.base.RuleReward`'s.
    """

    def __init__(
        self,
        extract: Literal["boxed", "last_number"] = "boxed",
        weight: float = 1.0,
        on_error: Literal["raise", "zero"] = "raise",
        name: str = "math",
        timeout_s: float | None = None,
    ) -> None:
        if extract not in EXTRACTIONS:
            raise ValueError(f"`MathReward.extract`: {extract!r} is not one of {', '.join(EXTRACTIONS)}.")
        RewardFunction.__init__(self, weight=weight, on_error=on_error, name=name, timeout_s=timeout_s)
        self.extract = extract
        self.fn = self.score_one  # its signature names the row fields it needs: ``answer``

    def score_one(self, prompt: str, completion: str, answer: str, **row) -> float:
        got = final_answer(answer_text(prompt, completion), self.extract)
        return 1.0 if got is not None and equivalent(got, answer) else 0.0


class BoxedFormatReward(RuleReward):
    """1.0 when the completion puts exactly one non-empty ``\\boxed{...}`` answer, else 0.0 (the format half
    of a math reward: dense early, before answers are right).

    Args:
        weight, on_error, name, timeout_s: As :class:`~yatt_lightning.rewards.base.RuleReward`'s.
    """

    def __init__(
        self,
        weight: float = 1.0,
        on_error: Literal["raise", "zero"] = "raise",
        name: str = "boxed_format",
        timeout_s: float | None = None,
    ) -> None:
        RewardFunction.__init__(self, weight=weight, on_error=on_error, name=name, timeout_s=timeout_s)
        self.fn = self.score_one

    def score_one(self, prompt: str, completion: str, **row) -> float:
        boxed = boxed_contents(answer_text(prompt, completion))
        return 1.0 if len(boxed) == 1 and boxed[0].strip() else 0.0
