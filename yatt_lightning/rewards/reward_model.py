"""RewardModel: a scalar reward model (a Hugging Face sequence classifier with one output, i.e. a value
head on a decoder) scoring prompt + completion. It runs with transformers on each rank's own device."""

from __future__ import annotations

from typing import Literal

import torch

from yatt_lightning.checkpoint.model_source import resolve_model_path
from yatt_lightning.rewards.base import RewardFunction, RewardOutput


class RewardModel(RewardFunction):
    """Args:
    model: A Hugging Face folder of an ``AutoModelForSequenceClassification`` model with ``num_labels=1``.
    batch_size: Samples per forward pass.
    max_length: Longest prompt + completion, in tokens (cut from the left).
    weight: Multiplies the scores in the sum of rewards.
    on_error: ``raise`` or ``zero``.
    name: Name in logs.
    timeout_s: Deadline of scoring one batch, in seconds; ``None``: ``model.reward_timeout_s``.
    """

    def __init__(
        self,
        model: str,
        batch_size: int = 16,
        max_length: int = 1024,
        weight: float = 1.0,
        on_error: Literal["raise", "zero"] = "raise",
        name: str = "reward_model",
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(weight=weight, on_error=on_error, name=name, timeout_s=timeout_s)
        for key, value in (("batch_size", batch_size), ("max_length", max_length)):
            if value < 1:
                raise ValueError(f"RewardModel: `{key}` must be >= 1, got {value}.")
        self.path = resolve_model_path(model, key="model.rewards.model")
        self.batch_size = batch_size
        self.max_length = max_length
        self._model = None

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(self.path)
        if model.config.num_labels != 1:
            raise ValueError(
                f"`model.rewards.model`: {self.path} has {model.config.num_labels} labels; a reward model has 1."
            )
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self._model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()

    @torch.no_grad()
    def score(self, prompts, completions, rows) -> RewardOutput:
        if self._model is None:
            self._load()
        scores: list[float] = []
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                max_length=self.max_length,
            ).to(self._model.device)  # fmt: skip
            scores += self._model(**batch).logits[:, 0].float().tolist()
        return RewardOutput(scores)
