"""Does asynchronous RL overlap rollout and training, and at what cost?

Runs of ``configs/grpo_small.yaml``'s model (``builtin:small4-qwen2``), one after the other in this invocation,
the same seeds and prompts:

* **probe**: lag 0 (below) for 5 steps of which the last 4 alternate between the longest response length
  allowed and a quarter of it (the first is warm-up). Each side's time is a line in the length, through its
  mean at the two lengths; the length (from a quarter to the whole) whose predicted sides give the highest
  ``bound`` is the one every other run uses: rollout and training then take about the same time on the
  machine that runs the bench (``--tokens`` gives a length and skips the probe). The bench prints the lines,
  the length chosen and why;
* **lag 0**: Disaggregated, 1 rollout rank + 1 trainer, 2 processes of one thread each, ``max_staleness: 0``
  (``fixed_lag``): the synchronous step on separate ranks; its producer's own time per step is R (generate,
  score, apply the weights) and its trainer's own time T (advantage, update, publish);
* **lag 1**: the same with ``max_staleness: 1``: rollout of step k+1 overlaps training of step k;
* **colocated**: FullColocation, DP=2, 2 processes of one thread (each rank half the prompts): both cores do
  both stages in turn;
* **colocated_one**: FullColocation in one process with a thread per core of its environment
  (``OMP_NUM_THREADS`` set to ``len(os.sched_getaffinity(0))``), all the prompts: colocation at its best
  when one process can use every core. The bench names the fastest placement on these cores.

Figures (means over the steps after ``--warmup``; throughput = samples / wall time per step, on rank 0; the
lag runs' staleness is the largest ``async/staleness_max`` each logged):

* ``bound`` = (R + T) / max(R, T) of the lag-0 run: what a perfect overlap could give;
* ``async_over_sync`` = throughput lag 1 / lag 0;
* ``overlap_efficiency`` = lag 1's step time / the slower side's own time in that run (1.0: the slower side
  never waits);
* ``async_over_colocated`` = throughput lag 1 / colocated, 2 processes (reported, not a target; the one-process
  colocated run's throughput is printed beside);
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

    python bench/async_rl.py [--smoke] [--steps 30] [--prompts 2] [--samples 6] [--tokens N] [--warmup 2]

Before the probe, the length was fixed at 240 tokens, which made R and T close on this 2-core machine on
2026-12-05 (6 samples: bound 1.78 in the morning, 1.91 in the evening) but not on 2026-12-06 (bound 1.69).
6 samples stay: 7 gave a reward gap of 0.27-0.28 at 30 and 40 steps.

``--smoke``: the tiny model, 6 steps (2 warm-up), 8 prompts x 8 samples, 16 tokens, without the probe (it chose
16, the top, whenever it ran at this size; :func:`choose_length` has a pure test) and without the one-process
colocated run (CI's time; the full size runs both).

Last line: ``bound=B async_over_sync=X overlap_efficiency=Y async_over_colocated=Z reward_gap=W
publish_over_bare=V push_over_vllm_load=U tokens=L``; targets B >= 1.8, X >= 1.5, Y <= 1.18, W <= 0.05,
V <= 1.25, U <= 1.2 (L: the length the probe chose).
"""

from __future__ import annotations

import argparse
import json
import os
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
CORES = len(os.sched_getaffinity(0))  # the cores this run may use (the one-process colocated run takes them all)


def _child(out: Path, mode: str, config: str, overrides: list[str]) -> None:
    import torch
    from _common import build_cli
    from lightning.pytorch import Callback

    class Measure(Callback):
        def __init__(self) -> None:
            self.rows, self.last, self.end = [], None, {}

        def on_train_start(self, trainer, module) -> None:
            if mode != "probe" or trainer.strategy.role.trains:
                return
            engine, stream, steps = trainer.strategy.engine, trainer.strategy.engine.generate_stream, iter(PROBE)

            def probing(prompts, sampling, seeds, max_new_tokens=None, images=None):  # step k: PROBE[k] x the length
                fraction = next(steps)
                length = max(1, round(sampling.max_new_tokens * fraction))
                return stream(prompts, sampling, seeds, [length] * len(prompts), images)

            engine.generate_stream = probing

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            if trainer.strategy.role.only_rolls_out or outputs is None:
                return
            s = outputs["stats"].scalars
            produce = s["time/rollout"] + s["time/sync"] + s["time/reward"]
            colocated = mode.startswith("colocated")
            train = s["time/train"] + (0.0 if colocated else s["time/publish"])  # a colocated step publishes nothing
            self.rows.append({
                "wall": now - self.last if self.last is not None else None, "produce": produce, "train": train,
                "reward": s["reward/mean"], "samples": outputs["stats"].samples_count,
                "length": s["response_length/mean"],
                # a colocated step has no staleness to log; a disaggregated one must log it
                "staleness": None if colocated else s["async/staleness_max"],
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
PROBE = [1.0, 0.25, 1.0, 0.25, 1.0]  # the probe's steps, as fractions of its length (the first one: warm-up)


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
    trainer = strategy.role.only_trains
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


def _run(tmp: Path, mode: str, config: str, args: argparse.Namespace, tokens: int) -> dict:
    """One run in processes of its own: ``probe`` (lag 0 at :data:`PROBE`'s lengths), ``lag0``, ``lag1``,
    ``colocated`` (2 processes of one thread) or ``colocated_one`` (1 process, a thread per core)."""
    per_rank = args.prompts // 2 if mode == "colocated" else args.prompts
    steps = len(PROBE) if mode == "probe" else args.steps
    overrides = [f"--trainer.max_steps={steps}", f"--trainer.devices={1 if mode == 'colocated_one' else 2}",
                 f"--model.init_args.sampling.max_new_tokens={tokens}",
                 f"--model.init_args.sampling.n={args.samples}", f"--data.init_args.batch_size={per_rank}"]  # fmt: skip
    env = dict(os.environ)
    if mode == "colocated_one":  # every core of this run's environment, explicitly (build_cli reads it)
        env["OMP_NUM_THREADS"] = str(CORES)
    if mode.startswith("colocated"):
        overrides += ["--trainer.strategy.init_args.placement=yatt_lightning.placement.FullColocation"]
    else:
        lag = {"probe": 0, "lag0": 0, "lag1": 1}[mode]
        overrides += [f"--trainer.strategy.init_args.placement={DISAGGREGATED}",
                      f"--trainer.strategy.init_args.placement.init_args.max_staleness={lag}",
                      "--trainer.strategy.init_args.placement.init_args.fixed_lag=true"]  # fmt: skip
    out = tmp / f"{mode}.json"
    cmd = [sys.executable, __file__, "--child", str(out), mode, config, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def choose_length(rows: list[dict], top: int) -> tuple[int, str]:
    """The response length (from ``top`` / 4 to ``top``) whose predicted lag-0 sides give the highest bound, from
    the probe's steps: each side's time a line in the length, through its mean at each of the two lengths."""
    points = [(max(1, round(top * f)), r) for f, r in zip(PROBE[1:], rows[1:], strict=True)]  # warm-up dropped
    lengths = sorted({n for n, _ in points})
    lines = {}
    for side in ("produce", "train"):
        lo, hi = (statistics.mean(r[side] for n, r in points if n == length) for length in lengths)
        slope = (hi - lo) / (lengths[1] - lengths[0])
        lines[side] = (lo - slope * lengths[0], slope)

    def predicted(n: int) -> tuple[float, float, float]:
        R, T = (max(1e-6, a + b * n) for a, b in (lines["produce"], lines["train"]))
        return R, T, (R + T) / max(R, T)

    best = max(range(lengths[0], top + 1), key=lambda n: (round(predicted(n)[2], 3), -n))  # ties: the shorter
    R, T, bound = predicted(best)
    why = ("R and T cross here" if bound > 1.99 else
           f"the bound's best within {lengths[0]}..{top}: {'R' if R > T else 'T'} is the longer side at every length")  # fmt: skip
    (ra, rb), (ta, tb) = lines["produce"], lines["train"]
    return best, (f"probe (lag 0, {len(points)} steps at {lengths[0]} and {lengths[1]} tokens): R = {ra:.3f} + "
                  f"{rb * 1e3:.2f} ms x tokens, T = {ta:.3f} + {tb * 1e3:.2f} ms x tokens; chosen {best} tokens "
                  f"(predicted R {R:.3f} s, T {T:.3f} s, bound {bound:.3f}: {why})")  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(REPO / "bench"))
        _child(Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=None,
                   help="max_new_tokens; default: chosen by a probe, up to 240 (the model has 256 positions)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (colocated: half per rank)")
    p.add_argument("--samples", type=int, default=6, help="samples per prompt")
    p.add_argument("--smoke", action="store_true", help="the tiny model, 6 steps of up to 16 tokens")
    args = p.parse_args()
    config, top = SMALL, 240
    if args.smoke:  # the probe chose the top length at this size every time it ran in CI: the smoke skips it
        config, args.steps, args.warmup, args.prompts, args.samples, top = TINY, 6, 2, 8, 8, 16
        args.tokens = args.tokens or top
    with tempfile.TemporaryDirectory() as tmp:
        if args.tokens is None:
            probe = _run(Path(tmp), "probe", config, args, top)
            tokens, why = choose_length(probe["rows"], top)
            print(why, flush=True)
        else:
            tokens = args.tokens
            print(f"{tokens} tokens, as given (no probe)", flush=True)
        runs = {mode: _run(Path(tmp), mode, config, args, tokens)
                for mode in ("lag0", "lag1", "colocated", *(() if args.smoke else ("colocated_one",)))}  # fmt: skip

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
    names = {"lag0": "disaggregated lag 0", "lag1": "disaggregated lag 1",
             "colocated": "colocated, 2 processes x 1 thread", "colocated_one": f"colocated, 1 process x {CORES} threads"}  # fmt: skip
    for mode in runs:
        print(f"{mode}: step {mean(mode, 'wall'):.3f}s produce {mean(mode, 'produce'):.3f}s "
              f"train {mean(mode, 'train'):.3f}s samples/s {throughput(mode):.2f} "
              f"response length {mean(mode, 'length'):.1f} ({names[mode]})")  # fmt: skip
    fastest = max(runs, key=throughput)
    print(f"fastest placement on these {CORES} cores: {names[fastest]} ({throughput(fastest):.2f} samples/s; "
          f"colocated at its best: {max(throughput(m) for m in runs if m.startswith('colocated')):.2f})")  # fmt: skip
    lag1, colocated = runs["lag1"], runs["colocated"]
    print(" ".join(f"{mode}_staleness_max={max(r['staleness'] for r in runs[mode]['rows']):.0f}" for mode in ("lag0", "lag1")))
    print(f"publish {lag1['publish_s']:.4f}s bare broadcast {lag1['bare_s']:.4f}s of {lag1['bytes'] / 2**20:.1f} MiB "
          f"(then the engine's names: {lag1['take_s'] * 1e3:.1f} ms, in R); "
          f"colocated push {colocated['push_s']:.4f}s vLLM reload {colocated['load_s']:.4f}s")  # fmt: skip
    print(
        f"bound={bound:.3f} async_over_sync={throughput('lag1') / throughput('lag0'):.3f} "
        f"overlap_efficiency={mean('lag1', 'wall') / slower:.3f} "
        f"async_over_colocated={throughput('lag1') / throughput('colocated'):.3f} reward_gap={gap:.3f} "
        f"publish_over_bare={lag1['publish_s'] / lag1['bare_s']:.3f} "
        f"push_over_vllm_load={colocated['push_s'] / colocated['load_s']:.3f} tokens={tokens}"
    )


if __name__ == "__main__":
    main()
