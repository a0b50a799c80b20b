"""On-policy distillation as a reward: a teacher scores the student's own samples token by token.

:class:`TeacherKL` gives each completion token the reward ``-coef * (log p_student(y_t) - log p_teacher(y_t))``:
the student's log-probability is the engine's (the behaviour policy that sampled ``y_t``), the teacher's comes
from a forward pass of the teacher over the same prompt and completion ids. Summed over a completion it is
``-coef`` times a one-sample estimate of the reverse KL of the student to the teacher, so maximising it is
on-policy distillation (Agarwal et al., 2024; Thinking Machines' on-policy distillation, 2025). It reaches the
advantage through the per-token reward path (:class:`~yatt_lightning.rewards.base.TokenRewardFunction`):
REINFORCE++ with ``gamma: 0`` gives each token its own reward as its advantage (a return summed over the
completion would favour short completions, which hold fewer tokens' KL); the group estimators add it to
the sample's reward. Weigh it with a task reward or alone.

The teacher runs forward only with transformers on each rank's own device, where the rewards run (on the
training ranks under full colocation, on the judge's under partial colocation); on a GPU it moves to the
host between scorings (``offload``). It must share the student's vocabulary: the checks before start
(:mod:`yatt_lightning.run.preflight`) refuse a teacher whose vocabulary differs, naming both sizes. The
engine's logprobs are of the distribution it sampled from, so the KL is the reverse KL at the sampling
temperature against the teacher at temperature 1: keep ``model.sampling.temperature`` at 1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from yatt_lightning.checkpoint.model_source import resolve_model_path
from yatt_lightning.rewards.base import RewardError, RewardOutput, TokenRewardFunction


class TeacherKL(TokenRewardFunction):
    """Args:
    teacher: The teacher: a Hugging Face folder of a causal LM (possibly larger than the student) or a built-in
        name (``builtin:tiny-qwen2-sft``).
    coef: Multiplies the per-token reverse-KL estimate (the reward is its negative).
    batch_size: Samples per teacher forward pass.
    offload: On a GPU, keep the teacher on the host between scorings.
    weight: Multiplies the rewards in the sum of rewards.
    name: Name in logs (``reward/<name>/kl/mean``: the samples' mean per-token KL).
    timeout_s: Deadline of scoring one batch, in seconds; ``None``: ``model.reward_timeout_s``.
    """

    def __init__(
        self,
        teacher: str,
        coef: float = 1.0,
        batch_size: int = 32,
        offload: bool = True,
        weight: float = 1.0,
        name: str = "teacher_kl",
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(weight=weight, name=name, timeout_s=timeout_s)
        if coef <= 0:
            raise ValueError(f"TeacherKL: `coef` must be > 0, got {coef}.")
        if batch_size < 1:
            raise ValueError(f"TeacherKL: `batch_size` must be >= 1, got {batch_size}.")
        self.path = resolve_model_path(teacher, key="model.rewards.teacher")
        self.coef, self.batch_size, self.offload = coef, batch_size, offload
        self._model = None

    def check_student(self, student: Path) -> None:
        """Refuse a teacher whose vocabulary differs from the student's (model folder ``student``)."""
        from transformers import AutoConfig, AutoTokenizer

        sizes = [AutoConfig.from_pretrained(p).vocab_size for p in (student, self.path)]
        vocabs = [AutoTokenizer.from_pretrained(p).get_vocab() for p in (student, self.path)]
        if sizes[0] != sizes[1] or vocabs[0] != vocabs[1]:
            what = f"{sizes[0]} and {sizes[1]} entries" if sizes[0] != sizes[1] else f"{sizes[0]} entries each, mapped differently"
            raise ValueError(
                f"`model.rewards` {self.name}: the teacher {self.path} and the student {student} have different "
                f"vocabularies ({what}); a per-token KL needs the same tokenizer: pick a teacher of the student's family."
            )

    def _device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _load(self) -> torch.nn.Module:
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        return self._model.to(self._device())

    @torch.no_grad()
    def teacher_logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """The teacher's log-probability of each completion token, per sample."""
        model = self._load()
        device, out = self._device(), []
        try:
            for start in range(0, len(prompt_ids), self.batch_size):
                seqs = [p + c for p, c in zip(prompt_ids[start : start + self.batch_size],
                                              completion_ids[start : start + self.batch_size], strict=True)]  # fmt: skip
                longest = max(len(s) for s in seqs)
                ids = torch.zeros((len(seqs), longest), dtype=torch.long)
                attention = torch.zeros_like(ids)
                for row, s in enumerate(seqs):
                    ids[row, : len(s)], attention[row, : len(s)] = torch.tensor(s), 1
                logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits.float()
                logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None].to(device))[..., 0]
                for row, k in enumerate(range(start, start + len(seqs))):
                    first = len(prompt_ids[k]) - 1
                    out.append(logprobs[row, first : first + len(completion_ids[k])].cpu())
        finally:
            if self.offload and device != "cpu":
                self._model.to("cpu")
        return out

    def metric_names(self) -> list[str]:
        return [*super().metric_names(), f"reward/{self.name}/kl/sum"]

    def rollout_scores(self, batch) -> RewardOutput:
        try:
            teacher = self.timed(self.teacher_logprobs, batch.prompt_ids, batch.completion_ids)
        except Exception as err:
            raise RewardError(self.failure_message(err, f" on a batch of {len(batch)} samples")) from err
        tokens, kl_sum = [], 0.0
        for k, (student, ref) in enumerate(zip(batch.rollout_logprobs, teacher, strict=True)):
            kl = student.float() - ref
            if batch.turns is not None:  # an agent's observations are not the student's tokens
                kl = kl * torch.tensor(batch.turns[k].mask, dtype=torch.float)
            kl_sum += float(kl.mean()) if len(kl) else 0.0
            tokens.append((-self.coef * kl).tolist())
        return RewardOutput([0.0] * len(batch), {f"reward/{self.name}/kl/sum": kl_sum}, tokens)
