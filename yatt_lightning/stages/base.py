"""What every stage other than RL shares: the policy on the same Megatron strategy, its tokenizer and prompt
format, rows turned into token ids with the loss mask, and micro-batches for Megatron's schedule.

A row becomes ``(prompt_ids, completion_ids, mask)``:

- a prompt and a completion field (``prompt``/``messages`` and, say, ``answer``): the prompt rendered as the RL
  step renders it (:mod:`yatt_lightning.chat`), then the completion and the end of the assistant turn (the
  chat template's, or the tokenizer's end-of-text token); the loss is on every completion token;
- a chat row without the completion field (``messages`` holding assistant turns): the whole conversation under
  the tokenizer's chat template, the loss on the assistant turns' tokens only (their text and the template's
  end of turn), the other turns masked out.

A sequence longer than ``max_seq_tokens`` is cut (its completion shortened and counted in ``<stage>/cut``) or
refused, by ``on_overlong``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import lightning.pytorch as pl
import torch
from typing_extensions import override

from yatt_lightning.chat import PromptFormat, render
from yatt_lightning.checkpoint.model_source import ModelSpec, policy_tokenizer
from yatt_lightning.distributed.seeding import resolve_seed
from yatt_lightning.models.lora import LoRASettings
from yatt_lightning.models.optim import OptimizerSettings
from yatt_lightning.training.batch import MicroBatch, TrainingBatch, TrainingSamples
from yatt_lightning.training.optimizer_adapter import MegatronOptimizerAdapter


@dataclass(frozen=True)
class Sequence:
    """One row as token ids: the prompt (a vision-language policy's image tokens expanded), the completion
    after it, per completion token 1 where the loss counts (``None``: every completion token), and the row's
    image references (``None`` for a text row)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[float] | None = None
    images: list | None = None


class PolicyStage(pl.LightningModule):
    """Base of the stages: the policy, its optimizer and how rows become token ids. Subclasses set ``name``
    (the prefix of their figures) and implement ``training_step``.

    Args:
        policy: The model to train (a Hugging Face folder, an exported checkpoint of any stage).
        optimizer: Optimizer settings.
        max_seq_tokens: Longest sequence (prompt and completion).
        on_overlong: A longer sequence: ``cut`` (its completion shortened to fit, counted in ``<stage>/cut``)
            or ``refuse`` (stop, naming the row).
        apply_chat_template: Render prompts with the tokenizer's chat template when it has one.
        system_prompt: A system message in front of every prompt (needs a chat template).
        seed: Seed (``None`` follows ``seed_everything``).
        lora: Train LoRA adapters on the frozen policy (:class:`~yatt_lightning.models.lora.LoRASettings`).
    """

    name = "stage"
    needs_engine = False  # the strategy starts no rollout engine for these stages

    def __init__(
        self,
        policy: ModelSpec,
        optimizer: OptimizerSettings,
        max_seq_tokens: int,
        on_overlong: Literal["cut", "refuse"],
        apply_chat_template: bool,
        system_prompt: str | None,
        seed: int | None,
        lora: LoRASettings | None = None,
    ) -> None:
        super().__init__()
        if max_seq_tokens < 2:
            raise ValueError(f"`model.max_seq_tokens` must be >= 2, got {max_seq_tokens}.")
        if on_overlong not in ("cut", "refuse"):
            raise ValueError(f"`model.on_overlong` must be 'cut' or 'refuse', got {on_overlong!r}.")
        self.automatic_optimization = False
        self.policy_spec, self.optimizer_settings = policy, optimizer
        self.max_seq_tokens, self.on_overlong = max_seq_tokens, on_overlong
        self.apply_chat_template, self.system_prompt = apply_chat_template, system_prompt
        self.seed = resolve_seed(seed)
        self.lora = lora
        self.policy = None
        self.tokenizer = None
        self.prompt_format: PromptFormat | None = None
        self.images = None  # a vision-language policy's image tokens and pixels
        self.cut = 0  # sequences cut to fit max_seq_tokens, over the run

    @override
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from yatt_lightning.models.policy import MegatronPolicy

        path = self.policy_spec.resolve()
        self.configure_tokens(path)
        dtype = self.policy_spec.torch_dtype()
        self.policy = MegatronPolicy(path, params_dtype=dtype, optimizer=self.optimizer_settings, seed=self.seed,
                                     lora=self.lora)  # fmt: skip
        self.build_frozen_models(path, dtype)

    def configure_tokens(self, path) -> None:
        """The tokenizer and prompt format of the model folder ``path``, and what ends an assistant turn."""
        from yatt_lightning.agents.turn_tokens import TurnTokens

        self.model_path = path
        self.tokenizer = policy_tokenizer(path)
        self.prompt_format = PromptFormat.of(
            path, self.tokenizer, apply_chat_template=self.apply_chat_template, system_prompt=self.system_prompt
        )
        turns = TurnTokens(self.tokenizer, chat=self.prompt_format.chat_template is not None)
        self.end_ids = turns.close_ids if turns.chat else [self.tokenizer.eos_token_id]
        if self.prompt_format.image_token_id is not None:  # a vision-language policy
            from yatt_lightning.multimodal.image_inputs import ImageInputs

            self.images = ImageInputs(path)

    def build_frozen_models(self, path, dtype) -> None:
        """Models the stage runs forward only (DPO's reference); none by default."""

    @override
    def configure_optimizers(self) -> MegatronOptimizerAdapter:
        return MegatronOptimizerAdapter(self.policy, step_index=lambda: self.trainer.global_step)

    # ------------------------------------------------------------------ rows to ids
    def sequences(self, rows: list[dict]) -> list[Sequence]:
        """The token sequences the stage trains on for ``rows`` (the checks before start run it on every row)."""
        raise NotImplementedError

    def check_rows(self, path, rows: list[dict]) -> None:
        """Every row of the data turned into ids, as training will (a bad row is refused, naming it)."""
        self.configure_tokens(path)
        try:
            self.sequences(rows)
        finally:
            self.cut = 0

    def sequence(self, row: dict, field: str | None, prefix: str = "") -> Sequence:
        """``row`` as token ids: its prompt followed by ``prefix`` + ``row[field]`` and the end of the turn, or,
        ``field`` being ``None`` or absent from a row of ``messages``, the chat row's assistant turns."""
        where = row.get("_source", "a row")
        if field is not None and field in row:
            prompt = self.prompt_format.ids(row)
            completion = self.tokenizer(prefix + str(row[field]), add_special_tokens=False)["input_ids"]
            seq = Sequence(prompt, list(completion) + list(self.end_ids))
        elif "messages" in row:
            seq = self.chat_sequence(row, where)
        else:
            wanted = f"the field {field!r} nor " if field is not None else ""
            raise ValueError(f"{where}: it has neither {wanted}chat `messages` with an assistant turn to learn from.")
        if self.images is not None:  # one image token per image, as many as the vision tower gives
            refs = row.get("images")
            seq = Sequence(self.images.expand(seq.prompt_ids, refs), seq.completion_ids, seq.mask, refs)
        return self.fit(seq, where)

    def chat_sequence(self, row: dict, where: str) -> Sequence:
        """A chat row's conversation under the template; the loss on its assistant turns."""
        if self.prompt_format.chat_template is None:
            raise ValueError(
                f"{where}: a chat row without a completion field needs a chat template to find its assistant turns; "
                f"{self.model_path} has none (or `model.apply_chat_template` is false)."
            )
        messages = self.prompt_format.messages(row)
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns or turns[0] == 0:
            raise ValueError(
                f"{where}: the chat row has no assistant turn after a prompt to learn from; add one, or give the "
                "completion in its own field (`model.target`)."
            )
        template, tok = self.prompt_format.chat_template, self.tokenizer
        full = render(tok, messages, template, finished=True)
        mask = [0.0] * len(full)
        starts = []
        for k in turns:
            before, through = render(tok, messages[:k], template), render(tok, messages[: k + 1], template, finished=True)
            if full[: len(before)] != before or full[: len(through)] != through:
                raise ValueError(
                    f"{where}: the chat template of {self.prompt_format.source} renders the conversation's start "
                    f"differently once later turns follow (message {k}), so its assistant turns have no fixed "
                    "tokens; give the completion in its own field (`model.target`) instead."
                )
            mask[len(before) : len(through)] = [1.0] * (len(through) - len(before))
            starts.append(len(before))
        head = starts[0]
        return Sequence(full[:head], full[head:], mask[head:])

    def fit(self, seq: Sequence, where: str) -> Sequence:
        """``seq`` within ``max_seq_tokens``: cut, or refused by ``on_overlong``."""
        room = self.max_seq_tokens - len(seq.prompt_ids)
        if room < 1:
            raise ValueError(
                f"{where}: its prompt of {len(seq.prompt_ids)} tokens leaves no room for a completion within "
                f"`model.max_seq_tokens`={self.max_seq_tokens}; raise it, or shorten the prompt."
            )
        if len(seq.completion_ids) <= room:
            return seq
        if self.on_overlong == "refuse":
            raise ValueError(
                f"{where}: {len(seq.prompt_ids) + len(seq.completion_ids)} tokens, more than `model.max_seq_tokens`="
                f"{self.max_seq_tokens}; raise it, or set `model.on_overlong: cut` to shorten such completions."
            )
        self.cut += 1
        mask = seq.mask[:room] if seq.mask is not None else None
        return Sequence(seq.prompt_ids, seq.completion_ids[:room], mask, seq.images)

    # ------------------------------------------------------------------ micro-batches
    def samples(self, seqs: list[Sequence]) -> TrainingSamples:
        masks = None
        if any(s.mask is not None for s in seqs):
            masks = [torch.tensor(s.mask if s.mask is not None else [1.0] * len(s.completion_ids)) for s in seqs]
        return TrainingSamples(
            [s.prompt_ids for s in seqs], [s.completion_ids for s in seqs],
            [torch.zeros(len(s.completion_ids)) for s in seqs], [s.images for s in seqs], masks,
        )  # fmt: skip

    def microbatches(self, batch: TrainingBatch, size: int, plan: list[list[int]] | None = None) -> list[MicroBatch]:
        """The batch's micro-batches: ``size`` sequences each, in order, or following ``plan``."""
        pixels = self.images.pixels if self.images is not None else None
        return batch.microbatches(list(range(len(batch))), size, self.tokenizer.pad_token_id, plan=plan, pixels=pixels)

    def all_reduce_sums(self, values: list[float]) -> list[float]:
        """``values`` summed over every rank (the pipeline's other stages add zeros)."""
        totals = torch.tensor(values, dtype=torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        return totals.tolist()

