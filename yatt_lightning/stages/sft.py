"""Supervised fine-tuning on the same Megatron policy, strategy, checkpoints and CLI as RL.

``SFTModule`` trains the policy on prompt-completion rows or chat rows (:mod:`yatt_lightning.stages.base`):
the loss is the negative log-likelihood of the tokens under the loss mask, averaged per token over the whole
global batch (Megatron divides by the tokens summed over micro-batches and data-parallel ranks), so it is the
same under any layout. Micro-batches hold ``micro_batch_size`` sequences, or, with ``micro_batch_tokens``,
as many as fit that many padded tokens (:func:`~yatt_lightning.training.packing.pack_by_tokens`). With a
held-out set in the data module (``data.val_path`` / ``data.val_task``) and Lightning's
``trainer.val_check_interval``, ``sft/val_loss`` is logged before training (Lightning's sanity check, with
``trainer.num_sanity_val_steps: -1``) and every so many steps. No rollout engine starts.
"""

from __future__ import annotations

from typing import Literal

import torch
from typing_extensions import override

from yatt_lightning.checkpoint.model_source import ModelSpec
from yatt_lightning.models.logprobs import token_logprobs
from yatt_lightning.models.lora import LoRASettings
from yatt_lightning.models.optim import OptimizerSettings
from yatt_lightning.stages.base import PolicyStage, Sequence
from yatt_lightning.training.batch import MicroBatch, TrainingBatch


class SFTModule(PolicyStage):
    """Args:
    policy: The model to fine-tune (a Hugging Face folder, an exported checkpoint of any stage).
    optimizer: Optimizer settings.
    target: The row's field holding the completion to learn; a chat row without it is learnt on its
        assistant turns.
    target_prefix: Put before the target's text (a space after a plain-text prompt, say).
    micro_batch_size: Sequences per forward/backward micro-batch (without ``micro_batch_tokens``).
    micro_batch_tokens: Padded tokens per micro-batch: sequences are packed to this budget, longest first.
    max_seq_tokens: Longest sequence (prompt and completion).
    on_overlong: A longer sequence: ``cut`` (counted in ``sft/cut``) or ``refuse``.
    apply_chat_template: Render prompts with the tokenizer's chat template when it has one.
    system_prompt: A system message in front of every prompt (needs a chat template).
    seed: Seed (``None`` follows ``seed_everything``).
    lora: Train LoRA adapters on the frozen policy (:class:`~yatt_lightning.models.lora.LoRASettings`).
    """

    name = "sft"

    def __init__(
        self,
        policy: ModelSpec = ModelSpec(),
        optimizer: OptimizerSettings = OptimizerSettings(),
        target: str = "completion",
        target_prefix: str = "",
        micro_batch_size: int = 32,
        micro_batch_tokens: int | None = None,
        max_seq_tokens: int = 256,
        on_overlong: Literal["cut", "refuse"] = "cut",
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        seed: int | None = None,
        lora: LoRASettings | None = None,
    ) -> None:
        super().__init__(policy, optimizer, max_seq_tokens, on_overlong, apply_chat_template, system_prompt, seed, lora)
        if micro_batch_size < 1:
            raise ValueError(f"`model.micro_batch_size` must be >= 1, got {micro_batch_size}.")
        if micro_batch_tokens is not None and micro_batch_tokens < max_seq_tokens:
            raise ValueError(
                f"`model.micro_batch_tokens`={micro_batch_tokens} must hold at least one sequence of "
                f"`model.max_seq_tokens`={max_seq_tokens}."
            )
        self.target, self.target_prefix = target, target_prefix
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        self.val_sums = [0.0, 0.0]

    @override
    def sequences(self, rows: list[dict]) -> list[Sequence]:
        return [self.sequence(row, self.target, self.target_prefix) for row in rows]

    def batch_microbatches(self, rows: list[dict]) -> list[MicroBatch]:
        seqs = self.sequences(rows)
        batch = TrainingBatch(self.samples(seqs))
        budget = self.micro_batch_tokens
        plan = batch.plan_by_tokens(list(range(len(batch))), budget, overhead_tokens=0) if budget else None
        return self.microbatches(batch, self.micro_batch_size, plan)

    @override
    def training_step(self, batch: list[dict], batch_idx: int) -> None:
        mbs = self.batch_microbatches(batch)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        outputs = self.policy.forward_backward(mbs, _nll, forward_only=False)
        optimizer.step()
        nll, tokens = self.all_reduce_sums([sum(float(o[k]) for o in outputs) for k in ("nll", "tokens")])
        self.log_dict({"sft/loss": nll / max(tokens, 1.0), "sft/tokens": tokens, "sft/micro_batches": float(len(mbs)),
                       "sft/grad_norm": optimizer.last_grad_norm, "sft/cut": float(self.cut)},
                      prog_bar=False, rank_zero_only=True)  # fmt: skip

    @override
    def validation_step(self, batch: list[dict], batch_idx: int) -> None:
        outputs = self.policy.forward_backward(self.batch_microbatches(batch), _nll, forward_only=True)
        for k, key in enumerate(("nll", "tokens")):
            self.val_sums[k] += sum(float(o[key]) for o in outputs)

    @override
    def on_validation_epoch_end(self) -> None:
        nll, tokens = self.all_reduce_sums(self.val_sums)
        self.val_sums = [0.0, 0.0]
        if self.trainer.is_global_zero:  # logged during the sanity check too: the loss before training
            for logger in self.trainer.loggers:
                logger.log_metrics({"sft/val_loss": nll / max(tokens, 1.0)}, step=self.trainer.global_step)


def _nll(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The masked tokens' negative log-likelihood, summed; Megatron divides by the tokens."""
    logprobs = token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], 1.0)
    mask = mb.loss_mask
    loss = -(logprobs * mask).sum()
    tokens = mask.sum()
    return loss, tokens.to(torch.int), {"nll": loss.detach(), "tokens": tokens.detach()}
