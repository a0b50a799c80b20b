"""Full versus partial colocation for rollout + generative-reward work with long-tailed response lengths.

Two processes, the tiny policy and a judge (by default the ~18M-parameter built-in ``small-qwen2``, whose
scoring costs about as much as generating). Response lengths are long-tailed: each prompt's budget is
drawn from a lognormal (default median 16 tokens, sigma 1, capped at 160) and generation runs to that
budget, so a few groups take ~10x longer than the median. Both placements run the same steps (same data,
seeds and lengths), one after the other in this invocation:

* full colocation: each process generates its own prompts, then judges them;
* partial colocation: process 0 generates both processes' prompts while process 1 judges each group as
  soon as it finishes.

Reported per placement: the rollout + reward phase time per step (after a warm-up step), each process's
idle fraction of that phase (waiting for work or for the other process), and the split of each
process's phase into rollout / weight sync / reward.

    python bench/placement.py [--steps 6] [--judge-tokens 96] [--judge-model builtin:small-qwen2]
        [--prompts 8] [--median 16 --sigma 1 --cap 160] [--min-judge-batch N] [--repeats 3] [--smoke]

``--judge-tokens`` bounds the judge's prompt (question and the end of the answer), i.e. the cost of a
judgment relative to generating the answer. Partial colocation can only win by hiding judging behind the
tail of generation; on equal hardware it loses when judging everything on one process costs more than
the other process's generation, and when a decode step's cost grows with the batch (a CPU past ~16
sequences), since one process then generates twice the batch.

The placements run in ``--repeats`` interleaved pairs (full, partial, full, partial, ...), so a slow
spell of a shared machine lands on both; the table pools every pair's steps.

Last line: ``partial_over_full=<phase time under partial / under full>``, the median over the pairs;
target at most 0.85.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

from yatt_lightning.rollout.longtail import WaitForAll
from yatt_lightning.rollout.types import Plan

REPO = Path(__file__).resolve().parents[1]
WARMUP = 1


class LognormalLengths(WaitForAll):
    """Each prompt's samples run to a budget drawn from a lognormal fixed by the prompt's seed."""

    def __init__(self, median: float = 16, sigma: float = 1.0, cap: int = 160) -> None:
        self.median, self.sigma, self.cap = median, sigma, cap

    def plan(self, request, run_seed):
        budgets = []
        for seed in request.seeds:
            u1 = (zlib.crc32(f"a{seed}".encode()) % 10**6 + 0.5) / 10**6
            u2 = (zlib.crc32(f"b{seed}".encode()) % 10**6 + 0.5) / 10**6
            z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
            budgets.append(int(min(self.cap, max(2, self.median * math.exp(self.sigma * z)))))
        return Plan(dataclasses.replace(request, max_new_tokens=budgets), self.keep_count(len(request.prompt_ids)))


def _child(out: Path, config: str) -> None:
    import torch
    from _common import build_cli
    from lightning.pytorch import Callback

    class Phase(Callback):
        def __init__(self) -> None:
            self.rows = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            scalars = outputs["stats"].scalars
            t = {k: scalars[f"time/{k}"] for k in ("rollout", "sync", "reward")}
            phase = t["rollout"] + t["sync"] + t["reward"]
            idle = scalars[f"idle/rank{trainer.global_rank}"]
            mine = torch.tensor([phase, idle, t["rollout"], t["sync"], t["reward"]], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(trainer.world_size)]
            torch.distributed.all_gather(every, mine)
            if batch_idx >= WARMUP:
                self.rows.append([v.tolist() for v in every])

        def on_train_end(self, trainer, module) -> None:
            if trainer.is_global_zero:
                out.write_text(json.dumps(self.rows))

    cli = build_cli([], config=config)
    cli.trainer.callbacks.append(Phase())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def _config(tmp: Path, placement: str, args: argparse.Namespace) -> str:
    import yaml

    config = yaml.safe_load((REPO / "configs" / "grpo_genrm_full.yaml").read_text())
    trainer, model = config["trainer"], config["model"]["init_args"]
    trainer["max_steps"] = args.steps + WARMUP
    trainer["strategy"]["init_args"]["placement"] = {"class_path": f"yatt_lightning.placement.{placement}"}
    if placement == "PartialColocation" and args.min_judge_batch:
        trainer["strategy"]["init_args"]["placement"]["init_args"] = {"min_judge_batch": args.min_judge_batch}
    for reward in model["rewards"]:
        if reward["class_path"].endswith("GenerativeRewardModel"):
            reward["init_args"].update(model=args.judge_model, max_judge_tokens=args.judge_tokens)
    model.update(max_prompt_tokens=16, micro_batch_size=32)
    model["sampling"] = {"n": 4, "max_new_tokens": args.cap, "temperature": 1.0}
    model["long_tail"] = {
        "class_path": "__main__.LognormalLengths",
        "init_args": {"median": args.median, "sigma": args.sigma, "cap": args.cap},
    }
    config["data"]["init_args"]["batch_size"] = args.prompts
    path = tmp / f"{placement}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _phase(rows: list) -> float:
    """Mean rollout + reward phase per step; a step waits for the slower rank."""
    return statistics.mean(max(r[0] for r in step) for step in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--judge-tokens", type=int, default=96)
    p.add_argument("--judge-model", default="builtin:small-qwen2")
    p.add_argument("--prompts", type=int, default=8, help="prompts per process and step")
    p.add_argument("--median", type=float, default=16, help="median response budget, tokens")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the budgets")
    p.add_argument("--cap", type=int, default=160, help="longest response budget, tokens")
    p.add_argument("--min-judge-batch", type=int, default=None, help="PartialColocation's (default: its own)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved full/partial pairs")
    p.add_argument("--child", nargs=2)
    p.add_argument("--smoke", action="store_true", help="1 pair of 1 step, 2 prompts, the tiny judge")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.repeats, args.prompts, args.cap, args.judge_model = 1, 1, 2, 32, "builtin:tiny-qwen2"
    if args.child:
        _child(Path(args.child[0]), args.child[1])
        return
    results = {"FullColocation": [], "PartialColocation": []}
    ratios = []
    child = [sys.executable, str(Path(__file__).resolve()), "--child"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for _ in range(args.repeats):
            pair = {}
            for placement in results:
                out = tmp / f"{placement}.json"
                cmd = [*child, str(out), _config(tmp, placement, args)]
                proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=3000)
                if proc.returncode or not out.exists():
                    sys.exit(f"{placement} failed:\n{proc.stderr[-4000:]}")
                pair[placement] = json.loads(out.read_text())
                out.unlink()
                results[placement] += pair[placement]
            ratios.append(_phase(pair["PartialColocation"]) / _phase(pair["FullColocation"]))
    print(
        f"judge {args.judge_model}, prompt <= {args.judge_tokens} tokens; {args.prompts} prompts x 4 samples per "
        f"process; budgets lognormal(median {args.median:g}, sigma {args.sigma:g}) <= {args.cap}; "
        f"{args.steps} steps measured per placement and pair; {args.repeats} interleaved pairs"
    )
    print(
        f"{'placement':<20}{'phase s/step':>14}{'idle rank 0':>13}{'idle rank 1':>13}   rollout/sync/reward s, rank 0 | 1"
    )
    for placement, rows in results.items():
        phase = _phase(rows)
        idle = [statistics.mean(step[k][1] / max(step[k][0], 1e-9) for step in rows) for k in range(2)]
        parts = " | ".join(
            "/".join(f"{statistics.mean(step[k][i] for step in rows):.3f}" for i in (2, 3, 4)) for k in range(2)
        )
        print(f"{placement:<20}{phase:>14.3f}{idle[0]:>13.1%}{idle[1]:>13.1%}   {parts}")
    print("partial/full per pair: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"partial_over_full={statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
