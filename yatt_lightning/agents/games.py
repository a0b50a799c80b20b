"""The built-in tasks' environments and scores, small enough that learning shows on the tiny models.

- :class:`GuessEnvironment`: find the row's ``secret`` (0..9) from higher / lower replies; the reward falls
  with the turns used. A turn's guess is the first digit it holds, so a random policy guesses often.
- :func:`lookup_score`: the lookup task's final answer (the first digit of the turn without a call) against
  the row's ``answer``; the :class:`~yatt_lightning.agents.tool_env.ToolEnvironment` scores it with
  ``score``, and the call is one letter (``RegexCalls``), which a random policy writes often.
"""

from __future__ import annotations

import re

from yatt_lightning.agents.environment import Environment, Episode, Observation

_DIGIT = re.compile(r"\d")


def first_digit(text: str) -> int | None:
    match = _DIGIT.search(text)
    return int(match.group()) if match else None


def lookup_score(prompt: str, final: str, answer: str, **row) -> float:
    """1.0 when the final answer's (``final``) first digit is the row's ``answer``."""
    digit = first_digit(final)
    return float(digit is not None and str(digit) == str(answer))


class GuessEnvironment(Environment):
    """Guess the row's ``secret``: each turn's first digit is a guess, answered ``+`` (higher), ``-`` (lower)
    or ``?`` (no digit); a right guess ends the episode with reward ``1 - penalty x (turns - 1)`` (at least
    0); an episode that runs out of turns gets 0.

    Args:
        penalty: What each turn after the first costs.
        field: The row's field that holds the secret.
    """

    def __init__(self, penalty: float = 0.2, field: str = "secret") -> None:
        if not 0 <= penalty <= 1:
            raise ValueError(f"GuessEnvironment: `penalty` must be in [0, 1], got {penalty}.")
        self.penalty, self.field = penalty, field

    def reset(self, row: dict, seed: int) -> Episode:
        if self.field not in row:
            raise ValueError(f"GuessEnvironment: the row has no {self.field!r} field: {row!r:.200}")
        return _Guessing(int(row[self.field]), self.penalty)

    def check_row(self, row: dict, where: str) -> None:
        if not isinstance(row.get(self.field), int):
            raise ValueError(f"{where}: GuessEnvironment needs an integer {self.field!r} field in every row.")


class _Guessing(Episode):
    def __init__(self, secret: int, penalty: float) -> None:
        self.secret, self.penalty, self.turns = secret, penalty, 0

    def step(self, text: str) -> Observation:
        self.turns += 1
        guess = first_digit(text)
        if guess == self.secret:
            return Observation(reward=max(0.0, 1.0 - self.penalty * (self.turns - 1)), done=True)
        reply = "?" if guess is None else "+" if guess < self.secret else "-"
        return Observation(f" {reply}", role="user")
