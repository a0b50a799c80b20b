"""Built-in synthetic tasks: prompts with a verifiable answer, generated from a seed.

The default task, :class:`AlphabetTask`, asks a model to continue the alphabet from a letter
("after f" -> "g h i j"). A random-initialised tiny model can learn it with RL in minutes on
two CPU cores: the right next token depends only on the previous token, so even a two-layer model
represents the rule, and the rule reward (:func:`yatt_lightning.rewards.rules.alphabet_reward`)
gives partial credit per position so the signal is dense from step one.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator

LETTERS = string.ascii_lowercase


class AlphabetTask:
    """Rows ``{"prompt": "after f", "answer": "g h i j"}`` for random start letters.

    Args:
        num_rows: How many rows the task yields (its dataset length).
        answer_len: How many letters the answer holds.
        seed: Seed of the row generator; the same seed yields the same rows.
    """

    def __init__(self, num_rows: int = 4096, answer_len: int = 4, seed: int = 0) -> None:
        if num_rows < 1:
            raise ValueError(f"AlphabetTask: `num_rows` must be >= 1, got {num_rows}.")
        if not 1 <= answer_len <= 25:
            raise ValueError(f"AlphabetTask: `answer_len` must be in 1..25, got {answer_len}.")
        self.num_rows = num_rows
        self.answer_len = answer_len
        self.seed = seed

    def rows(self) -> list[dict]:
        rng = random.Random(self.seed)
        return [self.row(rng.choice(LETTERS)) for _ in range(self.num_rows)]

    def row(self, start: str) -> dict:
        i = LETTERS.index(start)
        answer = " ".join(LETTERS[(i + k) % 26] for k in range(1, self.answer_len + 1))
        return {"prompt": f"after {start}", "answer": answer}

    @staticmethod
    def corpus() -> Iterator[str]:
        """Text covering the task's vocabulary, used to train the tiny model's tokenizer."""
        yield "after comes"
        yield " ".join(LETTERS + LETTERS)
        yield " ".join(string.digits)
        yield ". , : ? ! - + ="
