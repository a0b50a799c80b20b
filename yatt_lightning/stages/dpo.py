"""Direct preference optimisation on the same Megatron policy, strategy, checkpoints and CLI as RL.

``DPOModule`` trains on rows ``{prompt, chosen, rejected}`` (field names configurable): each pair's two
sequences sit next to each other in one micro-batch (chosen at even rows, rejected at odd ones), the frozen
reference (the starting weights, forward only) gives its log-probabilities first, and the loss (a
:class:`~yatt_lightning.stages.preference.PreferenceLoss` chosen by ``class_path``: DPO's sigmoid, IPO) is
averaged per pair over the whole global batch, so it is the same under any layout. Figures: ``dpo/loss``,
``dpo/accuracy`` (the chosen's implicit reward above the rejected's; a tie counts a half, so the starting
weights score 0.5), ``dpo/reward_margin``, ``dpo/chosen_reward`` / ``dpo/rejected_reward`` and the
completions' summed ``dpo/chosen_logprob`` / ``dpo/rejected_logprob``; with a held-out set (``data.val_task``
or ``data.val_path``) the same as ``dpo/val_*``.
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
from yatt_lightning.stages.preference import PairLogprobs, PreferenceLoss, SigmoidLoss
from yatt_lightning.training.batch import MicroBatch, TrainingBatch
from yatt_lightning.training.per_sample import sample_logprobs

FIGURES = (
    "loss",
    "accuracy",
    "reward_margin",
    "chosen_reward",
    "rejected_reward",
    "chosen_logprob",
    "rejected_logprob",
)


class DPOModule(PolicyStage):
    """Args:
    policy: The model to train, and the frozen reference's starting weights.
    optimizer: Optimizer settings.
    loss: The preference loss (``class_path``): :class:`~yatt_lightning.stages.preference.SigmoidLoss`
        (DPO), :class:`~yatt_lightning.stages.preference.IPOLoss`.
    chosen: The row's field holding the preferred completion.
    rejected: The row's field holding the other completion.
    completion_prefix: Put before both completions' text (a space after a plain-text prompt, say).
    pairs_per_micro_batch: Pairs (twice as many sequences) per forward/backward micro-batch.
    max_seq_tokens: Longest sequence (prompt and completion).
    on_overlong: A longer sequence: ``cut`` (counted in ``dpo/cut``) or ``refuse``.
    apply_chat_template: Render prompts with the tokenizer's chat template when it has one.
    system_prompt: A system message in front of every prompt (needs a chat template).
    seed: Seed (``None`` follows ``seed_everything``).
    lora: Train LoRA adapters on the frozen policy (:class:`~yatt_lightning.models.lora.LoRASettings`).
    """

    name = "dpo"

    def __init__(
        self,
        policy: ModelSpec = ModelSpec(),
        optimizer: OptimizerSettings = OptimizerSettings(),
        loss: PreferenceLoss = SigmoidLoss(),
        chosen: str = "chosen",
        rejected: str = "rejected",
        completion_prefix: str = "",
        pairs_per_micro_batch: int = 16,
        max_seq_tokens: int = 256,
        on_overlong: Literal["cut", "refuse"] = "cut",
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        seed: int | None = None,
        lora: LoRASettings | None = None,
    ) -> None:
        super().__init__(policy, optimizer, max_seq_tokens, on_overlong, apply_chat_template, system_prompt, seed, lora)
        if pairs_per_micro_batch < 1:
            raise ValueError(f"`model.pairs_per_micro_batch` must be >= 1, got {pairs_per_micro_batch}.")
        self.loss = loss
        self.chosen, self.rejected, self.completion_prefix = chosen, rejected, completion_prefix
        self.pairs_per_micro_batch = pairs_per_micro_batch
        self.reference = None
        self.val_sums = [0.0] * (len(FIGURES) + 1)

    @override
    def build_frozen_models(self, path, dtype) -> None:
        from yatt_lightning.models.policy import MegatronPolicy

        self.reference = MegatronPolicy(path, params_dtype=dtype, optimizer=None, seed=self.seed)

    @override
    def sequences(self, rows: list[dict]) -> list[Sequence]:
        """Each pair's two sequences, chosen at 2i and rejected at 2i + 1."""
        seqs = []
        for row in rows:
            for field in (self.chosen, self.rejected):
                if field not in row:
                    fields = sorted(k for k in row if not k.startswith("_"))
                    raise ValueError(
                        f"{row.get('_source', 'a row')}: a preference row needs `{self.chosen}` and `{self.rejected}` "
                        f"fields (`model.chosen`, `model.rejected`); it has {fields}."
                    )
                seqs.append(self.sequence(row, field, self.completion_prefix))
        return seqs

    def pair_microbatches(self, rows: list[dict]) -> list[MicroBatch]:
        """The pairs' sequences in micro-batches of whole pairs, with the reference's log-probabilities (a
        forward pass of the reference)."""
        seqs = self.sequences(rows)
        batch = TrainingBatch(self.samples(seqs))
        size = 2 * self.pairs_per_micro_batch  # an even size: a pair never straddles two micro-batches
        ref = sample_logprobs(self.reference, self.microbatches(batch, size), len(seqs), 1.0)
        return self.microbatches(TrainingBatch(batch.samples, ref_logprobs=ref), size)

    @staticmethod
    def sums(outputs: list[dict]) -> list[float]:
        """This rank's sums of the figures over its pairs, and the pairs (the last entry)."""
        return [sum(float(o[k]) for o in outputs) for k in (*FIGURES, "pairs")]

    def means(self, sums: list[float]) -> dict[str, float]:
        """The figures' means over every rank's pairs, from every rank's :meth:`sums` (collective)."""
        totals = self.all_reduce_sums(sums)
        pairs = max(totals[-1], 1.0)
        return {k: v / pairs for k, v in zip(FIGURES, totals, strict=False)}

    @override
    def training_step(self, batch: list[dict], batch_idx: int) -> None:
        mbs = self.pair_microbatches(batch)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        outputs = self.policy.forward_backward(mbs, self._pair_loss, forward_only=False)
        optimizer.step()
        means = self.means(self.sums(outputs))
        self.log_dict({**{f"dpo/{k}": v for k, v in means.items()}, "dpo/grad_norm": optimizer.last_grad_norm,
                       "dpo/cut": float(self.cut)}, prog_bar=False, rank_zero_only=True)  # fmt: skip

    @override
    def validation_step(self, batch: list[dict], batch_idx: int) -> None:
        outputs = self.policy.forward_backward(self.pair_microbatches(batch), self._pair_loss, forward_only=True)
        self.val_sums = [a + b for a, b in zip(self.val_sums, self.sums(outputs), strict=True)]

    @override
    def on_validation_epoch_end(self) -> None:
        means = self.means(self.val_sums)
        self.val_sums = [0.0] * len(self.val_sums)
        if self.trainer.is_global_zero:  # logged during the sanity check too: the figures before training
            figures = {f"dpo/val_{k}": v for k, v in means.items()}
            for logger in self.trainer.loggers:
                logger.log_metrics(figures, step=self.trainer.global_step)

    def _pair_loss(self, mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb.loss_mask
        policy = (token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], 1.0) * mask).sum(-1)
        ref = (mb.ref_logprobs * mask).sum(-1)
        tokens = mask.sum(-1).clamp(min=1.0)
        lp = PairLogprobs(policy[0::2], policy[1::2], ref[0::2], ref[1::2], tokens[0::2], tokens[1::2])
        loss, chosen, rejected = self.loss(lp)
        margin = (chosen - rejected).detach()
        figures = {
            "loss": loss.detach().sum(), "reward_margin": margin.sum(),
            "accuracy": ((margin > 0).float() + 0.5 * (margin == 0).float()).sum(),
            "chosen_reward": chosen.detach().sum(), "rejected_reward": rejected.detach().sum(),
            "chosen_logprob": lp.chosen.detach().sum(), "rejected_logprob": lp.rejected.detach().sum(),
            "pairs": torch.tensor(float(len(loss))),
        }  # fmt: skip
        return loss.sum(), torch.tensor(len(loss), dtype=torch.int), figures
