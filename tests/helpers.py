"""Helpers for tests that run real processes (the CLI, multi-process gloo jobs) under a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def run(cmd: list[str], *, cwd: Path | None = None, timeout: float = 600, env: dict | None = None, check: bool = True):
    """Run ``cmd``; on failure (or timeout) show its output in the assertion message."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"")[-4000:] if isinstance(err.stdout, bytes) else (err.stdout or "")[-4000:]
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out}") from None
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def yatt(args: list[str], *, cwd: Path, timeout: float = 600, check: bool = True, env: dict | None = None):
    return run([sys.executable, "-m", "yatt_lightning.run.cli", *args], cwd=cwd, timeout=timeout, check=check, env=env)


def run_script(name: str, *args: str, timeout: float = 600, cwd: Path | None = None) -> dict:
    """Run ``tests/scripts/<name>``; it prints one JSON object as its last line, returned here."""
    proc = run([sys.executable, str(SCRIPTS / name), *args], timeout=timeout, cwd=cwd)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(log_dir.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {log_dir}"
    acc = EventAccumulator(str(files[-1]), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_texts(log_dir: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(log_dir.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(files[-1]), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)] for tag in acc.Tags().get("tensors", [])
    }


def yatt_in_process(args: list[str], *, cwd: Path) -> tuple[int, str]:
    """``yatt ARGS`` through the CLI's entry point in this process (for what ends before any process group
    or engine starts: a configuration error, ``--print_config``); returns (exit code, stdout + stderr).
    Seconds instead of a fresh interpreter's import of torch, Lightning and Megatron per case."""
    import contextlib
    import io

    from yatt_lightning.run.cli import main

    out = io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            main(list(args))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(before)
    return code, out.getvalue()


def spawn_gloo(target, world: int = 2, timeout: float = 120) -> dict:
    """Run ``target(rank, port, queue)`` in ``world`` spawned processes (each joins a gloo group on
    ``port`` and puts ``(rank, result)`` on ``queue``); returns {rank: result}, under a timeout."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    import queue as queues
    import time

    deadline = time.monotonic() + timeout
    results = {}
    try:
        while len(results) < world:  # a process that dies fails the call at once, not after the timeout
            try:
                rank, out = queue.get(timeout=1)
                results[rank] = out
            except queues.Empty:
                failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
                assert not failed and time.monotonic() < deadline, (
                    f"exit codes {[proc.exitcode for proc in procs]} after {timeout}s at most"
                )
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert all(proc.exitcode == 0 for proc in procs)
    return results


def growth(scalars: dict, rank: int = 0, warm: int = 10) -> dict[str, float]:
    """What a run accumulated, from its TensorBoard figures ``process/*/rank<r>``: threads and open files from
    step ``warm`` to the end (counts), and resident memory in GB per 100 steps, measured on its floor: the least
    RSS of the run's last quarter less the least of its third quarter. The floor, not a fitted slope: RSS saws
    (an agent run's rises ~80 MB and falls back every 48 steps), and a least-squares line through a saw reads
    0.03 or 0.06 by where the teeth fall (0.062 in a clean clone's CI run of 2026-12-07, 0.040 in a quiet run
    beside it whose floor rose 0.033); a leak lifts the floor. Memory warms up over the first half: in an agent
    run it rises ~0.35 GB over the first ~90 steps (native caches keyed by shape, as the episodes' lengths vary:
    Python's heap grows 0.4 MB there, by tracemalloc); a leak of a sample's tensors or an engine request per
    step keeps rising."""
    threads = [v for _, v in scalars[f"process/threads/rank{rank}"]]
    fds = [v for _, v in scalars[f"process/open_fds/rank{rank}"]]
    rss = [v for _, v in scalars[f"process/rss_gb/rank{rank}"]]
    quarter = len(rss) // 4
    floor_rise = min(rss[3 * quarter :]) - min(rss[2 * quarter : 3 * quarter])
    return {"threads": threads[-1] - threads[warm - 1], "fds": fds[-1] - fds[warm - 1],
            "rss_gb_per_100": floor_rise * 100 / quarter, "threads_max": max(threads)}  # fmt: skip


def colour_task_in_verls_layout(out: Path, num_rows: int = 64, seed: int = 0) -> Path:
    """The built-in colour task as a user's image data in verl's layout (geometry3k's columns), a Parquet file
    written by ``datasets``: ``prompt`` as chat messages with an ``<image>`` mark, ``images`` in ``datasets``'
    ``Image`` feature (the PNG bytes inside the file), ``reward_model.ground_truth``, ``data_source``."""
    import io

    import datasets
    from yatt_lightning.datamodules.tasks import ColourTask

    columns: dict[str, list] = {"data_source": [], "prompt": [], "images": [], "reward_model": []}
    for name, image in ColourTask(num_rows=num_rows, seed=seed).images():
        png = io.BytesIO()
        image.save(png, format="PNG")
        columns["data_source"].append("colours")
        columns["prompt"].append([{"role": "user", "content": "<image>\ncolour:"}])
        columns["images"].append([{"bytes": png.getvalue(), "path": None}])
        columns["reward_model"].append({"ground_truth": name, "style": "rule"})
    text = datasets.Value("string")
    features = datasets.Features({
        "data_source": text, "prompt": datasets.List({"role": text, "content": text}),
        "images": datasets.List(datasets.Image()), "reward_model": {"ground_truth": text, "style": text},
    })  # fmt: skip
    datasets.Dataset.from_dict(columns, features=features).to_parquet(str(out))
    return out
