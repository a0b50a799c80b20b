"""Does asynchronous RL overlap rollout and training, and at what cost?

Three runs of ``configs/grpo_small.yaml``'s model (``builtin:small4-qwen2``), 2 processes of one thread each,
one after the other in this invocation, the same seeds and prompts:

* **lag 0**: Disaggregated, 1 rollout rank + 1 trainer, ``max_staleness: 0`` (``fixed_lag``): the
  synchronous step on separate ranks; its producer's own time per step is R (generate, score, apply the
  weights) and its trainer's own time T (advantage, update, publish);
* **lag 1**: the same with ``max_staleness: 1``: rollout of step k+1 overlaps training of step k;
* **colocated**: FullColocation, DP=2 (each rank half the prompts): both cores do both stages in turn.

Figures (means over the steps after ``--warmup``; throughput = samples / wall time per step, on rank 0):

* ``bound`` = (R + T) / max(R, T) of the lag-0 run: what a perfect overlap could give;
* ``async_over_sync`` = throughput lag 1 / lag 0;
* ``overlap_efficiency`` = lag 1's step time / the slower side's own time in that run (1.0: the slower side
  never waits);
* ``async_over_colocated`` = throughput lag 1 / colocated (reported, not a target);
* ``reward_gap`` = mean reward over the last fifth of the steps, lag 0 minus lag 1 (equal samples);
* ``publish_over_bare`` = after the lag-1 run, a publish of the trainer's weights (what it sends, the
  header and the buckets, until the rollout rank holds the version, ready for its engine to take) / a bare
  broadcast of the same bytes on the same ranks, from and into buffers allocated and touched beforehand
  (the transfer alone), each from the trainer's start (the receives posted before), best of 30
  alternating pairs. The engine's take that follows (q, k and v copied out of the fused QKV weight into
  the engine's names, ~3 ms here) is the start of the engine's apply, counted in R (``time/sync``) and
  printed beside;
* ``push_over_vllm_load`` = after the colocated run, one colocated push (export + the engine's reload) /
  the engine's reload of the same tensors, already exported (best of 30 alternating pairs).

    python bench/async_rl.py [--smoke] [--steps 30] [--prompts 2] [--samples 6] [--tokens 240] [--warmup 2]

The defaults make R and T close on this 2-core machine (2026-12-05, 240 tokens, 2 prompts: 4 samples each
gave R = 2.47 s, T = 1.74 s, bound 1.70; 6 gave bound 1.78 in the morning's full run (R = 3.77 s, T = 2.93 s)
and 1.91 in the evening's (R = 2.66 s, T = 2.41 s); 7 gave bound 1.88-1.98 but a reward gap of 0.27-0.28 at
30 and 40 steps, so 6 it stays: training grows with the samples faster than batched generation).

Last line: ``bound=B async_over_sync=X overlap_efficiency=Y async_over_colocated=Z reward_gap=W
publish_over_bare=V push_over_vllm_load=U``; targets B >= 1.8, X >= 1.5, Y <= 1.18, W <= 0.05, V <= 1.25,
U <= 1.2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALL = str(REPO / "configs" / "grpo_small.yaml")
TINY = str(REPO / "configs" / "grpo_tiny.yaml")
DISAGGREGATED = "yatt_lightning.placement.Disaggregated"


def _child(out: Path, mode: str, config: str, overrides: list[str]) -> None:
    import torch
    from _common import build_cli
    from lightning.pytorch import Callback

    class Measure(Callback):
        def __init__(self) -> None:
            self.rows, self.last, self.end = [], None, {}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            if trainer.strategy.role == "rollout" or outputs is None:
                return
            s = outputs["stats"].scalars
            produce = s["time/rollout"] + s["time/sync"] + s["time/reward"]
            train = s["time/train"] + s.get("time/publish", 0.0)  # a colocated step publishes nothing
            self.rows.append({
                "wall": now - self.last if self.last is not None else None, "produce": produce, "train": train,
                "reward": s["reward/mean"], "samples": outputs["stats"].samples_count,
                "staleness": s.get("async/staleness_max", 0.0),  # a colocated step has none
            })  # fmt: skip
            self.last = now

        def on_train_end(self, trainer, module) -> None:
            strategy = trainer.strategy
            if mode == "lag1":
                self.end = _publish_over_bare(strategy, module)
            if mode == "colocated":
                self.end = _push_over_load(strategy, module)
            if trainer.global_rank == 0:
                out.write_text(json.dumps({"rows": self.rows, **self.end}))

    cli = build_cli(overrides, config=config)
    cli.trainer.callbacks.append(Measure())
    torch.manual_seed(0)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


REPEATS = 30


def _publish_over_bare(strategy, module) -> dict:
    """One more publish of the trainer's weights, and a bare broadcast of as many bytes between the same two
    ranks over the same backend, each timed from the trainer's start to the rollout rank holding the bytes
    (both processes read this host's monotonic clock). In both the rollout rank's receives are posted before
    the start: the receiving thread always has the next header's and the next version's buckets' receives
    posted, and the bare one is posted before the barrier. (The bare one uses a group of its own: another
    collective on the publish group would cross that posted receive.) The rollout rank's take of each
    version (the engine's names) is timed after its end."""
    import torch

    from yatt_lightning.placement.weight_channel import WEIGHTS

    placement = strategy.placement
    bare_group = torch.distributed.new_group([0, *placement.rollout], backend="gloo")
    version = torch.tensor([placement.updates + 1])  # the trainer's next version
    torch.distributed.broadcast(version, src=0)
    version = int(version)
    trainer = strategy.role == "train"
    size = torch.zeros(1, dtype=torch.int64)
    if trainer:  # one publish first: the bare one moves as many bytes as a publish sends
        named, rename = placement.weights_of(module.policy)
        placement.publisher.publish(WEIGHTS, version, -1, named, rename=rename)
        placement.publisher.flush(placement.timeout_s)
        size[0] = placement.publisher.sent_bytes
    else:
        placement.receiver.wait(lambda s: s.latest >= version, f"version {version}", placement.timeout_s)
        placement.receiver.take(version)
    version += 1
    torch.distributed.broadcast(size, src=0)  # the rollout rank learns the size for the bare one
    bare = torch.ones(int(size[0]), dtype=torch.uint8)  # touched on both ranks: the bare one times the transfer
    times = {"publish": [], "bare": [], "take": []}
    for repeat in range(REPEATS):  # alternating, best of each: a transfer of ~40 ms moves 4x with the load
        for what in ("publish", "bare"):
            posted = None
            if what == "bare" and not trainer:
                posted = torch.distributed.broadcast(bare, src=0, group=bare_group, async_op=True)
            torch.distributed.barrier()
            start = time.monotonic()
            if what == "publish" and trainer:  # exported as it is sent, as the trainer does
                named, rename = placement.weights_of(module.policy)
                placement.publisher.publish(WEIGHTS, version + repeat, -1, named, rename=rename)
                placement.publisher.flush(placement.timeout_s)
            elif what == "publish":
                placement.receiver.wait(lambda s, v=version + repeat: s.latest >= v, f"version {version + repeat}",
                                        placement.timeout_s)  # fmt: skip
            elif trainer:
                torch.distributed.broadcast(bare, src=0, group=bare_group)
            else:
                posted.wait()
            held = time.monotonic()
            if what == "publish" and not trainer:  # the engine's apply begins: its names (q, k, v copied out)
                placement.receiver.take(version + repeat)
            start_end = torch.tensor([start, held, time.monotonic() - held], dtype=torch.float64)
            torch.distributed.broadcast(start_end[:1], src=0)  # the trainer's start
            torch.distributed.broadcast(start_end[1:], src=placement.rollout[0])  # the rollout rank's end, take
            times[what].append(float(start_end[1] - start_end[0]))
            if what == "publish":
                times["take"].append(float(start_end[2]))
    return {"publish_s": min(times["publish"]), "bare_s": min(times["bare"]), "take_s": min(times["take"]),
            "bytes": int(size[0])}  # fmt: skip


def _push_over_load(strategy, module) -> dict:
    """A colocated push (export + the engine's reload) against the reload of the same exported tensors."""
    engine, pushes, loads = strategy.engine, [], []
    for _ in range(REPEATS):  # alternating, best of each: the push includes the reload, so noise only adds to
        # either (best of 7 gave 0.499 once in CI beside the other worker, 2026-12-05: a push "faster" than its load)
        t0 = time.perf_counter()
        engine.push_weights(module.policy.export_hf())
        pushes.append(time.perf_counter() - t0)
        named = [(n, t.clone()) for n, t in module.policy.export_hf()]
        t0 = time.perf_counter()
        engine.push_weights(named)
        loads.append(time.perf_counter() - t0)
    return {"push_s": min(pushes), "load_s": min(loads)}


def _run(tmp: Path, mode: str, config: str, args: argparse.Namespace) -> dict:
    per_rank = args.prompts if mode != "colocated" else args.prompts // 2
    overrides = [f"--trainer.max_steps={args.steps}", "--trainer.devices=2",
                 f"--model.init_args.sampling.max_new_tokens={args.tokens}",
                 f"--model.init_args.sampling.n={args.samples}", f"--data.init_args.batch_size={per_rank}"]  # fmt: skip
    if mode == "colocated":
        overrides += ["--trainer.strategy.init_args.placement=yatt_lightning.placement.FullColocation"]
    else:
        lag = {"lag0": 0, "lag1": 1}[mode]
        overrides += [f"--trainer.strategy.init_args.placement={DISAGGREGATED}",
                      f"--trainer.strategy.init_args.placement.init_args.max_staleness={lag}",
                      "--trainer.strategy.init_args.placement.init_args.fixed_lag=true"]  # fmt: skip
    out = tmp / f"{mode}.json"
    cmd = [sys.executable, __file__, "--child", str(out), mode, config, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(REPO / "bench"))
        _child(Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=240, help="max_new_tokens (the model has 256 positions)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (colocated: half per rank)")
    p.add_argument("--samples", type=int, default=6, help="samples per prompt (with --prompts, sized so that R ~ T)")
    p.add_argument("--smoke", action="store_true", help="the tiny model, 6 steps of 6 tokens")
    args = p.parse_args()
    config = SMALL
    if args.smoke:
        config, args.steps, args.warmup, args.tokens, args.prompts, args.samples = TINY, 6, 2, 6, 8, 8
    with tempfile.TemporaryDirectory() as tmp:
        runs = {mode: _run(Path(tmp), mode, config, args) for mode in ("lag0", "lag1", "colocated")}

    def after_warmup(mode: str) -> list[dict]:
        return [r for r in runs[mode]["rows"][args.warmup :] if r["wall"] is not None]

    def mean(mode: str, key: str) -> float:
        return statistics.mean(r[key] for r in after_warmup(mode))

    def throughput(mode: str) -> float:
        rows = after_warmup(mode)
        return sum(r["samples"] for r in rows) / sum(r["wall"] for r in rows)

    R, T = mean("lag0", "produce"), mean("lag0", "train")
    bound = (R + T) / max(R, T)
    slower = max(mean("lag1", "produce"), mean("lag1", "train"))
    fifth = max(1, args.steps // 5)
    gap = statistics.mean(r["reward"] for r in runs["lag0"]["rows"][-fifth:]) - statistics.mean(
        r["reward"] for r in runs["lag1"]["rows"][-fifth:]
    )
    for mode in runs:
        print(f"{mode}: step {mean(mode, 'wall'):.3f}s produce {mean(mode, 'produce'):.3f}s "
              f"train {mean(mode, 'train'):.3f}s samples/s {throughput(mode):.2f}")  # fmt: skip
    lag1, colocated = runs["lag1"], runs["colocated"]
    print(" ".join(f"{mode}_staleness_max={max(r['staleness'] for r in runs[mode]['rows']):.0f}" for mode in runs))
    print(f"publish {lag1['publish_s']:.4f}s bare broadcast {lag1['bare_s']:.4f}s of {lag1['bytes'] / 2**20:.1f} MiB "
          f"(then the engine's names: {lag1['take_s'] * 1e3:.1f} ms, in R); "
          f"colocated push {colocated['push_s']:.4f}s vLLM reload {colocated['load_s']:.4f}s")  # fmt: skip
    print(
        f"bound={bound:.3f} async_over_sync={throughput('lag1') / throughput('lag0'):.3f} "
        f"overlap_efficiency={mean('lag1', 'wall') / slower:.3f} "
        f"async_over_colocated={throughput('lag1') / throughput('colocated'):.3f} reward_gap={gap:.3f} "
        f"publish_over_bare={lag1['publish_s'] / lag1['bare_s']:.3f} "
        f"push_over_vllm_load={colocated['push_s'] / colocated['load_s']:.3f}"
    )


if __name__ == "__main__":
    main()
