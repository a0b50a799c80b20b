"""Tier 3: nothing grows with the steps. Long runs through the real CLI, read back from their TensorBoard
files: each step logs the process's OS threads, open file descriptors and resident memory
(``process/*/rank<r>``, measured at the step's end).

An agent run with tools (``configs/agent_lookup_tiny.yaml``, its 200 steps, a tool call per turn: before
the fix every call left a thread behind, 26,342 by step 140, and the run hung) learns while its threads,
files, memory and rollout time stay flat after warm-up. A long single-turn run holds the same.
"""

from __future__ import annotations

import statistics

import pytest

from tests.helpers import REPO, read_scalars, yatt

pytestmark = pytest.mark.slow

WARM = 10  # steps after which engines, writers and caches exist


def _series(scalars: dict, tag: str) -> list[float]:
    return [v for _, v in scalars[tag]]


def _flat(scalars: dict, rank: int = 0) -> dict[str, float]:
    """Growth from step WARM to the end: threads, open files (counts), resident memory (GB per 100 steps,
    the least-squares slope after warm-up, so one late allocation does not read as a trend)."""
    threads = _series(scalars, f"process/threads/rank{rank}")
    fds = _series(scalars, f"process/open_fds/rank{rank}")
    rss = _series(scalars, f"process/rss_gb/rank{rank}")[WARM:]
    xs = list(range(len(rss)))
    slope = statistics.linear_regression(xs, rss).slope * 100
    return {"threads": threads[-1] - threads[WARM - 1], "fds": fds[-1] - fds[WARM - 1], "rss_gb_per_100": slope,
            "threads_max": max(threads)}  # fmt: skip


def test_an_agent_run_with_tools_learns_and_nothing_grows(tmp_path):
    yatt(["fit", "--config", str(REPO / "configs" / "agent_lookup_tiny.yaml"),  # its checkpoints every 30 steps
          f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}"], cwd=tmp_path, timeout=900)  # fmt: skip
    scalars = read_scalars(tmp_path / "tb")
    rewards = _series(scalars, "reward/mean")
    assert len(rewards) == 200
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.4, f"first 10 steps {first:.3f}, last 10 {last:.3f}"
    grown = _flat(scalars)
    print(f"agent soak: {grown}")
    assert grown["threads"] <= 20 and grown["threads_max"] < 200, grown  # a thread per tool call: +3000 by step 200
    assert grown["fds"] <= 8, grown
    assert grown["rss_gb_per_100"] < 0.05, grown
    rollout = _series(scalars, "time/rollout")
    early, late = statistics.median(rollout[10:30]), statistics.median(rollout[-20:])
    print(f"agent soak: rollout median {early:.3f} s (steps 10-30) -> {late:.3f} s (last 20)")
    assert late <= 1.2 * early, f"rollout {early:.3f} s a step at steps 10-30, {late:.3f} s over the last 20"


def test_a_long_single_turn_run_holds_threads_files_and_memory_flat(tmp_path):
    yatt(["fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--trainer.max_steps", "300",
          f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}"],
         cwd=tmp_path, timeout=900)  # fmt: skip
    grown = _flat(read_scalars(tmp_path / "tb"))
    print(f"single-turn soak: {grown}")
    assert grown["threads"] <= 5 and grown["fds"] <= 8 and grown["rss_gb_per_100"] < 0.05, grown
