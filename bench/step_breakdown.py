"""Where does a step's time go, and how much memory does each rank hold?

Runs the tiny config for a few steps and prints each phase's share of the step (rollout, weight sync,
reward, train, and the rest of the loop as other; the first two steps are warm-up and not counted) and every rank's peak resident memory
(the vLLM engine lives in the same process, so this is the whole footprint).

    python bench/step_breakdown.py [--smoke] [--trainer.devices 2] [--trainer.max_steps 20]

``--smoke``: 4 steps (2 measured).

Last line: ``rollout=<share> sync=<share> reward=<share> train=<share> other=<share> peak_rss_gb_max=<GB>``.
"""

from __future__ import annotations

import resource
import sys
import time

import torch
from _common import build_cli, pop_smoke
from lightning.pytorch import Callback

PHASES = ("rollout", "sync", "reward", "train")
WARMUP = 2


class PhaseRecorder(Callback):
    def __init__(self) -> None:
        self.totals = dict.fromkeys((*PHASES, "step"), 0.0)
        self.steps = 0
        self.peak_rss_gb: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx < WARMUP:
            return
        for key in PHASES:
            self.totals[key] += outputs["stats"].scalars[f"time/{key}"]
        self.totals["step"] += time.perf_counter() - self.started  # Lightning's own work counts as "other"
        self.steps += 1

    def on_train_end(self, trainer, module) -> None:
        mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20])  # KiB -> GiB
        if torch.distributed.is_initialized():
            every = [torch.zeros(1) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(every, mine)
        else:
            every = [mine]
        self.peak_rss_gb = [float(t) for t in every]


def main() -> None:
    argv = sys.argv[1:]
    steps = str(WARMUP + 2) if pop_smoke(argv) else "20"
    cli = build_cli(["--trainer.max_steps", steps, *argv])
    rec = PhaseRecorder()
    cli.trainer.callbacks.append(rec)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if not cli.trainer.is_global_zero:
        return
    step = rec.totals["step"]
    shares = {k: rec.totals[k] / step for k in PHASES}
    shares["other"] = max(0.0, 1 - sum(shares.values()))
    print(f"steps measured: {rec.steps} (after {WARMUP} warm-up), mean step {step / rec.steps * 1000:.0f} ms")
    print(f"{'phase':<10}{'ms/step':>10}{'share':>8}")
    for k in PHASES:
        print(f"{k:<10}{rec.totals[k] / rec.steps * 1000:>10.1f}{shares[k]:>8.1%}")
    print(
        f"{'other':<10}{(step - sum(rec.totals[k] for k in PHASES)) / rec.steps * 1000:>10.1f}{shares['other']:>8.1%}"
    )
    for rank, gb in enumerate(rec.peak_rss_gb):
        print(f"rank {rank}: peak resident memory {gb:.2f} GiB")
    kv = getattr(cli.trainer.strategy.engine, "kv_cache_bytes", 0) or 0
    print(f"engine KV cache: {kv / 2**20:.0f} MiB (sized from the config)")
    parts = " ".join(f"{k}={v:.3f}" for k, v in shares.items())
    print(f"{parts} peak_rss_gb_max={max(rec.peak_rss_gb):.2f}", flush=True)


if __name__ == "__main__":
    main()
