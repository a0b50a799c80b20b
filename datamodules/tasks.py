"""Built-in synthetic tasks: prompts with a verifiable answer, generated from a seed.

The default task, :class:`AlphabetTask`, asks a model to continue the alphabet from a letter
("after f" -> "g h i j"). A random-initialised tiny model can learn it with RL in minutes on
two CPU cores: the right next token depends only on the previous token, so even a two-layer model
represents the rule, and the rule reward (:func:`yatt_lightning.rewards.rules.alphabet_reward`)
gives partial credit per position so the signal is dense from step one.
"""

from __future__ import annotations

import json
import os
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LETTERS = string.ascii_lowercase


class Task:
    """Base class of the built-in tasks a :class:`~yatt_lightning.datamodules.prompt.PromptDataModule`
    draws rows from (``data.task``: a ``class_path``): :meth:`rows` returns them, from the task's seed."""

    def rows(self) -> list[dict]:
        raise NotImplementedError


class AlphabetTask(Task):
    """Rows ``{"prompt": "after f", "answer": "g h i j"}`` for random start letters.

    With ``context`` > 1 a prompt shows the 1 to ``context`` letters leading up to the start ("after d e f" ->
    "g h i j"): 26 x ``context`` distinct prompts instead of 26. ``held_out`` splits them by a fixed rule, so that
    a held-out set shares no prompt with a training set of any seed: a prompt is held out when the index of
    its last letter plus the number of letters it shows is a multiple of 4 (for ``context: 4``: 26 of the 104
    prompts, every start letter held out at exactly one length; for ``context: 1``: the starts d h l p t x).

    Args:
        num_rows: How many rows the task yields (its dataset length).
        answer_len: How many letters the answer holds.
        seed: Seed of the row generator; the same seed yields the same rows.
        context: The most letters a prompt shows (1: "after f" only, the default task).
        held_out: ``None``: every prompt; ``False``: the training prompts only; ``True``: the held-out ones only.
    """

    def __init__(self, num_rows: int = 4096, answer_len: int = 4, seed: int = 0, context: int = 1,
                 held_out: bool | None = None) -> None:  # fmt: skip
        if num_rows < 1:
            raise ValueError(f"AlphabetTask: `num_rows` must be >= 1, got {num_rows}.")
        if not 1 <= answer_len <= 25:
            raise ValueError(f"AlphabetTask: `answer_len` must be in 1..25, got {answer_len}.")
        if not 1 <= context <= 26:
            raise ValueError(f"AlphabetTask: `context` must be in 1..26, got {context}.")
        self.num_rows = num_rows
        self.answer_len = answer_len
        self.seed = seed
        self.context = context
        self.held_out = held_out
        self.prompts = [(start, n) for n in range(1, context + 1) for start in LETTERS
                        if held_out is None or self.is_held_out(start, n) == held_out]  # fmt: skip

    @staticmethod
    def is_held_out(start: str, shown: int) -> bool:
        """The split's rule: the prompt ending at ``start`` and showing ``shown`` letters is held out."""
        return (LETTERS.index(start) + shown) % 4 == 0

    def rows(self) -> list[dict]:
        rng = random.Random(self.seed)
        return [self.row(*rng.choice(self.prompts)) for _ in range(self.num_rows)]

    def row(self, start: str, shown: int = 1) -> dict:
        i = LETTERS.index(start)
        answer = " ".join(LETTERS[(i + k) % 26] for k in range(1, self.answer_len + 1))
        return {"prompt": "after " + " ".join(LETTERS[(i - k) % 26] for k in range(shown - 1, -1, -1)),
                "answer": answer}  # fmt: skip


class EveryPrompt(Task):
    """Each distinct prompt of an :class:`AlphabetTask` once, in order (a held-out set to validate on).

    Args:
        task: The task whose prompts (``task.prompts``: its split's, with ``held_out``) are listed.
    """

    def __init__(self, task: AlphabetTask) -> None:
        self.task = task

    def rows(self) -> list[dict]:
        return [self.task.row(start, shown) for start, shown in self.task.prompts]


class AlphabetPairsTask(AlphabetTask):
    """Preference pairs of the alphabet task: rows ``{"prompt": "after f", "chosen": "g h i j", "rejected": ...}``,
    the rejected answer the right one with one letter wrong (a near miss), for a DPO stage.

    Args:
        num_rows: How many rows the task yields.
        answer_len: How many letters each answer holds.
        seed: Seed of the row generator.
        context: The most letters a prompt shows (see :class:`AlphabetTask`).
        held_out: ``None``: every prompt; ``False``: the training prompts; ``True``: the held-out ones (a
            held-out set shares no prompt with the training one).
    """

    def rows(self) -> list[dict]:
        rng = random.Random(self.seed)
        rows = []
        for _ in range(self.num_rows):
            row = self.row(*rng.choice(self.prompts))
            letters = row["answer"].split()
            k = rng.randrange(len(letters))  # one letter wrong: a near miss, not noise
            letters[k] = rng.choice([c for c in LETTERS if c != letters[k]])
            rejected = " ".join(letters)
            rows.append({"prompt": row["prompt"], "chosen": row.pop("answer"), "rejected": rejected})
        return rows


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (240, 220, 40)}


class ColourTask:
    """Name the colour of a square: rows ``{"prompt": "<image>\\ncolour:", "images": [png], "answer": "red"}``.

    The image is the only thing that differs between rows, so a policy that ignores it cannot beat
    chance (1 in ``len(COLOURS)``). Each image is a square of the row's colour on a grey background, at a
    random position and size (at least ``min_fill`` of the side), its colour jittered, so the colour is
    not a fixed pixel value. The images and the
    JSON-lines file are written once to a folder (:meth:`write`) and read through
    :class:`~yatt_lightning.datamodules.image_prompt.ImagePromptDataModule` like a user's dataset.

    Args:
        num_rows: Rows (images) the task yields.
        image_size: Width and height of each image, in pixels.
        min_fill: The square's smallest side, as a fraction of the image's.
        seed: Seed of the colours, positions and noise.
    """

    def __init__(self, num_rows: int = 512, image_size: int = 56, min_fill: float = 0.75, seed: int = 0) -> None:
        if not 0 < min_fill <= 1:
            raise ValueError(f"ColourTask: `min_fill` must be in (0, 1], got {min_fill}.")
        self.min_fill = min_fill
        if num_rows < 1:
            raise ValueError(f"ColourTask: `num_rows` must be >= 1, got {num_rows}.")
        if image_size < 8:
            raise ValueError(f"ColourTask: `image_size` must be >= 8, got {image_size}.")
        self.num_rows, self.image_size, self.seed = num_rows, image_size, seed

    def images(self) -> Iterator[tuple[str, Any]]:
        """(colour, PIL image) per row."""
        from PIL import Image, ImageDraw

        rng = random.Random(self.seed)
        size = self.image_size
        for _ in range(self.num_rows):
            name = rng.choice(sorted(COLOURS))
            image = Image.new("RGB", (size, size), (128, 128, 128))
            side = rng.randint(int(size * self.min_fill), size)
            x, y = rng.randint(0, size - side), rng.randint(0, size - side)
            jitter = [max(0, min(255, c + rng.randint(-20, 20))) for c in COLOURS[name]]
            ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=tuple(jitter))
            yield name, image

    def write(self, folder: Path) -> Path:
        """Write the images and ``prompts.jsonl`` under ``folder`` (once); returns the jsonl path."""
        from filelock import FileLock

        path = folder / "prompts.jsonl"
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".lock")):  # ranks of one machine build it once
            if path.is_file():
                return path
            (folder / "images").mkdir(exist_ok=True)
            lines = []
            for i, (name, image) in enumerate(self.images()):
                image.save(folder / "images" / f"{i}.png")
                lines.append(json.dumps({"prompt": "<image>\ncolour:", "images": [f"images/{i}.png"], "answer": name}))
            tmp = path.with_suffix(".tmp")
            tmp.write_text("\n".join(lines) + "\n")
            os.replace(tmp, path)
        return path

    def folder(self) -> Path:
        """Where the task is written by default: under the model cache, named by its arguments."""
        from yatt_lightning.models.build_cache import cache_dir

        return cache_dir() / f"colour-task-{self.num_rows}-{self.image_size}-{self.min_fill}-{self.seed}"


class ArithmeticTask(Task):
    """Sums with a boxed answer: rows ``{"prompt": "3+4=\\boxed{", "answer": "7"}``.

    The prompt opens the box and the completion closes it (``7}``): :class:`~yatt_lightning.rewards.math.MathReward`
    reads an answer the prompt started as boxed, and :class:`~yatt_lightning.rewards.math.BoxedFormatReward`
    scores the box closed on a non-empty answer (``configs/grpo_math_tiny.yaml``). A tiny model's tokenizer spells
    ``\\boxed{`` in seven tokens, which a random-initialised policy never writes by chance.

    Args:
        num_rows: How many rows.
        max_operand: Operands are drawn from 0..max_operand.
        seed: Seed of the operands.
    """

    def __init__(self, num_rows: int = 4096, max_operand: int = 4, seed: int = 0) -> None:
        if num_rows < 1 or max_operand < 1:
            raise ValueError(f"ArithmeticTask: `num_rows` and `max_operand` must be >= 1, got {num_rows}, {max_operand}.")
        self.num_rows, self.max_operand, self.seed = num_rows, max_operand, seed

    def rows(self) -> list[dict]:
        rng = random.Random(self.seed)
        pairs = [(rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)) for _ in range(self.num_rows)]
        return [{"prompt": f"{a}+{b}=\\boxed{{", "answer": str(a + b)} for a, b in pairs]


class LookupTask(Task):
    """An answer only a tool knows: rows ``{"prompt": "key q", "store": {"q": "7"}, "answer": "7"}``.

    The answer is a random digit, drawn apart from the key, so text alone scores at chance (1 in 10); the
    :class:`~yatt_lightning.agents.tools.Lookup` tool reads it from the row's ``store`` (under the key the
    call names, or the row's ``key`` with ``Lookup(key_field="key")``: ``configs/agent_lookup_tiny.yaml``).

    Args:
        num_rows: How many rows.
        seed: Seed of the keys and answers.
    """

    def __init__(self, num_rows: int = 4096, seed: int = 0) -> None:
        if num_rows < 1:
            raise ValueError(f"LookupTask: `num_rows` must be >= 1, got {num_rows}.")
        self.num_rows, self.seed = num_rows, seed

    def rows(self) -> list[dict]:
        rng = random.Random(self.seed)
        rows = []
        for _ in range(self.num_rows):
            key, answer = rng.choice(LETTERS), str(rng.randrange(10))
            rows.append({"prompt": f"key {key}", "key": key, "store": {key: answer}, "answer": answer})
        return rows


class GuessTask(Task):
    """A secret number to find from replies: rows ``{"prompt": "guess 0 to 7", "secret": 3}`` for
    :class:`~yatt_lightning.agents.games.GuessEnvironment`, which answers each guess with higher / lower.

    Args:
        num_rows: How many rows.
        high: Secrets are drawn from 0..high (at most 9: one digit).
        seed: Seed of the secrets.
    """

    def __init__(self, num_rows: int = 4096, high: int = 7, seed: int = 0) -> None:
        if num_rows < 1:
            raise ValueError(f"GuessTask: `num_rows` must be >= 1, got {num_rows}.")
        if not 1 <= high <= 9:
            raise ValueError(f"GuessTask: `high` must be in 1..9, got {high}.")
        self.num_rows, self.high, self.seed = num_rows, high, seed

    def rows(self) -> list[dict]:
        rng = random.Random(self.seed)
        return [
            {"prompt": f"guess 0 to {self.high}", "secret": rng.randint(0, self.high)} for _ in range(self.num_rows)
        ]
