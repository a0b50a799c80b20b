"""Full versus partial colocation for rollout + generative-reward work with long-tailed response lengths.

Two processes, the tiny policy and a larger judge (the ~18M-parameter built-in ``small-qwen2``, whose
scoring costs about as much as generating). Response lengths are long-tailed: each prompt's budget is
drawn from a lognormal (median 16 tokens, capped at 160) and generation runs to that budget, so a few
groups take ~10x longer than the median. Both placements run the same steps (same data, seeds and
lengths), one after the other in this invocation:

* full colocation: each process generates its own prompts, then judges them;
* partial colocation: process 0 generates both processes' prompts while process 1 judges each group as
  soon as it finishes.

Reported per placement: the rollout + reward phase time per step (after a warm-up step) and each
process's idle fraction of that phase (waiting for work or for the other process).

    python bench/placement.py [--steps 6] [--judge-tokens 96]

``--judge-tokens`` bounds the judge's prompt (question and the end of the answer), i.e. the cost of a
judgment relative to generating the answer. Partial colocation wins when scoring costs about as much as
the tail of generation (it hides one behind the other); when judging dominates, full colocation, which
judges on both processes at once, can be faster on equal hardware.

Last line: ``partial_over_full=<phase time under partial / under full>``; target at most 0.85.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

from yatt_lightning.longtail import WaitForAll

REPO = Path(__file__).resolve().parents[1]
WARMUP = 1


class LognormalLengths(WaitForAll):
    """Each prompt's samples run to a budget drawn from a lognormal fixed by the prompt's seed."""

    def stream(self, engine, prompts, sampling, seeds, keep):
        budgets = []
        for seed in seeds:
            u1 = (zlib.crc32(f"a{seed}".encode()) % 10**6 + 0.5) / 10**6
            u2 = (zlib.crc32(f"b{seed}".encode()) % 10**6 + 0.5) / 10**6
            z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
            budgets.append(int(min(160, max(2, 16 * math.exp(z)))))
        stream = engine.generate_stream(prompts, sampling, seeds, max_new_tokens=budgets)
        try:
            for count, item in enumerate(stream, start=1):
                yield item
                if count >= keep:
                    return
        finally:
            stream.close()


def _child(out: Path, config: str, steps: int) -> None:
    import torch
    from lightning.pytorch import Callback

    from yatt_lightning.cli import YattCLI
    from yatt_lightning.logging_setup import configure_logging

    class Phase(Callback):
        def __init__(self) -> None:
            self.rows = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            t = module.phase_times
            phase = t["rollout"] + t["sync"] + t["reward"]
            mine = torch.tensor([phase, trainer.strategy.placement.idle], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(trainer.world_size)]
            torch.distributed.all_gather(every, mine)
            if batch_idx >= WARMUP:
                self.rows.append([v.tolist() for v in every])

        def on_train_end(self, trainer, module) -> None:
            if trainer.is_global_zero:
                out.write_text(json.dumps(self.rows))

    torch.set_num_threads(1)
    configure_logging()
    cli = YattCLI(
        args=["--config", config, "--trainer.max_steps", str(steps + WARMUP), "--trainer.logger", "false",
              "--trainer.callbacks", "[]", "--model.long_tail", "__main__.LognormalLengths",
              "--model.sampling.n", "4", "--model.sampling.max_new_tokens", "160", "--model.sampling.temperature", "1.0",
              "--data.batch_size", "8", "--model.micro_batch_size", "32"],
        run=False,
    )  # fmt: skip
    cli.trainer.callbacks.append(Phase())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def _config(tmp: Path, placement: str, judge_tokens: int) -> str:
    import yaml

    config = yaml.safe_load((REPO / "configs" / "grpo_genrm_full.yaml").read_text())
    config["trainer"]["strategy"]["init_args"]["placement"]["class_path"] = f"yatt_lightning.placement.{placement}"
    for reward in config["model"]["init_args"]["rewards"]:
        if reward["class_path"].endswith("GenerativeRewardModel"):
            reward["init_args"].update(model="builtin:small-qwen2", max_judge_tokens=judge_tokens)
    config["model"]["init_args"]["max_prompt_tokens"] = 16
    path = tmp / f"{placement}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--judge-tokens", type=int, default=96)
    p.add_argument("--child", nargs=3)
    args = p.parse_args()
    if args.child:
        _child(Path(args.child[0]), args.child[1], int(args.child[2]))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for placement in ("FullColocation", "PartialColocation"):
            out = tmp / f"{placement}.json"
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                str(out),
                _config(tmp, placement, args.judge_tokens),
                str(args.steps),
            ]
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=3000)
            if proc.returncode or not out.exists():
                sys.exit(f"{placement} failed:\n{proc.stderr[-4000:]}")
            results[placement] = json.loads(out.read_text())
    print(f"judge prompt <= {args.judge_tokens} tokens; {args.steps} steps measured per placement")
    print(f"{'placement':<20}{'phase s/step':>14}{'idle rank 0':>13}{'idle rank 1':>13}")
    means = {}
    for placement, rows in results.items():
        phase = statistics.mean(max(r[0] for r in step) for step in rows)  # the step waits for the slower rank
        idle = [statistics.mean(step[k][1] / max(step[k][0], 1e-9) for step in rows) for k in range(2)]
        means[placement] = phase
        print(f"{placement:<20}{phase:>14.3f}{idle[0]:>13.1%}{idle[1]:>13.1%}")
    print(f"partial_over_full={means['PartialColocation'] / means['FullColocation']:.3f}", flush=True)


if __name__ == "__main__":
    main()
