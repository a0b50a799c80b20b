"""The module's prompt hooks: a row becomes prompt ids and a sampling seed.

Overridable like the RL step's calls: ``tokenize_prompt`` (a row's ids), ``prompt_format_for`` (how a
model folder's chat template is applied) and ``sample_seeds``. The module holds ``prompt_format``,
``images``, ``max_prompt_tokens`` and ``seed``.
"""

from __future__ import annotations

from yatt_lightning.chat import PromptFormat
from yatt_lightning.distributed.failures import fail_together
from yatt_lightning.distributed.seeding import sampling_seed


class Prompts:
    """Mixed into :class:`~yatt_lightning.module.RLHFModule`."""

    def tokenize_batch(self, batch: list[dict]) -> list[list[int]]:
        """Prompt token ids of this rank's rows. Collective: a prompt that fails to tokenize (too long, say)
        on one rank raises on every rank, before any rank enters the rollout's collectives."""
        with fail_together(self.trainer.strategy.controller.group):
            return [self.tokenize_prompt(row) for row in batch]

    def prompt_format_for(self, path, tokenizer) -> PromptFormat:
        """How this module's rows become prompt ids for the model folder ``path`` (also used by preflight)."""
        tools = self.agent.tool_schemas() if getattr(self, "agent", None) is not None else None
        return PromptFormat.of(
            path, tokenizer, apply_chat_template=self.apply_chat_template, system_prompt=self.system_prompt, tools=tools
        )

    def tokenize_prompt(self, row: dict) -> list[int]:
        """The row's prompt ids (:mod:`yatt_lightning.chat`), image tokens expanded to the model's count."""
        ids = self.prompt_format.ids(row)
        ids = self.images.expand(ids, row.get("images")) if self.images is not None else ids
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(
                f"prompt of {len(ids)} tokens ({row.get('_source', 'built-in task')}) is longer than "
                f"`model.max_prompt_tokens`={self.max_prompt_tokens}; raise it or shorten the prompt."
            )
        return ids

    def sample_seeds(self, batch: list[dict]) -> list[int]:
        """A sampling seed per prompt, fixed by (seed, step, row): a resumed run samples the same."""
        step = self.trainer.global_step
        return [sampling_seed(self.seed, step, row, i) for i, row in enumerate(batch)]
