"""Does DPLoadBalancer shorten the training phase when response lengths are long-tailed?

Two data-parallel processes train the tiny model on synthetic rollouts whose lengths are long-tailed:
each prompt draws a scale from a lognormal (median 16 tokens, about 1 prompt in 100 ten times the
median), and its samples vary around it, so a rank that draws a long prompt holds many long sequences,
as with real reasoning prompts. Steps alternate between balancing and not, in pairs that train on
identical lengths, so both arms see the same data and the same machine state in one run. Both arms
cap micro-batches by tokens; only the partition across ranks differs.

    python bench/dp_balance.py [--trainer.max_steps 22]

Last line: ``imbalance_before=<x> imbalance_after=<y> train_phase_speedup=<z>``; targets: after <= 1.05
and speedup > 1 (mean training-phase time without balancing / with).
"""

from __future__ import annotations

import math
import statistics
import sys

import torch
from lightning.pytorch import Callback

from yatt_lightning.batch import RolloutBatch
from yatt_lightning.module import RLHFModule

WARMUP = 2


class LongTailRollouts(RLHFModule):
    """Completions with group-correlated lognormal lengths; a step pair (2k, 2k+1) repeats the same lengths."""

    def rollout(self, batch):
        n = self.sampling.n
        pair = self.trainer.global_step // 2
        prompt_ids = [self.tokenize_prompt(row) for row in batch]
        completions = []
        for row in batch:
            g = torch.Generator().manual_seed(pair * 100_003 + row["_id"])
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

    def score_samples(self, prompts, completions, rows):
        return torch.rand(len(completions), generator=torch.Generator().manual_seed(self.trainer.global_step))


class Alternate(Callback):
    """Balance on odd steps only, and record each step's training-phase time and imbalance."""

    def __init__(self) -> None:
        self.records: list[tuple[bool, float, float, float]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        module.balancer.enabled = batch_idx % 2 == 1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx >= WARMUP:
            b = module.balancer
            self.records.append((b.enabled, module.phase_times["train"], b.last["balance/imbalance_before"],
                                 b.last["balance/imbalance_after"]))  # fmt: skip


def main() -> None:
    from _common import build_cli

    cli = build_cli(
        ["--model.class_path", "__main__.LongTailRollouts", "--trainer.devices", "2", "--trainer.max_steps", "22",
         "--data.batch_size", "8", "--model.sampling.max_new_tokens", "200", "--model.max_prompt_tokens", "16",
         "--trainer.callbacks+=yatt_lightning.callbacks.DPLoadBalancer",
         "--trainer.callbacks.max_tokens_per_micro_batch", "2048", *sys.argv[1:]]
    )  # fmt: skip
    alt = Alternate()
    cli.trainer.callbacks.append(alt)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if not cli.trainer.is_global_zero:
        return
    off = [r for r in alt.records if not r[0]]
    on = [r for r in alt.records if r[0]]
    print(f"{'':<14}{'steps':>6}{'train phase s':>15}{'imbalance':>11}")
    print(
        f"{'unbalanced':<14}{len(off):>6}{statistics.mean(r[1] for r in off):>15.3f}{statistics.mean(r[2] for r in off):>11.3f}"
    )
    print(
        f"{'balanced':<14}{len(on):>6}{statistics.mean(r[1] for r in on):>15.3f}{statistics.mean(r[3] for r in on):>11.3f}"
    )
    before = statistics.mean(r[2] for r in alt.records)
    after = statistics.mean(r[3] for r in on)
    speedup = statistics.mean(r[1] for r in off) / statistics.mean(r[1] for r in on)
    print(f"imbalance_before={before:.3f} imbalance_after={after:.3f} train_phase_speedup={speedup:.3f}", flush=True)


if __name__ == "__main__":
    main()
