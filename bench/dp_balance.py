"""Does DPLoadBalancer even out what each data-parallel rank trains, and shorten the training phase?

Two data-parallel processes train the tiny model on synthetic rollouts whose lengths are long-tailed:
each prompt draws a scale from a lognormal (median 16 tokens, about 1 prompt in 100 ten times the
median), and its samples vary around it, so a rank that draws a long prompt holds many long sequences,
as with real reasoning prompts. Steps come in pairs that train on identical lengths, one step balanced
and one not; the order inside a pair alternates A B, B A, A B, ... (ABBA), so drifts of a shared machine
land on both arms. Both arms cap micro-batches by tokens and pack them the same way
(:mod:`yatt_lightning.training.packing`); only the partition across ranks differs. 40 measured pairs by default:
a single pair's ratio swings by +-30% on a shared 2-core machine.

What is measured is what each rank actually did: the padded tokens (samples x longest sequence of each
micro-batch) it forwarded and backwarded in the update, after the exchange, and its own training-phase
wall time. Imbalance = max over ranks / mean over ranks of those padded tokens. A step's training phase
lasts as long as its slowest rank's (the gradient all-reduce waits for it); the speedup of a pair is
unbalanced / balanced slowest-rank time, and the figure is the median over pairs.

    python bench/dp_balance.py [--smoke] [--trainer.max_steps 82]

Last line: ``imbalance_before=<x> imbalance_after=<y> train_phase_speedup=<z>``; targets: after <= 1.05
and speedup > 1.
"""

from __future__ import annotations

import math
import statistics
import sys

import torch
from lightning.pytorch import Callback

from yatt_lightning.module import RLHFModule
from yatt_lightning.rollout.batch import RolloutBatch

WARMUP = 2  # steps (one pair) not measured


class LongTailRollouts(RLHFModule):
    """Completions with group-correlated lognormal lengths; a step pair (2k, 2k+1) repeats the same lengths
    (drawn per rank and batch position, so both steps of a pair train the same lengths on the same ranks)."""

    padded_tokens = 0  # this step's training micro-batches, on this rank

    def rollout(self, batch):
        n = self.sampling.n
        pair = self.trainer.global_step // 2
        self.padded_tokens = 0
        prompt_ids = [self.tokenize_prompt(row) for row in batch]
        completions = []
        rank = self.trainer.global_rank
        for position, _row in enumerate(batch):  # by position, not row: both steps of a pair draw the same
            g = torch.Generator().manual_seed(pair * 100_003 + rank * 1_009 + position)
            scale = 16 * math.exp(torch.randn((), generator=g).item())  # lognormal, sigma 1
            for _ in range(n):
                length = int(min(200, max(2, scale * math.exp(0.3 * torch.randn((), generator=g).item()))))
                completions.append(torch.randint(260, 296, (length,), generator=g).tolist())
        return RolloutBatch(
            prompts=[row["prompt"] for row in batch for _ in range(n)],
            prompt_ids=[p for p in prompt_ids for _ in range(n)],
            completion_ids=completions,
            completions=[""] * len(completions),
            rows=[row for row in batch for _ in range(n)],
            group_ids=torch.arange(len(batch)).repeat_interleave(n),
            rollout_logprobs=[torch.zeros(len(c)) for c in completions],
            finish_reasons=["length"] * len(completions),
        )

    def reward(self, rollouts):
        return torch.rand(len(rollouts), generator=torch.Generator().manual_seed(self.trainer.global_step))

    def microbatches(self, batch, indices):
        mbs = super().microbatches(batch, indices)
        self.padded_tokens += sum(mb["input_ids"].numel() for mb in mbs)
        return mbs


def balanced_in_step(step: int) -> bool:
    """ABBA: pair k = steps (2k, 2k+1); even pairs run unbalanced first, odd pairs balanced first."""
    pair, second = divmod(step, 2)
    return bool(second) != bool(pair % 2)


class Alternate(Callback):
    """Balance by the ABBA schedule; record what every rank trained and how long its training phase took."""

    def __init__(self) -> None:
        self.records: list[dict] = []  # per measured step (rank 0 only)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        module.balancer.enabled = balanced_in_step(trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1  # the step that just ended
        mine = torch.tensor([float(module.padded_tokens), outputs["stats"].scalars["time/train"]], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(trainer.world_size)]
        torch.distributed.all_gather(every, mine)
        if step >= WARMUP and trainer.is_global_zero:
            tokens = [float(t[0]) for t in every]
            self.records.append({
                "step": step, "balanced": module.balancer.enabled, "tokens": tokens,
                "train_s": [float(t[1]) for t in every],
                "imbalance": max(tokens) / statistics.mean(tokens),
                "sequence_imbalance_before": outputs["stats"].scalars["balance/imbalance_before"],
            })  # fmt: skip


def pair_speedups(records: list[dict]) -> list[float]:
    """Unbalanced / balanced slowest-rank training time, per pair of steps on identical lengths."""
    by_pair: dict[int, dict[bool, float]] = {}
    for r in records:
        by_pair.setdefault(r["step"] // 2, {})[r["balanced"]] = max(r["train_s"])
    return [p[False] / p[True] for p in by_pair.values() if len(p) == 2]


def bootstrap_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """2.5% and 97.5% quantiles of the median over resamples of ``values`` (how far noise moves the figure)."""
    g = torch.Generator().manual_seed(0)
    medians = sorted(
        statistics.median(values[i] for i in torch.randint(len(values), (len(values),), generator=g).tolist())
        for _ in range(draws)
    )
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main() -> None:
    from _common import build_cli, pop_smoke

    argv = sys.argv[1:]
    smoke = pop_smoke(argv)
    size = ["--trainer.max_steps", "6", "--data.batch_size", "4"] if smoke else ["--trainer.max_steps", "82"]
    cli = build_cli(
        ["--model.class_path", "__main__.LongTailRollouts", "--trainer.devices", "2", "--data.batch_size", "8",
         "--model.sampling.max_new_tokens", "200", "--model.max_prompt_tokens", "16",
         "--trainer.callbacks+=yatt_lightning.callbacks.DPLoadBalancer",
         "--trainer.callbacks.max_tokens_per_micro_batch", "2048", *size, *argv]
    )  # fmt: skip
    alt = Alternate()
    cli.trainer.callbacks.append(alt)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if not cli.trainer.is_global_zero:
        return
    print(f"{'step':>5}{'arm':>12}{'padded tokens per rank':>26}{'imbalance':>11}{'train s per rank':>20}")
    for r in alt.records:
        arm = "balanced" if r["balanced"] else "unbalanced"
        tokens = " ".join(f"{t:>8.0f}" for t in r["tokens"])
        times = " ".join(f"{t:>6.3f}" for t in r["train_s"])
        print(f"{r['step']:>5}{arm:>12}{tokens:>26}{r['imbalance']:>11.3f}{times:>20}")
    off = [r for r in alt.records if not r["balanced"]]
    on = [r for r in alt.records if r["balanced"]]
    speedups = pair_speedups(alt.records)
    print(f"unbalanced: slowest rank's train phase {statistics.mean(max(r['train_s']) for r in off):.3f} s mean; "
          f"balanced: {statistics.mean(max(r['train_s']) for r in on):.3f} s; pair speedups "
          + " ".join(f"{x:.2f}" for x in speedups))  # fmt: skip
    lo, hi = bootstrap_interval(speedups)
    print(f"median pair speedup, 95% bootstrap interval over pairs: {lo:.3f} .. {hi:.3f} ({len(speedups)} pairs)")
    before = statistics.mean(r["imbalance"] for r in off)
    after = statistics.mean(r["imbalance"] for r in on)
    print(f"imbalance_before={before:.3f} imbalance_after={after:.3f} "
          f"train_phase_speedup={statistics.median(speedups):.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
