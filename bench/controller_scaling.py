"""What does rank 0 receive per step, and how much memory does it hold, as data-parallel ranks grow?

Runs a few GRPO steps of the tiny config with 1, 2 and 4 data-parallel processes (4 on 2 cores is fine:
this measures bytes and memory, not speed) under both controllers. Every prompt row carries a 1 MB
payload (standing in for an image), as multimodal RL data does. The parallel controller keeps rows
where they were loaded; the single controller gathers them (and the completions) on rank 0.

    python bench/controller_scaling.py [--steps 3] [--sizes 1,2,4] [--payload-mb 1]

Last line: ``rank0_bytes_ratio=<parallel / single at the largest DP size>`` (bytes received by rank 0
per step); target < 0.3, with rank 0's peak memory flat (within 10%) from 1 to 4 ranks in parallel mode.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from yatt_lightning.datamodules.tasks import AlphabetTask

HERE = Path(__file__).resolve().parent
WARMUP = 1


class PayloadTask(AlphabetTask):
    """AlphabetTask rows with an ``image`` field of ``payload_mb`` MB (one shared bytes object in memory,
    but serialised once per row whenever a row travels)."""

    def __init__(self, num_rows: int = 64, payload_mb: float = 1.0, seed: int = 0) -> None:
        super().__init__(num_rows=num_rows, seed=seed)
        self.payload = os.urandom(int(payload_mb * 2**20))

    def rows(self) -> list[dict]:
        return [dict(r, image=self.payload) for r in super().rows()]


def _child(out: Path, overrides: list[str]) -> None:
    """One training run (this process is rank 0; Lightning launches the others)."""
    import torch
    from _common import build_cli
    from lightning.pytorch import Callback

    class Meter(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if batch_idx == WARMUP - 1:
                self.start = trainer.strategy.controller.bytes_received

        def on_train_end(self, trainer, module) -> None:
            steps = trainer.global_step - WARMUP
            nbytes = (trainer.strategy.controller.bytes_received - self.start) / steps
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # MiB
            if trainer.is_global_zero:
                out.write_text(json.dumps({"bytes_per_step": nbytes, "peak_rss_mib": rss}))

    torch.set_num_threads(1)
    cli = build_cli(overrides)
    cli.trainer.callbacks.append(Meter())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--payload-mb", type=float, default=1.0)
    p.add_argument("--child", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if args.child:
        _child(Path(args.child[0]), args.child[1:])
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("ParallelController", "SingleController"):
            for dp in sizes:
                out = Path(tmp) / f"{mode}-{dp}.json"
                overrides = [
                    "--trainer.max_steps", str(args.steps + WARMUP), "--trainer.devices", str(dp),
                    "--trainer.strategy.controller", f"yatt_lightning.controller.{mode}",
                    "--data.task", "__main__.PayloadTask", "--data.task.num_rows", str(4 * 4 * (args.steps + WARMUP)),
                    "--data.task.payload_mb", str(args.payload_mb), "--data.batch_size", "4",
                ]  # fmt: skip
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), *overrides]
                proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0 or not out.exists():
                    sys.exit(f"{mode} with {dp} ranks failed:\n{proc.stderr[-4000:]}")
                results[(mode, dp)] = json.loads(out.read_text())
                r = results[(mode, dp)]
                print(f"{mode:<20} dp={dp}  rank0 received {r['bytes_per_step']:12.0f} B/step "
                      f"({r['bytes_per_step'] / 2**20:7.2f} MiB)  peak RSS {r['peak_rss_mib']:6.0f} MiB", flush=True)  # fmt: skip
    top = max(sizes)
    par, single = results[("ParallelController", top)], results[("SingleController", top)]
    flat = [results[("ParallelController", dp)]["peak_rss_mib"] for dp in sizes]
    print(
        f"parallel mode: rank 0 peak memory from {sizes[0]} to {top} ranks changes by {max(flat) / min(flat) - 1:+.1%}"
    )
    print(f"rank0_bytes_ratio={par['bytes_per_step'] / max(single['bytes_per_step'], 1):.2e}", flush=True)


if __name__ == "__main__":
    main()
