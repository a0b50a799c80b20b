"""Validation during RL: held-out prompts sampled with their own settings and scored by the run's rewards.

Lightning's validation loop drives it (``trainer.val_check_interval``; before training, the sanity check,
which yatt's CLI runs over the whole held-out set): each data-parallel rank samples its share of
``data.val_path`` / ``data.val_task`` on its engine with the weights it trains, the module's ``reward`` hook
scores them, and the figures are summed over the ranks:

* ``val/reward/mean`` (and ``val/reward/mean/<data_source>`` when rows name their ``data_source``);
* ``val/pass@k`` for k = 1, 2, 4, ... up to ``n``: the unbiased estimator of Chen et al. (2021),
  ``1 - C(n - c, k) / C(n, k)`` per prompt with ``c`` of its ``n`` samples correct (reward >= ``correct_at``);
* ``val/mean@n``: the mean reward of a prompt's ``n`` samples (the expected mean of any ``k`` of them);
* ``val/response_length/mean``, ``val/prompts``; a table of samples (TensorBoard text ``val/samples``).

A run with validation is the same run without it: sampling seeds are the validation's own, every random
generator of the process is restored afterwards, and the engine takes the policy's weights again before the
next training step (a push resets its prefix cache, as the step without validation would have).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from yatt_lightning.distributed.seeding import rng_states, sampling_seed, set_rng_states
from yatt_lightning.engines.base import SamplingConfig
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.rollout.types import RolloutRequest, Scores
from yatt_lightning.trackers import log_figures, log_samples

log = logging.getLogger(__name__)


class Validation:
    """How held-out prompts are sampled and judged (``model.validation``).

    Args:
        n: Samples per prompt (pass@k is reported for k = 1, 2, 4, ... up to ``n``, and ``n``).
        temperature: Sampling temperature; ``0``: greedy decoding (then ``n`` must be 1).
        top_p: Nucleus sampling mass.
        max_new_tokens: Longest completion; ``None``: the training's ``model.sampling.max_new_tokens``.
        correct_at: A sample is correct (for pass@k) when its reward is at least this.
        log_samples: Samples of rank 0 written to the ``val/samples`` table each validation.
        seed: Seed of the validation's sampling (the same prompts get the same seeds at every validation).
    """

    def __init__(
        self,
        n: int = 4,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int | None = None,
        correct_at: float = 1.0,
        log_samples: int = 8,
        seed: int = 0,
    ) -> None:
        if n < 1:
            raise ValueError(f"`model.validation.n` must be >= 1, got {n}.")
        if temperature < 0:
            raise ValueError(f"`model.validation.temperature` must be >= 0 (0: greedy), got {temperature}.")
        if temperature == 0 and n != 1:
            raise ValueError(f"`model.validation.n`={n} with `temperature: 0`: greedy samples are all alike; set n: 1.")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"`model.validation.max_new_tokens` must be >= 1, got {max_new_tokens}.")
        if log_samples < 0:
            raise ValueError(f"`model.validation.log_samples` must be >= 0, got {log_samples}.")
        self.n, self.temperature, self.top_p, self.max_new_tokens = n, temperature, top_p, max_new_tokens
        self.correct_at, self.log_samples, self.seed = correct_at, log_samples, seed

    def sampling(self, training: SamplingConfig) -> SamplingConfig:
        """The validation's sampling, from the training's (greedy: the most likely token, ``top_k: 1``)."""
        greedy = self.temperature == 0
        return replace(training, n=self.n, temperature=1.0 if greedy else self.temperature, top_p=self.top_p,
                       top_k=1 if greedy else -1, max_new_tokens=self.max_new_tokens or training.max_new_tokens)  # fmt: skip

    def seeds(self, rows: list[dict]) -> list[int]:
        return [sampling_seed(self.seed, -1, row, i) for i, row in enumerate(rows)]

    def ks(self) -> list[int]:
        return sorted({2**i for i in range(int(math.log2(self.n)) + 1)} | {self.n})


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with ``c`` of ``n`` samples correct (k <= n)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class Tally:
    """One validation's sums on this rank, by data source: prompts, samples, rewards, lengths, pass@k."""

    ks: list[int]
    sums: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: list[tuple[str, str, float]] = field(default_factory=list)

    def add_batch(self, rollouts: RolloutBatch, rewards, validation: Validation) -> None:
        """A validation batch's scored samples, group by group (a prompt's samples are one group)."""
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(rollouts.group_ids.tolist()):
            groups.setdefault(g, []).append(i)
        values, lengths = [float(r) for r in rewards], rollouts.response_lengths().tolist()
        for members in groups.values():
            row = rollouts.rows[members[0]]
            self.add(str(row.get("data_source", "all")), [values[i] for i in members],
                     [int(lengths[i]) for i in members], validation.correct_at)  # fmt: skip
        room = validation.log_samples - len(self.samples)
        self.samples += [(rollouts.prompts[i], rollouts.completions[i], values[i]) for i in range(min(room, len(values)))]

    def add(self, source: str, rewards: list[float], lengths: list[int], correct_at: float) -> None:
        n, c = len(rewards), sum(r >= correct_at for r in rewards)
        _add(self.sums.setdefault(source, {}), {"prompts": 1.0, "samples": n, "reward": sum(rewards),
                                                "mean@n": sum(rewards) / n, "length": sum(lengths),
                                                **{f"pass@{k}": pass_at_k(n, c, k) for k in self.ks}})  # fmt: skip

    def figures(self, parts: list[dict[str, dict[str, float]]], n: int) -> dict[str, float]:
        """The figures of every rank's sums (``parts``, gathered)."""
        merged: dict[str, dict[str, float]] = {}
        total: dict[str, float] = {}
        for part in parts:
            for source, sums in part.items():
                _add(merged.setdefault(source, {}), sums)
                _add(total, sums)
        if not total:
            return {}
        out = _figures(total, self.ks, n)
        if len(merged) > 1:
            for source, sums in sorted(merged.items()):
                out[f"val/reward/mean/{source}"] = sums["reward"] / sums["samples"]
                out.update({f"{k}/{source}": v for k, v in _figures(sums, self.ks, n).items() if "pass@" in k})
        return out


def _add(into: dict[str, float], sums: dict[str, float]) -> None:
    for key, value in sums.items():
        into[key] = into.get(key, 0.0) + value


def _figures(sums: dict[str, float], ks: list[int], n: int) -> dict[str, float]:
    prompts = sums["prompts"]
    return {
        "val/reward/mean": sums["reward"] / sums["samples"],
        f"val/mean@{n}": sums["mean@n"] / prompts,
        **{f"val/pass@{k}": sums[f"pass@{k}"] / prompts for k in ks},
        "val/response_length/mean": sums["length"] / sums["samples"],
        "val/prompts": prompts,
    }


@contextlib.contextmanager
def same_random_state() -> Iterator[None]:
    """Every random generator of this process as it was before: what runs inside changes nothing the
    training draws afterwards."""
    states = rng_states()
    try:
        yield
    finally:
        set_rng_states(states)


def publish(trainer, tally: Tally, validation: Validation, group, counts: bool, step: int) -> dict[str, float]:
    """Sum every rank's tally (over ``group``; a rank that ``counts`` not, the non-head ranks of a
    model-parallel group, adds nothing) and, on global rank 0, write the figures and the samples table to every
    logger at ``step`` and one line to the terminal. Returns the figures."""
    mine = tally.sums if counts else {}
    parts: list = [None] * (torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1)
    if len(parts) > 1:
        torch.distributed.all_gather_object(parts, mine, group=group)
    else:
        parts = [mine]
    figures = tally.figures(parts, validation.n)
    if trainer.is_global_zero and figures:
        log_figures(trainer.loggers, figures, step)
        log_samples(trainer.loggers, "val/samples", tally.samples, step)
        k = validation.ks()[-1]
        log.info("validation at step %d: reward %.3f, pass@%d %.3f, mean@%d %.3f over %d held-out prompts",
                 step, figures["val/reward/mean"], k, figures[f"val/pass@{k}"], validation.n,
                 figures[f"val/mean@{validation.n}"], int(figures["val/prompts"]))  # fmt: skip
    return figures


class Validating:
    """:class:`~yatt_lightning.module.RLHFModule`'s validation hooks, which Lightning's validation loop calls
    (the module holds ``validation``, ``val_tally``, ``sampling``, ``agent`` and the ``reward`` hook)."""

    def on_validation_epoch_start(self) -> None:
        self.val_tally = Tally(self.validation.ks())

    def validation_step(self, batch: list[dict], batch_idx: int) -> None:
        """Sample this rank's held-out rows with ``validation``'s settings and score them with the ``reward`` hook."""
        v, strategy = self.validation, self.trainer.strategy
        with same_random_state(), torch.inference_mode(False):
            request = RolloutRequest(rows=batch, prompt_ids=self.tokenize_batch(batch), seeds=v.seeds(batch),
                                     sampling=v.sampling(self.sampling), step=self.trainer.global_step,
                                     weights_version=self.trainer.global_step, agent=self.agent)  # fmt: skip
            rollouts = strategy.rollout.evaluate(request)
            self.val_tally.add_batch(rollouts, Scores.of(self.reward(rollouts)).total, v)

    def on_validation_epoch_end(self) -> None:
        """The figures, at the trainer's step (``yatt validate``: the step of the checkpoint it loaded)."""
        trainer, strategy = self.trainer, self.trainer.strategy
        step = trainer.global_step if trainer.state.fn == "fit" else (self.checkpoint_step or 0)
        figures = publish(trainer, self.val_tally, self.validation, strategy.controller.group,
                          strategy.is_model_parallel_head, step)  # fmt: skip
        # Lightning's callback_metrics too (not its loggers: published above), where AsyncCheckpoint's keep_best
        # reads them; the same on every rank.
        self.log_dict(figures, logger=False, sync_dist=True)
