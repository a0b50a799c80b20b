"""GenerativeRewardModel: an LLM judge on its own vLLM engine scores each sample.

The judge sees a prompt built from a template (``{prompt}``, ``{completion}`` and any field of the row,
e.g. ``{answer}``), wrapped in the judge tokenizer's chat template when it has one, and answers greedily;
a parser reads the score. A judgment the parser cannot read is counted (``reward/<name>/unparsed``),
logged with its raw text, and scores ``unparsed_score``. Where its engine runs (on every rank, or on the
judge ranks of a partial colocation) is the placement's decision (:mod:`yatt_lightning.placement`).
"""

from __future__ import annotations

import logging
import string
from typing import Literal

from yatt_lightning.chat import render
from yatt_lightning.checkpoint.model_source import resolve_model_path
from yatt_lightning.engines.vllm_engine import VLLMEngine
from yatt_lightning.rewards.base import RewardFunction, RewardOutput, public_fields
from yatt_lightning.rewards.parsers import NumberParser, ScoreParser

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "Rate the answer to the question from 0 (wrong) to 10 (perfect). Reply with the number only.\n"
    "Question: {prompt}\nAnswer: {completion}\nScore:"
)


class GenerativeRewardModel(RewardFunction):
    """Args:
    model: The judge: a Hugging Face model folder or a built-in model (``builtin:tiny-qwen2``).
    template: The judge's prompt; ``{prompt}``, ``{completion}`` and the row's fields are filled in.
    parser: Reads the score from the judgment (default: the first number, 0-10, scaled to [0, 1]).
    max_new_tokens: Longest judgment. With ``choices``, judgments stop once the longest choice could be
        spelled (see :attr:`judgment_tokens`).
    choices: Constrain the judgment to one of these strings (vLLM structured outputs), e.g. the digits
        0-9; the parser then always finds a score. ``None`` lets the judge write freely.
    unparsed_score: Score of a sample whose judgment cannot be read.
    max_judge_tokens: Longest judge prompt, in tokens (longer prompts are cut from the left).
    engine: The judge's vLLM engine settings.
    weight: Multiplies the scores in the sum of rewards.
    on_error: ``raise`` or ``zero`` when the judge fails.
    name: Name in logs (``reward/<name>/...``).
    timeout_s: Deadline of scoring one batch, in seconds; ``None``: ``model.reward_timeout_s``.
    """

    def __init__(
        self,
        model: str,
        template: str = DEFAULT_TEMPLATE,
        parser: ScoreParser | None = None,
        max_new_tokens: int = 16,
        choices: list[str] | None = None,
        unparsed_score: float = 0.0,
        max_judge_tokens: int = 512,
        engine: VLLMEngine | None = None,
        weight: float = 1.0,
        on_error: Literal["raise", "zero"] = "raise",
        name: str = "judge",
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(weight=weight, on_error=on_error, name=name, timeout_s=timeout_s)
        if "{completion}" not in template:
            raise ValueError("GenerativeRewardModel: `template` must contain {completion}.")
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as err:
            raise ValueError(
                f"GenerativeRewardModel: `template` is not a valid format string ({err}); write literal braces as "
                "{{ and }}."
            ) from err
        for name in fields:
            if not name.isidentifier():
                raise ValueError(
                    f"GenerativeRewardModel: `template` field {{{name}}} is not a row field's name; write literal "
                    'braces as {{ and }} (e.g. {{"score": 7}}).'
                )
        if max_new_tokens < 1:
            raise ValueError(f"GenerativeRewardModel: `max_new_tokens` must be >= 1, got {max_new_tokens}.")
        self.model = model
        self.template = template
        self.template_fields = frozenset(fields)
        self.parser = parser or NumberParser()
        self.max_new_tokens = max_new_tokens
        self.choices = choices
        self.unparsed_score = unparsed_score
        self.max_judge_tokens = max_judge_tokens
        self.engine = engine or VLLMEngine()
        self.tokenizer = None

    # ------------------------------------------------------------------ engine
    def start(self, *, seed: int, max_num_seqs: int, dtype: str) -> None:
        """Start the judge's engine on this rank (called by the placement)."""
        from transformers import AutoTokenizer

        path = resolve_model_path(self.model, key="model.rewards.model")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.engine.start(
            path, tensor_parallel_size=1, seed=seed, max_num_seqs=max_num_seqs,
            max_model_len=self.max_judge_tokens + self.judgment_tokens, dtype=dtype,
        )  # fmt: skip

    def shutdown(self) -> None:
        self.engine.shutdown()

    @property
    def judgment_tokens(self) -> int:
        """Tokens a judgment may take. With ``choices`` no more than the longest choice has bytes (a token
        spells at least one): a judgment that spelled its choice then stops by length instead of spending
        one more engine step to sample end-of-text (single-digit choices: one step instead of two)."""
        if not self.choices:
            return self.max_new_tokens
        return min(self.max_new_tokens, max(len(c.encode()) for c in self.choices))

    @property
    def started(self) -> bool:
        return self.engine.llm is not None

    def metric_names(self) -> list[str]:
        return [*super().metric_names(), f"reward/{self.name}/unparsed"]

    # ------------------------------------------------------------------ scoring
    def row_problem(self, fields: frozenset[str]) -> str | None:
        """A template field that the row lacks (the parser reads the judgment's text only: no row field)."""
        missing = sorted(self.template_fields - fields - {"prompt", "completion"})
        if not missing:
            return None
        names = ", ".join("{" + name + "}" for name in missing)
        return (
            f"the `template` of judge {self.name} names {names}, which this row lacks (its fields: "
            f"{', '.join(sorted(fields)) or 'none'}); add {', '.join(map(repr, missing))} to every row, or take "
            f"{names} out of the template."
        )

    def judge_prompts(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[list[int]]:
        out = []
        for prompt, completion, row in zip(prompts, completions, rows, strict=True):
            fields = {**public_fields(row), "prompt": prompt, "completion": completion}
            try:
                text = self.template.format(**fields)
            except KeyError as err:
                raise ValueError(
                    f"`template` field {{{err.args[0]}}} is not in the row ({row.get('_source', 'built-in task')}), "
                    f"which has {sorted(fields)}"
                ) from None
            if getattr(self.tokenizer, "chat_template", None):
                ids = render(self.tokenizer, [{"role": "user", "content": text}])
            else:
                ids = self.tokenizer(text)["input_ids"]
            out.append(ids[-self.max_judge_tokens :])
        return out

    def score(self, prompts: list[str], completions: list[str], rows: list[dict]) -> RewardOutput:
        self._require_engine()
        judgments = self.engine.complete(
            self.judge_prompts(prompts, completions, rows), self.judgment_tokens, choices=self.choices
        )
        return self.read(judgments)

    def submit(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[str]:
        """Queue judgments without waiting (streaming placements); their texts arrive through ``engine.poll``."""
        self._require_engine()
        return self.engine.submit(
            self.judge_prompts(prompts, completions, rows), self.judgment_tokens, choices=self.choices
        )

    def read(self, judgments: list[str]) -> RewardOutput:
        """Scores from judgment texts; unreadable ones score ``unparsed_score`` and are counted and logged."""
        scores, unparsed = [], []
        for text in judgments:
            value = self.parser(text)
            if value is None:
                unparsed.append(text)
                value = self.unparsed_score
            scores.append(value)
        if unparsed:
            log.warning(
                "%s: %d of %d judgments unreadable, e.g. %r",
                self.name,
                len(unparsed),
                len(judgments),
                unparsed[0][:200],
            )
        return RewardOutput(scores, {f"reward/{self.name}/unparsed": float(len(unparsed))})

    def _require_engine(self) -> None:
        if not self.started:
            raise RuntimeError(f"{self.name}: the judge's engine is not running on this rank (see the placement).")
