"""What does an asynchronous checkpoint every k steps cost the run, next to a synchronous one?

One training run of a random-initialised Qwen2-style model (``--size medium``: ~50M parameters,
checkpoints of ~600 MB with the Adam state; ``--size small``: the ~18M built-in ``small-qwen2``, ~210 MB;
``--smoke``: the tiny built-in model) is cut into blocks of k consecutive steps (``--every``, default 6),
each block one arm; the first ``--clean`` steps of every block (default 2) are clean (no save of the
block has started), then:

- ``async``: an asynchronous save at the end of the next step; its writer runs in the background during
  the steps that follow (on CPU from the training tensors until the next optimizer step, which first
  copies what is left; on GPU after a device-to-host copy, in a forked writer), and it is finalised at the
  safe point of the step where it is done, or at the end of the block at the latest (blocking, counted:
  the next save of a run saving every k steps would wait for it there). So the block holds everything
  one save costs the loop: its planning and copies, the writer's competition for the CPU, the GIL and
  the disk, the finalisation.
- ``none``: the same k steps without a save.
- ``sync``: a synchronous save at the same place; its duration is the synchronous save time.

After a warm-up (one async block, one sync block: the first save of each kind), the pattern
``async none none async sync`` repeats ``--repeats`` times (default 10: 20 pairs, ~9.5 min; with 8 pairs one run's
figure moved by +-0.06 from run to run): each async block is paired with
the none block next to it (ABBA order), both arms in the same process on the same model, state sizes and
kind of batches. Between blocks, outside the timed span, older checkpoints are deleted synchronously.

What a block is charged is its *window*: its steps from the save's position on, and the next block's
clean steps. A save's cost does not end with its block: the block after a save starts slower (the kernel
still writes its pages back, the writer's memory is returned), so a window holds everything that one save
costs the loop, and nothing of the save before it (a sync block's after-effect lands in the next async
block's clean steps, which no window of the pairs holds; with whole blocks it was charged to the async arm,
and an async block's after-effect to the none block after it).

    extra per save = median over pairs of (async window - none window)
    stall_ratio    = extra per save / median synchronous save time

The older estimators are printed too: whole blocks (``whole_ratio``) and each block against its own clean
steps (``within_ratio``).

    python bench/async_ckpt.py [--size medium|small] [--every 6] [--clean 2] [--repeats 10] [--smoke] [overrides]

Last line: ``stall_ratio=<x>``; target <= 0.2 at the default size. ``main_thread_share``: the training thread's extra
CPU per async save over a synchronous save's whole CPU (every thread and writer process): the share of the work
that lands on training, which contention does not stretch (the smoke test checks it).
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import build_cli
from lightning.pytorch import Callback
from typing_extensions import override
from yatt_lightning.callbacks import AsyncCheckpoint

from yatt_lightning.checkpoint import folder as ckpt

MEDIUM = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
          "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip
WARMUP = ["async", "sync"]
PATTERN = ["async", "none", "none", "async", "sync"]
TAIL = ["none"]  # the last sync block's window needs the next block's clean steps


@dataclass
class Block:
    arm: str
    steps_s: list[float] = field(default_factory=list)  # wall time of each step, its save work included
    steps_cpu_s: list[float] = field(default_factory=list)  # the trainer's CPU time in each step
    steps_main_cpu_s: list[float] = field(default_factory=list)  # of its main thread alone (not the writer's)
    steps_faults: list[int] = field(default_factory=list)  # the trainer's minor faults in each step
    cpu_s: float = 0.0  # CPU time of the training process (all threads; copy-on-write faults count as system time)
    minor_faults: int = 0  # of the training process: copy-on-write faults after a fork are minor faults
    children_cpu_s: float = 0.0  # CPU time of the writer processes reaped during the block

    @property
    def wall_s(self) -> float:
        return sum(self.steps_s)


def _usage() -> tuple[float, int, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, me.ru_minflt, kids.ru_utime + kids.ru_stime


class Blocks(Callback):
    """Runs after AsyncCheckpoint in the callback list: saves as each block's arm says, times the blocks."""

    def __init__(self, saver: AsyncCheckpoint, every: int, plan: list[str], clean: int) -> None:
        self.saver, self.every, self.plan, self.clean = saver, every, plan, clean
        self.blocks: list[Block] = []  # warm-up included
        self.sync_s: list[float] = []  # synchronous saves (measured blocks only)
        self.async_call_s: list[float] = []  # time inside the async save call and the safe-point finalisations
        self.writer: list[tuple[float, int, float]] = []  # CPU writer: its span, bytes copied at settle, settle s
        self._done = 0
        self._mark = 0.0  # end of the previous step (or of the previous block's clean-up)
        self._step_usage = (0.0, 0, 0.0)
        self._usage_at_start = (0.0, 0, 0.0)
        self._stall_at_start = 0.0  # the saver's own time at the safe points (its non-blocking finalisations)
        self._call = 0.0
        self._main_cpu = 0.0

    def _open_block(self) -> None:
        self.blocks.append(Block(self.plan[len(self.blocks)]))
        self._usage_at_start = self._step_usage = _usage()
        self._main_cpu = time.thread_time()  # the callbacks run in the training (main) thread
        self._stall_at_start = self.saver.stall_seconds
        self._mark = time.perf_counter()

    def _close_step(self, block: Block, now: float) -> None:
        usage = _usage()
        block.steps_s.append(now - self._mark)
        block.steps_cpu_s.append(usage[0] - self._step_usage[0])
        block.steps_faults.append(usage[1] - self._step_usage[1])
        block.steps_main_cpu_s.append(time.thread_time() - self._main_cpu)
        self._mark, self._step_usage, self._main_cpu = now, usage, time.thread_time()

    @override
    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if not self.blocks:
            self._open_block()

    @override
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        pos = self._done % self.every
        self._done += 1
        block = self.blocks[-1]
        measured = len(self.blocks) > len(WARMUP)
        if pos == self.clean and block.arm != "none":  # after the block's clean steps
            t0 = time.perf_counter()
            self.saver.save(trainer, asynchronous=block.arm == "async")
            self._call = time.perf_counter() - t0
            if block.arm == "sync" and measured:
                self.sync_s.append(self._call)
        if pos < self.every - 1:
            self._close_step(block, time.perf_counter())
            return
        t0 = time.perf_counter()
        self.saver._finalize(trainer, blocking=True)  # the wait the next save would have
        end = time.perf_counter()
        self._close_step(block, end)
        cpu, faults, kids = (b - a for a, b in zip(self._usage_at_start, _usage(), strict=True))
        block.cpu_s, block.minor_faults, block.children_cpu_s = cpu, int(faults), kids
        if block.arm == "async" and measured:
            self.async_call_s.append(self._call + self.saver.stall_seconds - self._stall_at_start + end - t0)
            snapshot = getattr(self.saver._queue, "snapshot", None)  # the CPU writer's (checkpoint/writer.py)
            if snapshot is not None:
                self.writer.append((snapshot.write_s, snapshot.copied_bytes, snapshot.settle_s))
        if trainer.is_global_zero:
            for old in ckpt.complete_checkpoints(self.saver.dirpath)[1:]:
                ckpt.remove(old)
        if len(self.blocks) < len(self.plan):
            self._open_block()  # after the deletion: it is outside the timed span


def _options(argv: list[str]) -> tuple[dict, list[str]]:
    """Pop this bench's options from ``argv``; the rest are yatt CLI overrides."""
    opts = {"size": "medium", "every": 6, "clean": 2, "repeats": 10, "smoke": False, "dump": None}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--smoke":
            opts["smoke"] = True
        elif arg in ("--size", "--every", "--clean", "--repeats", "--dump"):
            value = next(it)
            opts[arg[2:]] = value if arg in ("--size", "--dump") else int(value)
        else:
            rest.append(arg)
    if opts["smoke"]:  # 8 pairs: a median that one slow step (beside another test) cannot move
        opts.update(size="tiny", every=3, clean=1, repeats=4)
    if not 0 < opts["clean"] < opts["every"] - 1:
        raise SystemExit("--clean must leave the save and one step after it in the block: 0 < clean < every - 1")
    if opts["size"] not in ("medium", "small", "tiny"):
        raise SystemExit(f"--size must be medium or small, got {opts['size']!r}")
    return opts, rest


def main() -> None:
    from yatt_lightning.models.tiny import SMALL_QWEN2, TINY_QWEN2_SHAPE, build_tiny_qwen2

    opts, overrides = _options(sys.argv[1:])
    every, repeats = opts["every"], opts["repeats"]
    plan = WARMUP + PATTERN * repeats + TAIL
    if opts["size"] == "tiny":
        model = "builtin:tiny-qwen2"
    elif opts["size"] == "small":
        model = SMALL_QWEN2
    else:
        model = str(build_tiny_qwen2(shape={**TINY_QWEN2_SHAPE, **MEDIUM}))
    with tempfile.TemporaryDirectory() as tmp:
        cli = build_cli(
            ["--model.policy.path", model, "--trainer.max_steps", str(len(plan) * every), "--data.batch_size", "8",
             "--model.sampling.n", "4", *overrides]
        )  # fmt: skip
        saver = AsyncCheckpoint(dirpath=tmp, every_n_steps=None, keep_last=1000, save_at_end=False)
        blocks = Blocks(saver, every, plan, opts["clean"])
        cli.trainer.callbacks.extend([saver, blocks])
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        if not cli.trainer.is_global_zero:
            return
        newest = ckpt.complete_checkpoints(Path(tmp))[0]
        size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    if opts["dump"]:  # every step's time, to compare estimators on the same run
        Path(opts["dump"]).write_text(json.dumps({
            "every": every, "clean": opts["clean"], "size": size, "sync_s": blocks.sync_s,
            "blocks": [{"arm": b.arm, "steps_s": b.steps_s, "main_cpu_s": b.steps_main_cpu_s, "cpu_s": b.steps_cpu_s}
                       for b in blocks.blocks]}))  # fmt: skip
    report(blocks, every, size, opts["clean"])


def within(block: Block, clean: int) -> float:
    """The block's steps from the save on, less what its clean steps (before the save) predict for them:
    the block is its own baseline, so the machine's drift from block to block cancels."""
    steps = block.steps_s
    return sum(steps[clean:]) - (len(steps) - clean) / clean * sum(steps[:clean])


def step_windows(blocks: list[Block], clean: int) -> list[list[float]]:
    """Each block's window as a list of steps: its steps from the save's position on, then the next
    block's clean steps (the last block, the tail, has none after it: its window is short)."""
    return [
        block.steps_s[clean:] + (blocks[i + 1].steps_s[:clean] if i + 1 < len(blocks) else [])
        for i, block in enumerate(blocks)
    ]


def positional_extra(async_windows: list[list[float]], none_windows: list[list[float]]) -> float:
    """Sum over the window's positions of (median async step - median none step): each step's median over
    the arm's blocks, so one slow step (the machine's, not the save's) moves a median by little."""
    return sum(
        statistics.median(w[p] for w in async_windows) - statistics.median(w[p] for w in none_windows)
        for p in range(len(async_windows[0]))
    )


def bootstrap(values_of, repeats: int, samples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of ``values_of(chosen repeats)`` over the pattern's repeats drawn with replacement."""
    rng = random.Random(seed)
    got = sorted(values_of([rng.randrange(repeats) for _ in range(repeats)]) for _ in range(samples))
    return got[int(0.025 * samples)], got[int(0.975 * samples) - 1]


def report(blocks: Blocks, every: int, size: int, clean: int) -> None:
    timed = blocks.blocks[len(WARMUP) :]
    steps_of = dict(zip(map(id, timed), step_windows(timed, clean), strict=True))
    window = {key: sum(steps) for key, steps in steps_of.items()}
    measured = timed[: len(timed) - len(TAIL)]
    per = len(PATTERN)
    pairs = []  # (async block, none block) side by side: positions 0-1 and 3-2 of each pattern
    sync_extra = []
    sync_blocks = []  # (sync block, its two none blocks)
    for r in range(0, len(measured), per):
        a1, n1, n2, a2, s = measured[r : r + per]
        pairs += [(a1, n1), (a2, n2)]
        sync_blocks.append((s, n1, n2))
        sync_extra.append(window[id(s)] - (window[id(n1)] + window[id(n2)]) / 2)
    extras = [window[id(a)] - window[id(n)] for a, n in pairs]
    extra = statistics.median(extras)
    whole = statistics.median([a.wall_s - n.wall_s for a, n in pairs])
    within_extras = [within(a, clean) - within(n, clean) for a, n in pairs]
    within_extra = statistics.median(within_extras)
    sync = statistics.median(blocks.sync_s)

    def ms(values) -> str:
        return ", ".join(f"{x * 1000:.0f}" for x in values)

    print(f"checkpoint size: {size / 2**20:.0f} MiB; blocks of {every} steps; {len(pairs)} async/none pairs")
    print("blocks (s): " + " ".join(f"{b.arm[0]}{b.wall_s:.2f}" for b in measured))
    print("medians per step of the block: wall ms / the trainer's CPU ms (its main thread's + its other threads', the writer's among them) / its "
          "minor faults (thousands)")  # fmt: skip
    for arm in ("none", "async", "sync"):
        these = [b for b in measured if b.arm == arm]
        steps = [
            f"{statistics.median(b.steps_s[i] for b in these) * 1000:.0f}/"
            f"{statistics.median(b.steps_cpu_s[i] for b in these) * 1000:.0f}"
            f"({statistics.median(b.steps_main_cpu_s[i] for b in these) * 1000:.0f}+"
            f"{statistics.median(b.steps_cpu_s[i] - b.steps_main_cpu_s[i] for b in these) * 1000:.0f})/"
            f"{statistics.median(b.steps_faults[i] for b in these) / 1000:.0f}k"
            for i in range(every)
        ]
        cpu, kids = statistics.median(b.cpu_s for b in these), statistics.median(b.children_cpu_s for b in these)
        print(
            f"{arm:>5}: {'  '.join(steps)}; per block: trainer CPU {cpu:.2f} s, writer processes' CPU {kids:.2f} s "
            "(forked ones only)"
        )
    mean = statistics.mean(extras)
    print(f"async - none, per pair, windows from the save on (ms): {ms(extras)}; median {extra * 1000:.0f}, "
          f"mean {mean * 1000:.0f}")  # fmt: skip
    print(f"async - none, per pair, whole blocks: median {whole * 1000:.0f} ms (whole_ratio={whole / sync:.3f})")
    print(f"async - none, per pair, each block against its {clean} clean steps (ms): {ms(within_extras)}; median "
          f"{within_extra * 1000:.0f}, mean {statistics.mean(within_extras) * 1000:.0f} (within_ratio={within_extra / sync:.3f})")  # fmt: skip
    print(f"sync save (ms): {ms(blocks.sync_s)}; median {sync * 1000:.0f}; sync block - its none blocks (ms): "
          f"{ms(sync_extra)} (windows)")  # fmt: skip
    print(f"async: time inside the save call and the finalisations per save (the old measure; ms): "
          f"{ms(blocks.async_call_s)}")  # fmt: skip
    if blocks.writer:
        print("CPU writer per save: span s / MiB the next optimizer step copied / its ms in settle: " + ", ".join(
            f"{w:.2f}/{c / 2**20:.0f}/{st * 1000:.0f}" for w, c, st in blocks.writer))  # fmt: skip
    print(f"totals: (sum async - sum none) / (sync x saves) = {sum(extras) / (sync * len(extras)):.3f}")
    # CPU, not wall time: what of a save's work the training thread does. Beside other work (a test suite's
    # other worker) a starved writer stretches the wall figures, not this one; a save written inline would be ~1.
    def work(b: Block) -> float:
        return b.cpu_s + b.children_cpu_s

    main_extra = statistics.median(sum(a.steps_main_cpu_s) - sum(n.steps_main_cpu_s) for a, n in pairs)
    save_work = statistics.median(work(s) - (work(n1) + work(n2)) / 2 for s, n1, n2 in sync_blocks)
    print(f"async: the training thread's extra CPU per save {main_extra * 1000:.0f} ms; a synchronous save's whole "
          f"CPU (every thread and writer process) {save_work * 1000:.0f} ms")  # fmt: skip
    print(f"main_thread_share={main_extra / save_work:.3f}")
    # An asynchronous save's call returns before its write: if it wrote in the call, this would be ~1.
    print(f"async_call_over_sync={statistics.median(blocks.async_call_s) / sync:.3f}")
    repeats = len(measured) // per

    def ratios(chosen: list[int]) -> dict[str, float]:
        """The two estimators over the chosen repeats of the pattern (a repeat may be chosen twice)."""
        blocks_ = [b for r in chosen for b in measured[r * per : (r + 1) * per]]
        chosen_pairs = [pair for r in chosen for pair in pairs[2 * r : 2 * r + 2]]
        chosen_sync = statistics.median(blocks.sync_s[r] for r in chosen)
        arm = {name: [steps_of[id(b)] for b in blocks_ if b.arm == name] for name in ("async", "none")}
        return {
            "windows": statistics.median(window[id(a)] - window[id(n)] for a, n in chosen_pairs) / chosen_sync,
            "positions": positional_extra(arm["async"], arm["none"]) / chosen_sync,
        }

    positions = ratios(list(range(repeats)))["positions"]
    for name in ("windows", "positions"):
        low, high = bootstrap(lambda chosen, n=name: ratios(chosen)[n], repeats)
        print(f"{name}: 95% interval over the repeats {low:.3f} .. {high:.3f}")
    print(f"positions_ratio={positions:.3f}")
    print(f"stall_ratio={extra / sync:.3f}", flush=True)


if __name__ == "__main__":
    main()
