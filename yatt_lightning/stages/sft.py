"""Supervised fine-tuning on the same Megatron policy, strategy, checkpoints and CLI as RL (issue 24, WIP).

``SFTModule`` trains the policy on (prompt, completion) rows: the prompt is rendered as the RL step renders
it (:mod:`yatt_lightning.chat`), the completion follows it (with the chat template's end of the assistant
turn, or the tokenizer's end-of-text token), and the loss is the completion tokens' negative log-likelihood,
averaged per token over the whole global batch (Megatron divides by the tokens summed over micro-batches
and data-parallel ranks), so it is the same under any layout. No rollout engine starts.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from typing_extensions import override

from yatt_lightning.chat import PromptFormat
from yatt_lightning.distributed.seeding import resolve_seed
from yatt_lightning.models.logprobs import token_logprobs
from yatt_lightning.models.spec import ModelSpec, policy_tokenizer
from yatt_lightning.training.batch import MicroBatch, TrainingBatch, TrainingSamples
from yatt_lightning.training.optim import OptimizerSettings
from yatt_lightning.training.optimizer_adapter import MegatronOptimizerAdapter


class SFTModule(pl.LightningModule):
    """Args:
    policy: The model to fine-tune (a Hugging Face folder).
    optimizer: Optimizer settings.
    target: The row's field holding the completion to learn.
    target_prefix: Put before the target's text (a space after a plain-text prompt, say).
    micro_batch_size: Sequences per forward/backward micro-batch.
    max_seq_tokens: Longest sequence (prompt and completion); a longer one's completion is cut to fit.
    apply_chat_template: Render prompts with the tokenizer's chat template when it has one.
    system_prompt: A system message in front of every prompt (needs a chat template).
    seed: Seed (``None`` follows ``seed_everything``).
    """

    needs_engine = False  # the strategy starts no rollout engine for this stage

    def __init__(
        self,
        policy: ModelSpec = ModelSpec(),
        optimizer: OptimizerSettings = OptimizerSettings(),
        target: str = "completion",
        target_prefix: str = "",
        micro_batch_size: int = 32,
        max_seq_tokens: int = 256,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        for key, value in (("micro_batch_size", micro_batch_size), ("max_seq_tokens", max_seq_tokens)):
            if value < 1:
                raise ValueError(f"`model.{key}` must be >= 1, got {value}.")
        self.automatic_optimization = False
        self.policy_spec, self.optimizer_settings = policy, optimizer
        self.target, self.target_prefix = target, target_prefix
        self.micro_batch_size, self.max_seq_tokens = micro_batch_size, max_seq_tokens
        self.apply_chat_template, self.system_prompt = apply_chat_template, system_prompt
        self.seed = resolve_seed(seed)
        self.policy = None
        self.tokenizer = None
        self.prompt_format: PromptFormat | None = None
        self.cut = 0  # completions cut to fit max_seq_tokens, over the run

    @override
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from yatt_lightning.agents.turn_tokens import TurnTokens
        from yatt_lightning.models.policy import MegatronPolicy

        path = self.policy_spec.resolve()
        self.model_path = path
        self.tokenizer = policy_tokenizer(path)
        self.prompt_format = PromptFormat.of(
            path, self.tokenizer, apply_chat_template=self.apply_chat_template, system_prompt=self.system_prompt
        )
        turns = TurnTokens(self.tokenizer, chat=self.prompt_format.chat_template is not None)
        self.end_ids = turns.close_ids if turns.chat else [self.tokenizer.eos_token_id]
        self.policy = MegatronPolicy(path, params_dtype=self.policy_spec.torch_dtype(), optimizer=self.optimizer_settings,
                                     seed=self.seed)  # fmt: skip

    @override
    def configure_optimizers(self) -> MegatronOptimizerAdapter:
        return MegatronOptimizerAdapter(self.policy, step_index=lambda: self.trainer.global_step)

    def sample(self, row: dict) -> tuple[list[int], list[int]]:
        """The row's prompt ids and completion ids (cut to fit ``max_seq_tokens``)."""
        prompt = self.prompt_format.ids(row)
        if self.target not in row:
            raise ValueError(f"{row.get('_source', 'a row')}: no {self.target!r} field to learn (`model.target`).")
        completion = self.tokenizer(self.target_prefix + str(row[self.target]), add_special_tokens=False)["input_ids"]
        completion = list(completion) + list(self.end_ids)
        room = self.max_seq_tokens - len(prompt)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt)} tokens ({row.get('_source', 'a row')}) leaves no room within "
                f"`model.max_seq_tokens`={self.max_seq_tokens}."
            )
        if len(completion) > room:
            completion, self.cut = completion[:room], self.cut + 1
        return prompt, completion

    @override
    def training_step(self, batch: list[dict], batch_idx: int) -> None:
        pairs = [self.sample(row) for row in batch]
        samples = TrainingSamples(
            [p for p, _ in pairs], [c for _, c in pairs], [torch.zeros(len(c)) for _, c in pairs], [None] * len(pairs)
        )
        mbs = TrainingBatch(samples).microbatches(list(range(len(pairs))), self.micro_batch_size,
                                                  self.tokenizer.pad_token_id)  # fmt: skip
        optimizer = self.optimizers()
        optimizer.zero_grad()
        outputs = self.policy.forward_backward(mbs, _nll, forward_only=False)
        optimizer.step()
        nll = sum(float(o["nll"]) for o in outputs)
        tokens = sum(float(o["tokens"]) for o in outputs)
        totals = torch.tensor([nll, tokens], dtype=torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        loss = float(totals[0] / max(totals[1], 1.0))
        self.log_dict({"sft/loss": loss, "sft/tokens": float(totals[1]), "sft/grad_norm": optimizer.last_grad_norm,
                       "sft/cut": float(self.cut)}, prog_bar=False, rank_zero_only=True)  # fmt: skip
        return None


def _nll(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The completion tokens' negative log-likelihood, summed; Megatron divides by the tokens."""
    logprobs = token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], 1.0)
    mask = mb.loss_mask
    loss = -(logprobs * mask).sum()
    tokens = mask.sum()
    return loss, tokens.to(torch.int), {"nll": loss.detach(), "tokens": tokens.detach()}
