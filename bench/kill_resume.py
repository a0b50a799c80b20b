"""Kill training runs at random moments and in the checkpoint's finalisation, resume, repeat: is a reported
checkpoint ever lost or broken, and does the chain end on the weights of a run that was never interrupted?

A chain is a sequence of real `yatt fit` runs of the tiny config (``tests/scripts/faults.py``: the
ordinary module and CLI, plus a recorder of each step's prompts and the final policy under Hugging Face
names) that save asynchronously every step, all with the same ``--trainer.max_steps M``. Every run but
the last is SIGKILLed (whole process group: ranks, checkpoint writers, their results queue); the next one
resumes with ``--ckpt_path last``; the last resume runs to step M. Half of the kills of a chain are
*uniform*: at a moment uniform over ``--window`` seconds after the run's first own "checkpoint saved"
(so every phase of a step is hit in proportion to its duration: rollout, update, writers in flight,
finalisation). The other half land in the *finalisation window* of a checkpoint: from the moment rank
0 starts writing ``manifest.json`` (the ranks' shares gathered) through its fsync, the fsyncs of the
folders, the rename of ``<step>.tmp`` and the replacement of the ``latest`` tracker, to the end of
``checkpoint.finalize``, before the save is reported. The run is told a step T (4-6 steps after its
resume point) and a fraction f; an interval timer in the run SIGKILLs the group f x W after the manifest
of step T began, W being the median window of that run's earlier saves but its first two
(``--kill window:T:f`` of faults.py, which prints every window's length). The window lasts 1-50 ms
depending on the machine's load: about the time a bench outside the process needs to read a marker line
from a pipe and send a signal on a loaded 2-core machine, so a kill from outside would mostly land after
the window, and a length measured in other runs or minutes earlier misjudges it; the timer in the run,
scaled by the run's own recent windows, lands inside. The fractions are stratified over [0, 1) across the
chain's window kills; where each kill landed is read from the files it left (manifest being written or
written, not renamed / renamed, tracker not moved / tracker being replaced / tracker moved, save not yet
reported). Kills before the manifest (writers running, or the ranks' shares being gathered) leave a
``.tmp`` folder without a manifest, as the uniform kills of a save in flight do.

Two chains: DP=1, and DP=2 (``--trainer.devices 2 --data.batch_size 8``; a checkpoint resumes only in the
layout that wrote it). Each chain's uninterrupted reference (same config, same M, its own folder) runs
alongside the chain's first runs.

- resumed: kills after which the next run loaded a checkpoint, trained, and reported a save of a step
  after the one it resumed from.
- lost_saved_steps: checkpoints a run reported saved ("checkpoint saved: step N") newer than the one the
  next run resumed from.
- corrupt_loaded: resumes where the checkpoint ``latest`` named failed verification, was skipped, was not
  the one loaded, or failed to load.
- bitwise_equal_final: every chain's final weights equal its reference's, bit for bit.

Only yatt's own log lines ("checkpoint saved: step N", "resuming from ..."), faults.py's lines, exit codes
and files are read.

    python bench/kill_resume.py [--kills 20] [--dp2-kills 6] [--window 6] [--seed 0] [--smoke]

``--smoke``: 2 kills (one uniform, one in the window), DP=1, M=10. Last line:
``kills=<k> resumed=<n> lost_saved_steps=<n> corrupt_loaded=<n> bitwise_equal_final=<0|1>``; target:
resumed=kills, 0, 0, 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULTS = REPO / "tests" / "scripts" / "faults.py"
SAVED = re.compile(r"checkpoint saved: step (\d+)")
RESUMED = re.compile(r"resuming from \S*step-(\d+)")
WINDOW = re.compile(r"finalize of step \d+ took [\d.]+ ms, ([\d.]+) ms of them from the manifest on")
RUN_TIMEOUT = 600.0


class Run:
    """One faults.py process in its own session, its output read line by line as it comes."""

    def __init__(self, out: Path, args: list[str], max_steps: int, kill: str | None = None) -> None:
        cmd = [sys.executable, str(FAULTS), str(out), *(["--kill", kill] if kill else []), *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self.resumed_from: int | None = None
        self.saved: list[int] = []
        self.first_save_at: float | None = None  # when the first save of a step after the resume point was reported
        self.first_saved = threading.Event()
        self.stop_now = threading.Event()  # near max_steps, or the output ended
        self._near_end = max_steps - 3
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := RESUMED.search(line):
                self.resumed_from = int(m.group(1))
            elif m := SAVED.search(line):
                step = int(m.group(1))
                self.saved.append(step)
                if step > (self.resumed_from or 0) and not self.first_saved.is_set():
                    self.first_save_at = time.monotonic()
                    self.first_saved.set()
                if step >= self._near_end:
                    self.stop_now.set()
        self.first_saved.set()
        self.stop_now.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def windows_ms(self, skip: int = 2) -> list[float]:
        """This run's finalisation windows so far (ms), but its first ``skip`` (cold: up to 5x longer)."""
        return [float(m.group(1)) for line in list(self.lines) if (m := WINDOW.search(line))][skip:]

    def kill_after_first_save(self, delay: float) -> str:
        """SIGKILL the session ``delay`` s after the first save of this run (earlier if near the end)."""
        self.first_saved.wait(timeout=RUN_TIMEOUT)
        early = self.stop_now.wait(timeout=delay)
        alive = self.proc.poll() is None
        if alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return " (early: near max_steps)" if early and alive else ""

    def wait(self) -> int:
        try:
            rc = self.proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
            self.lines.append(f"\n[bench] killed after {RUN_TIMEOUT:.0f} s: no progress\n")
        self._reader.join(timeout=10)
        _wait_group_gone(self.proc.pid)
        return rc


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    """Wait until no live (non-zombie) process of the session remains: a killed writer may still be in a write."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)


@dataclass
class Tally:
    kills: int = 0
    resumed: int = 0
    lost: int = 0
    corrupt: int = 0
    equal: bool = True
    landings: list[str] = field(default_factory=list)


def landing(ckpts: Path, step: int) -> str:
    """Where in the finalisation of ``step`` a kill landed, from the files it left."""
    from yatt_lightning.checkpoint import folder as ckpt

    name = ckpt.checkpoint_name(step)
    tracked = ckpt.tracked(ckpts)
    if tracked is not None and tracked.name == name:
        return "tracker moved, save not yet reported"
    if (ckpts / (ckpt.TRACKER + ".partial")).exists():
        return "tracker being replaced"
    if (ckpts / name / ckpt.MANIFEST).is_file():
        return "renamed, tracker not moved"
    if (ckpts / (name + ".tmp") / ckpt.MANIFEST).is_file():
        return "manifest being written or written, not renamed"
    if (ckpts / (name + ".tmp")).is_dir():
        return "before the manifest (no manifest)"
    return "no trace of the save"


def run_chain(tmp: Path, devices: int, kinds: list[str], max_steps: int, window: float, rng: random.Random,
              tally: Tally) -> None:  # fmt: skip
    """Kill a chain of runs as ``kinds`` says ("uniform" / "window"), resume it to ``max_steps``, compare."""
    tag = f"dp{devices}"
    chain, reference = tmp / f"{tag}-chain", tmp / f"{tag}-reference"
    common = ["--trainer.max_steps", str(max_steps), "--trainer.devices", str(devices),
              "--data.batch_size", str(16 // devices)]  # fmt: skip
    ref = Run(reference, [*common, "--trainer.callbacks", _saver(reference / "ckpts")], max_steps)
    saver = ["--trainer.callbacks", _saver(chain / "ckpts")]
    n_window = kinds.count("window")
    fractions = [(k + rng.random()) / n_window for k in rng.sample(range(n_window), n_window)]
    windows: list[float] = []  # finalisation durations (ms) reported by this layout's runs so far
    reported: list[int] = []  # steps reported saved so far
    for i in range(len(kinds) + 1):
        kind = kinds[i] if i < len(kinds) else "last"
        start, bad = _tracked(chain / "ckpts")
        resume = ["--ckpt_path", "last"] if i else []
        t0 = time.monotonic()
        if kind == "uniform":
            run = Run(chain, [*common, *saver, *resume], max_steps)
            delay = rng.uniform(0.0, window)
            how = f"killed {delay:.2f} s after its first save" + run.kill_after_first_save(delay)
        elif kind == "window":
            target = min(start + rng.randint(4, 6), max_steps - 3)
            run = Run(chain, [*common, *saver, *resume], max_steps, kill=f"window:{target}:{fractions.pop():.3f}")
            how = "killed"
        else:
            run = Run(chain, [*common, *saver, *resume], max_steps)
            how = "ran to the end"
        rc = run.wait()
        windows += run.windows_ms()
        killed = rc in (-signal.SIGKILL, 128 + signal.SIGKILL)
        if kind == "window" and killed:
            where = landing(chain / "ckpts", target)
            fault = re.search(r"FAULT: SIGKILL (.*)", run.log)
            if "at the end of the finalisation" in run.log:
                where += " (the delay outlasted this finalisation: killed at its end)"
            tally.landings.append(where)
            how = f"killed {fault.group(1) if fault else '?'}: {where}"
        if i > 0:  # this run resumes the previous, killed one
            got = run.resumed_from
            crashed = not killed and rc != 0
            skipped = "is not usable" in run.log  # resolve() fell back to an older checkpoint
            tally.lost += sum(1 for s in reported if s > (got or 0))
            tally.corrupt += bool(bad) or skipped or (got is not None and got != start) or "CheckpointError" in run.log
            tally.resumed += got is not None and not crashed and any(s > got for s in run.saved)
            print(f"{tag} run {i:2d}: resumed from step {got} (latest named {start}, newest reported saved "
                  f"{max(reported, default=None)}), saved up to {max(run.saved, default=None)}; {how}; "
                  f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
            if crashed:
                print(f"{tag} run {i}: exit {rc}\n{run.log[-3000:]}", flush=True)
        else:
            print(f"{tag} run  0: fresh start, saved up to {max(run.saved, default=None)}; {how}; "
                  f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
        reported += run.saved
        if kind != "last":
            tally.kills += 1
            if not killed:
                sys.exit(f"{tag} run {i} ended (exit {rc}) before it was killed:\n{run.log[-3000:]}")
    ref_rc = ref.wait()
    if ref_rc != 0:
        sys.exit(f"{tag} reference run failed (exit {ref_rc}):\n{ref.log[-3000:]}")
    equal, records = _compare(reference, chain, devices)
    tally.equal &= equal and rc == 0
    w = sorted(windows + ref.windows_ms())
    print(f"{tag}: final weights {'bitwise equal to' if equal else 'DIFFERENT from'} the uninterrupted run at step "
          f"{max_steps}; per-step prompts, rewards and losses {'equal' if records else 'DIFFERENT'}; finalisation "
          f"window (ms, {len(w)} warm saves): median {statistics.median(w):.2f}, min {w[0]:.2f}, "
          f"max {w[-1]:.2f}", flush=True)  # fmt: skip


def _tracked(ckpts: Path) -> tuple[int, list[str]]:
    """The step the ``latest`` tracker names (0: none) and the problems verification finds in it."""
    if not (ckpts / "latest").is_file():
        return 0, []
    from yatt_lightning.checkpoint import folder as ckpt  # (imports torch: not before the first runs started)

    tracked = ckpt.tracked(ckpts)
    return int(tracked.name.split("-")[1]), ckpt.verify(tracked)


def _saver(dirpath: Path) -> str:
    init = {"every_n_steps": 1, "dirpath": str(dirpath), "keep_last": 3}
    return json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint", "init_args": init}])


def _compare(a: Path, b: Path, devices: int) -> tuple[bool, bool]:
    """(final weights bitwise equal, per-step records equal on every rank)."""
    import torch
    from safetensors.torch import load_file

    if not (a / "final.safetensors").is_file() or not (b / "final.safetensors").is_file():
        return False, False
    wa, wb = load_file(str(a / "final.safetensors")), load_file(str(b / "final.safetensors"))
    weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    def records(out: Path, rank: int) -> dict:
        rows = [json.loads(line) for line in (out / f"record_rank{rank}.jsonl").read_text().splitlines()]
        return {row["step"]: row for row in rows}  # a resumed run's rows replace the killed run's

    return weights, all(records(a, r) == records(b, r) for r in range(devices))


def _kinds(n: int, rng: random.Random) -> list[str]:
    """Half uniform, half in the window, shuffled; the first is uniform (its runs measure the window)."""
    kinds = ["uniform"] * (n - n // 2) + ["window"] * (n // 2)
    rest = kinds[1:]
    rng.shuffle(rest)
    return kinds[:1] + rest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20, help="kills in all, both chains")
    p.add_argument("--dp2-kills", type=int, default=6, help="how many of them in the DP=2 chain")
    p.add_argument("--window", type=float, default=6.0, help="uniform kills: seconds after the first save")
    p.add_argument("--max-steps", type=int, default=120, help="M of the DP=1 chain (the DP=2 chain: M/2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="2 kills (uniform, window), DP=1, M=10")
    args = p.parse_args()
    if args.smoke:
        args.kills, args.dp2_kills, args.window, args.max_steps = 2, 0, 1.5, 10
    rng = random.Random(args.seed)
    sys.path.insert(0, str(REPO))
    tally = Tally()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        chains = [(1, args.kills - args.dp2_kills, args.max_steps), (2, args.dp2_kills, args.max_steps // 2)]
        for devices, n, max_steps in chains:
            if n:
                kinds = ["uniform", "window"] if args.smoke else _kinds(n, rng)
                run_chain(Path(tmp), devices, kinds, max_steps, args.window, rng, tally)
    counts = {w: tally.landings.count(w) for w in dict.fromkeys(tally.landings)}
    print(f"finalisation-window kills landed: {counts}; {time.monotonic() - t0:.0f} s in all", flush=True)
    print(f"kills={tally.kills} resumed={tally.resumed} lost_saved_steps={tally.lost} "
          f"corrupt_loaded={tally.corrupt} bitwise_equal_final={int(tally.equal)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
