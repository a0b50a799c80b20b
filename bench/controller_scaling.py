"""What crosses the wire at rank 0, and how much memory does it hold, as data-parallel ranks grow?

Runs a few GRPO steps of the tiny config with 1, 2 and 4 data-parallel processes (4 on 2 cores is fine:
this measures bytes and memory, not speed) under both controllers, on the same workload: every prompt
row carries a 1 MB payload of its own (standing in for an image), as multimodal RL data does.

- ParallelController: every rank loads its own rows and keeps them; nothing but scalars crosses ranks.
- SingleController as a driver design runs it (``driver_loads_rows``): rank 0 loads every rank's rows,
  payload included, generates and scores everything; the others get their prompts, completions (token
  ids, logprobs) and rewards from it, and send it their prompts' token ids.

Bytes are counted where they cross the wire, by :mod:`yatt_lightning.distributed.wire` around ``torch.distributed``
(its docstring has the byte model): both directions, per category (rollout data, gradients, control),
per step after one warm-up step, at rank 0.

    python bench/controller_scaling.py [--smoke] [--steps 3] [--sizes 1,2,4] [--payload-mb 1]

Last line: ``rank0_data_bytes_ratio=<r> rank0_total_bytes_ratio=<t>``: parallel / single bytes per step at
rank 0 at the largest DP size, for the data path (rollout category) and in total; target r <= 0.3.
``--smoke`` runs DP=2 only, one measured step, 1 KiB payloads (DP=1 crosses no wire).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from yatt_lightning.datamodules.tasks import AlphabetTask

WARMUP = 1
BATCH = 4  # prompts per DP rank per step
MODES = {
    "parallel": ["--trainer.strategy.controller", "yatt_lightning.rollout.controller.ParallelController"],
    "single": ["--trainer.strategy.controller", "yatt_lightning.rollout.controller.SingleController",
               "--trainer.strategy.controller.driver_loads_rows", "true"],
}  # fmt: skip
CATEGORIES = ("rollout", "gradients", "control")


class PayloadTask(AlphabetTask):
    """AlphabetTask rows with an ``image`` field of ``payload_mb`` MB, distinct bytes per row."""

    def __init__(self, num_rows: int = 64, payload_mb: float = 1.0, seed: int = 0) -> None:
        super().__init__(num_rows=num_rows, seed=seed)
        self.payload_bytes = int(payload_mb * 2**20)

    def rows(self) -> list[dict]:
        rng = random.Random(0)
        return [dict(r, image=rng.randbytes(self.payload_bytes)) for r in super().rows()]


def _child(out: Path, overrides: list[str], config: str | None = None) -> None:
    """One training run of ``config`` (the tiny one by default; this process is rank 0, Lightning launches
    the others with the same arguments)."""
    from yatt_lightning.distributed import wire

    wire.install()  # on every rank, before Megatron and vLLM are imported
    import torch
    from _common import build_cli
    from lightning.pytorch import Callback

    class Meter(Callback):
        def __init__(self) -> None:
            self.start, self.end, self.steps = None, None, 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.end = wire.snapshot()
            if batch_idx == WARMUP - 1:
                self.start = self.end
            elif batch_idx >= WARMUP:
                self.steps += 1

        def on_train_end(self, trainer, module) -> None:
            if not trainer.is_global_zero:
                return
            d = self.end - self.start
            per_step = {c: {"sent": d.sent[c] / self.steps, "received": d.received[c] / self.steps} for c in CATEGORIES}
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # MiB
            out.write_text(json.dumps({"per_step": per_step, "steps": self.steps, "peak_rss_mib": rss}))

    torch.set_num_threads(1)
    cli = build_cli(overrides, **({"config": config} if config else {}))
    cli.trainer.callbacks.append(Meter())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def measure(script: Path, tmp: Path, mode: str, dp: int, overrides: list[str]) -> dict:
    """Run ``script --child`` (one training run on ``dp`` ranks) and print its row of the table; returns what
    its rank 0 measured."""
    out = tmp / f"{mode}-{dp}.json"
    cmd = [sys.executable, str(script.resolve()), "--child", str(out), *overrides]
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        sys.exit(f"{mode} with {dp} ranks failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    r = json.loads(out.read_text())
    cells = " ".join(f"{_total(r, c):>12,.0f}" for c in CATEGORIES[:2])
    print(f"{mode:<9} {dp:>2} {_total(r):>12,.0f} {cells} {_total(r, 'control'):>10,.0f}  "
          f"{r['peak_rss_mib']:6.0f} MiB", flush=True)  # fmt: skip
    return r


def _total(r: dict, category: str | None = None) -> float:
    cats = CATEGORIES if category is None else (category,)
    return sum(r["per_step"][c]["sent"] + r["per_step"][c]["received"] for c in cats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="DP=2 only, 1 measured step, 1 KiB payloads")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--payload-mb", type=float, default=1.0)
    p.add_argument("--child", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if args.child:
        _child(Path(args.child[0]), args.child[1:])
        return
    if args.smoke:
        args.steps, args.sizes, args.payload_mb = 1, "2", 2**-10
    sizes = [int(s) for s in args.sizes.split(",")]
    num_rows = BATCH * max(sizes) * (args.steps + WARMUP)  # the same rows at every size
    results = {}
    print(f"rank 0, per step ({args.steps} measured after {WARMUP} warm-up; {BATCH} prompts per rank, "
          f"{args.payload_mb:g} MB payload per row); bytes sent + received", flush=True)  # fmt: skip
    print(f"{'controller':<9} {'dp':>2} {'total':>12} {'rollout':>12} {'gradients':>12} {'control':>10}  peak RSS")
    with tempfile.TemporaryDirectory() as tmp:
        for mode, flags in MODES.items():
            for dp in sizes:
                overrides = [
                    "--trainer.max_steps", str(args.steps + WARMUP), "--trainer.devices", str(dp), *flags,
                    "--data.task", "__main__.PayloadTask", "--data.task.num_rows", str(num_rows),
                    "--data.task.payload_mb", str(args.payload_mb), "--data.batch_size", str(BATCH),
                ]  # fmt: skip
                results[(mode, dp)] = measure(Path(__file__), Path(tmp), mode, dp, overrides)
    top = max(sizes)
    par, single = results[("parallel", top)], results[("single", top)]
    for mode in MODES:
        rss = [results[(mode, dp)]["peak_rss_mib"] for dp in sizes]
        print(f"{mode}: rank 0 peak RSS from {sizes[0]} to {top} ranks changes by {max(rss) / min(rss) - 1:+.1%}")
    s = single["per_step"]["rollout"]
    print(
        f"single at dp={top}: rank 0 sends {s['sent']:,.0f} B and receives {s['received']:,.0f} B of rollout data per step"
    )
    data = _total(par, "rollout") / max(_total(single, "rollout"), 1)
    total = _total(par) / max(_total(single), 1)
    print(f"rank0_data_bytes_ratio={data:.3g} rank0_total_bytes_ratio={total:.3g}", flush=True)


if __name__ == "__main__":
    main()
