"""Ctrl-C at random moments: does every run stop, save its newest complete step, and resume exactly?

A chain of real `yatt fit` runs of the tiny config (``tests/scripts/faults.py``: the ordinary CLI and
module plus a recorder of the final policy), checkpointing asynchronously every step, all with the same
``--trainer.max_steps M``. Each run but the last gets SIGINT sent to its whole process group, as a
terminal sends Ctrl-C to its foreground job (the run starts with SIGINT at its default disposition,
as a terminal's foreground job has it). Half the moments come right after a "checkpoint saved" line,
when the next save is being scheduled (its snapshot taken, its writer started); half are uniform over ``--window`` seconds of training, so
they land in rollouts, updates and background writes in proportion to their length. The next run
resumes with ``--ckpt_path last``; the last runs to M and its weights are compared, bit for bit, with an
uninterrupted run of the same M.

A run counts as stopped well when it exits with code 130 within ``--grace`` seconds of the signal,
before M, having logged "interrupted: received SIGINT; saved step N", with ``latest`` naming step N
(the newest it reported saved), intact, and the next run resuming from exactly N.

    python bench/interrupts.py [--interrupts 20] [--window 5] [--seed 0] [--smoke]

``--smoke``: 2 interrupts (one after a save, one uniform within 2 s), M=20. Last line:
``interrupts=<k> stopped=<n> continued_to_max_steps=<n> latest_is_newest=<n> resumed_exactly=<n>
bitwise_equal_final=<0|1>``; target: all equal to k, 0, and 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULTS = REPO / "tests" / "scripts" / "faults.py"
SAVED = re.compile(r"checkpoint saved: step (\d+)")
RESUMED = re.compile(r"resuming from \S*step-(\d+)")
STOPPED = re.compile(r"interrupted: received SIGINT; saved step (\d+)")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(out: Path, args: list[str], moment: str | None, rng: random.Random, window: float, grace: float):
    """One run; with ``moment`` ('after-save' or 'uniform') Ctrl-C its process group once it trained a step
    past its start. Returns (log, exit code, seconds from the signal to the exit or None)."""
    cmd = [sys.executable, str(FAULTS), str(out), *args]
    proc = subprocess.Popen(cmd, cwd=out.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_default_sigint)  # fmt: skip
    lines: list[str] = []
    first_save = threading.Event()
    saves = threading.Semaphore(0)
    start = {"step": None}

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = RESUMED.search(line)
            if m:
                start["step"] = int(m.group(1))
            m = SAVED.search(line)
            if m and int(m.group(1)) > (start["step"] or 0):
                first_save.set()
                saves.release()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = None
    if moment is not None:
        if not first_save.wait(timeout=300):
            proc.kill()
            sys.exit("a run never saved a step:\n" + "".join(lines[-40:]))
        if moment == "after-save":
            for _ in range(rng.randint(0, 3)):  # a few saves in, then at once (the next writer's fork)
                saves.acquire(timeout=60)
            time.sleep(rng.uniform(0, 0.02))
        else:
            time.sleep(rng.uniform(0, window))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            sent = time.monotonic()
    try:
        proc.wait(timeout=grace if sent else 1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
    took = time.monotonic() - sent if sent else None
    return "".join(lines), proc.returncode, took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interrupts", type=int, default=20)
    p.add_argument("--window", type=float, default=5.0, help="uniform moments within this many seconds")
    p.add_argument("--grace", type=float, default=120.0, help="seconds a run may take to stop after Ctrl-C")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.interrupts, args.window = 2, 2.0
    max_steps = 20 if args.smoke else 8 * args.interrupts + 20  # room for every run to be interrupted
    rng = random.Random(args.seed)
    sys.path.insert(0, str(REPO))
    from safetensors.torch import load_file

    from yatt_lightning.checkpoint import folder as ckpt

    stopped = continued = latest_ok = resumed_ok = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def saver(folder: Path) -> str:
            return json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
                                "init_args": {"every_n_steps": 1, "dirpath": str(folder), "keep_last": 3}}])  # fmt: skip

        common = ["--trainer.max_steps", str(max_steps)]
        reference = tmp / "reference"
        ref_log, ref_code, _ = run(reference, [*common, "--trainer.callbacks", saver(reference / "ckpts")], None,
                                   rng, args.window, args.grace)  # fmt: skip
        if ref_code != 0:
            sys.exit("the uninterrupted run failed:\n" + ref_log[-3000:])
        chain = tmp / "chain"
        moments = ["after-save", "uniform"] * ((args.interrupts + 1) // 2)
        expected_start = 0
        for i in range(args.interrupts + 1):
            last = i == args.interrupts
            moment = None if last else moments[i]
            log, code, took = run(chain, [*common, "--trainer.callbacks", saver(chain / "ckpts"), "--ckpt_path", "last"],
                                  moment, rng, args.window, args.grace)  # fmt: skip
            m = RESUMED.search(log)
            resumed_from = int(m.group(1)) if m else 0
            if i > 0:
                resumed_ok += resumed_from == expected_start
            if last:
                if code != 0:
                    sys.exit("the last run failed:\n" + log[-3000:])
                break
            saved = [int(s) for s in SAVED.findall(log)]
            stop = STOPPED.search(log)
            tracked = ckpt.tracked(chain / "ckpts")
            ok_stop = code == 128 + signal.SIGINT and stop is not None and took is not None and took < args.grace
            stopped += ok_stop
            continued += max(saved, default=0) >= max_steps
            newest = max(saved, default=None)
            ok_latest = (tracked is not None and newest is not None and tracked.name == ckpt.checkpoint_name(newest)
                         and stop is not None and int(stop.group(1)) == newest and ckpt.verify(tracked) == [])  # fmt: skip
            latest_ok += ok_latest
            expected_start = newest if newest is not None else expected_start
            print(f"run {i:2d} ({moment}): resumed from {resumed_from}, Ctrl-C after {len(saved)} saves, exit {code} "
                  f"{took:.1f}s after the signal; saved up to {newest}, latest {tracked.name if tracked else None}",
                  flush=True)  # fmt: skip
            if not ok_stop or not ok_latest:
                print(log[-2500:], flush=True)
        a, b = load_file(str(reference / "final.safetensors")), load_file(str(chain / "final.safetensors"))
        import torch

        equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    k = args.interrupts
    print(f"interrupts={k} stopped={stopped} continued_to_max_steps={continued} latest_is_newest={latest_ok} "
          f"resumed_exactly={resumed_ok} bitwise_equal_final={int(equal)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
