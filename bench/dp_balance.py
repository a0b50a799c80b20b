"""Does DPLoadBalancer even out what each data-parallel rank trains, and shorten the training phase?

Two data-parallel processes train the tiny model on synthetic rollouts whose lengths are long-tailed:
each prompt draws a scale from a lognormal (sigma 1), and its samples vary around it, so a rank that
draws a long prompt holds many long sequences, as with real reasoning prompts. Two length distributions,
each in its own run:

- ``current``: median 16 completion tokens, up to 200; 8 prompts x 8 samples per rank, micro-batches
  capped at 2048 padded tokens. On 2 CPU cores micro-batches and the exchange weigh as much as tokens.
- ``long``: median 128, up to 1008 (with the 16-token prompt, 1024 positions; the tiny model's shape
  with 1280 positions); 8 prompts x 4 samples per rank, micro-batches capped at 4096. Tokens dominate.

Steps come in pairs that train on identical lengths, one step balanced and one not; the order inside a
pair alternates A B, B A, A B, ... (ABBA), so drifts of a shared machine land on both arms. Both arms
pack micro-batches the same way (:mod:`yatt_lightning.training.packing`) and both feed the balancer's
cost model (it learns from every step); only whether sequences move differs. 40 measured pairs per
distribution by default: a single pair's ratio swings by +-30% on a shared 2-core machine.

What is measured is what each rank actually did: the padded tokens (samples x longest sequence of each
micro-batch) it forwarded and backwarded in the update, after the exchange, and its own training-phase
wall time. Imbalance = max over ranks / mean over ranks of those padded tokens. A step's training phase
lasts as long as its slowest rank's (the gradient all-reduce waits for it); the speedup of a pair is
unbalanced / balanced slowest-rank time, and the figure is the median over pairs, with a bootstrap
interval over the pairs.

    python bench/dp_balance.py [--smoke] [--trainer.max_steps 84]

Last line: ``imbalance_before=<x> imbalance_after=<y> train_phase_speedup=<z> speedup_low=<l>
long_imbalance_before=... long_imbalance_after=... long_train_phase_speedup=... long_speedup_low=...``
(``speedup_low``: the bootstrap interval's lower end). Goals: current speedup >= 1.0 with its lower end
above 0.98; long speedup >= 1.08 with imbalance_after <= 1.05. ``--smoke``: 8 steps of the long distribution
only (the current one's figures print as nan).
"""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import sys

import torch
from lightning.pytorch import Callback

from yatt_lightning.module import RLHFModule
from yatt_lightning.rollout.batch import RolloutBatch

WARMUP = 4  # steps (two pairs) not measured: the cost model's first measurements
# name: (median completion tokens, longest, samples per prompt, token budget per micro-batch)
DISTRIBUTIONS = {"current": (16, 200, 8, 2048), "long": (128, 1008, 4, 4096)}


class LongTailRollouts(RLHFModule):
    """Completions with group-correlated lognormal lengths; a step pair (2k, 2k+1) repeats the same lengths
    (drawn per rank and batch position, so both steps of a pair train the same lengths on the same ranks)."""

    padded_tokens = 0  # this step's training micro-batches, on this rank
    median, longest = DISTRIBUTIONS["current"][:2]

    def rollout(self, batch):
        n = self.sampling.n
        pair = self.trainer.global_step // 2
        self.padded_tokens = 0
        prompt_ids = [self.tokenize_prompt(row) for row in batch]
        completions = []
        rank = self.trainer.global_rank
        for position, _row in enumerate(batch):  # by position, not row: both steps of a pair draw the same
            g = torch.Generator().manual_seed(pair * 100_003 + rank * 1_009 + position)
            scale = self.median * math.exp(torch.randn((), generator=g).item())  # lognormal, sigma 1
            for _ in range(n):
                length = int(min(self.longest, max(2, scale * math.exp(0.3 * torch.randn((), generator=g).item()))))
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


class LongRollouts(LongTailRollouts):
    median, longest = DISTRIBUTIONS["long"][:2]


def balanced_in_step(step: int) -> bool:
    """ABBA: pair k = steps (2k, 2k+1); even pairs run unbalanced first, odd pairs balanced first."""
    pair, second = divmod(step, 2)
    return bool(second) != bool(pair % 2)


class Alternate(Callback):
    """Balance by the ABBA schedule; record what every rank trained and how long its training phase took."""

    def __init__(self) -> None:
        self.records: list[dict] = []  # per measured step (rank 0 only)
        self.coefficients: dict[str, float] = {}  # the balancer's cost model after the last step

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
                "moved": outputs["stats"].scalars["balance/moved"],
            })  # fmt: skip
            self.coefficients = module.balancer.model.coefficients


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


def run_one(name: str, argv: list[str], smoke: bool) -> None:
    """One distribution's ABBA run (this process and Lightning's second one); rank 0 prints its table and
    ``imbalance_before=... train_phase_speedup=... speedup_low=...``."""
    from _common import build_cli

    median, longest, n, budget = DISTRIBUTIONS[name]
    size = ["--trainer.max_steps", "8", "--data.batch_size", "4"] if smoke else ["--trainer.max_steps", "84"]
    extra = []
    if name == "long":
        from yatt_lightning.models.tiny import TINY_QWEN2_SHAPE, build_tiny_qwen2

        folder = build_tiny_qwen2(shape={**TINY_QWEN2_SHAPE, "max_position_embeddings": 1280})
        extra = ["--model.policy.path", str(folder)]
    cli = build_cli(
        ["--model.class_path", f"__main__.{'LongRollouts' if name == 'long' else 'LongTailRollouts'}",
         "--trainer.devices", "2", "--data.batch_size", "8", "--model.sampling.n", str(n),
         "--model.sampling.max_new_tokens", str(longest), "--model.max_prompt_tokens", "16",
         "--trainer.callbacks+=yatt_lightning.callbacks.DPLoadBalancer",
         "--trainer.callbacks.max_tokens_per_micro_batch", str(budget), *extra, *size, *argv]
    )  # fmt: skip
    alt = Alternate()
    cli.trainer.callbacks.append(alt)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if not cli.trainer.is_global_zero:
        return
    print(f"[{name}: median {median}, up to {longest} completion tokens, {n} samples a prompt, budget {budget}]")
    print(f"{'step':>5}{'arm':>12}{'padded tokens per rank':>26}{'imbalance':>11}{'train s per rank':>20}")
    for r in alt.records:
        arm = "balanced" if r["balanced"] else "unbalanced"
        tokens = " ".join(f"{t:>8.0f}" for t in r["tokens"])
        times = " ".join(f"{t:>6.3f}" for t in r["train_s"])
        print(f"{r['step']:>5}{arm:>12}{tokens:>26}{r['imbalance']:>11.3f}{times:>20}  moved {r['moved']:.0f}")
    off = [r for r in alt.records if not r["balanced"]]
    on = [r for r in alt.records if r["balanced"]]
    speedups = pair_speedups(alt.records)
    print(f"unbalanced: slowest rank's train phase {statistics.mean(max(r['train_s']) for r in off):.3f} s mean; "
          f"balanced: {statistics.mean(max(r['train_s']) for r in on):.3f} s; pair speedups "
          + " ".join(f"{x:.2f}" for x in speedups))  # fmt: skip
    print("cost model (seconds per term): " + " ".join(f"{k}={v:.3g}" for k, v in alt.coefficients.items()))
    lo, hi = bootstrap_interval(speedups)
    print(f"median pair speedup, 95% bootstrap interval over pairs: {lo:.3f} .. {hi:.3f} ({len(speedups)} pairs)")
    before = statistics.mean(r["imbalance"] for r in off)
    after = statistics.mean(r["imbalance"] for r in on)
    print(f"imbalance_before={before:.3f} imbalance_after={after:.3f} "
          f"train_phase_speedup={statistics.median(speedups):.3f} speedup_low={lo:.3f}", flush=True)  # fmt: skip


LAST = re.compile(r"imbalance_before=\S+ imbalance_after=\S+ train_phase_speedup=\S+ speedup_low=\S+")


def main() -> None:
    from _common import pop_smoke

    argv = sys.argv[1:]
    smoke = pop_smoke(argv)
    if argv[:1] == ["--distribution"]:  # one run, in this process
        run_one(argv[1], argv[2:], smoke)
        return
    # The smoke size runs the long distribution only: there the balancer must move tokens (what its test checks);
    # the current one's figure is a timing the smoke size cannot judge, and its run would cost as much again.
    lines = {"current": "imbalance_before=nan imbalance_after=nan train_phase_speedup=nan speedup_low=nan"}
    for name in ["long"] if smoke else DISTRIBUTIONS:  # each in its own processes: one training world per run
        cmd = [sys.executable, __file__, "--distribution", name, *(["--smoke"] if smoke else []), *argv]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
        print(out, end="", flush=True)
        found = LAST.findall(out)
        if not found:
            raise SystemExit(f"dp_balance: the {name} run printed no result line")
        lines[name] = found[-1]
    long = " ".join(f"long_{kv}" for kv in lines["long"].split())
    print(f"{lines['current']} {long}", flush=True)


if __name__ == "__main__":
    main()
