"""Tier 3: nothing grows with the steps. Long runs through the real CLI, read back from their TensorBoard
files: each step logs the process's OS threads, open file descriptors and resident memory
(``process/*/rank<r>``, measured at the step's end).

An agent run with tools (``configs/agent_lookup_tiny.yaml``, its 200 steps, a tool call per turn: before
the fix every call left a thread behind, 26,342 by step 140, and the run hung) learns while its threads,
files, memory and rollout time stay flat after warm-up. (Without the tool the same 100 steps gain 0.067 against
the tool's 0.182, deterministic runs of 2026-12-06; that comparison left the suite for its time, bench/RESULTS.md.) The long single-turn run is
``tests/test_async.py``'s learning run of ``configs/grpo_async_tiny.yaml`` (150 steps, 3 processes: each
trainer holds the same).
"""

from __future__ import annotations

import pytest

from tests.helpers import REPO, growth, read_scalars, yatt

pytestmark = pytest.mark.slow

def _series(scalars: dict, tag: str) -> list[float]:
    return [v for _, v in scalars[tag]]


def test_an_agent_run_with_tools_learns_and_nothing_grows(tmp_path):
    yatt(["fit", "--config", str(REPO / "configs" / "agent_lookup_tiny.yaml"),  # its checkpoints every 30 steps
          f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}"], cwd=tmp_path, timeout=900)  # fmt: skip
    scalars = read_scalars(tmp_path / "tb")
    rewards = _series(scalars, "reward/mean")
    assert len(rewards) == 200
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.4, f"first 10 steps {first:.3f}, last 10 {last:.3f}"
    grown = growth(scalars)
    print(f"agent soak: {grown}")
    assert grown["threads"] <= 20 and grown["threads_max"] < 200, grown  # a thread per tool call: +3000 by step 200
    assert grown["fds"] <= 8, grown
    assert grown["rss_gb_per_100"] < 0.06, grown  # the floor rose 0.033 (0.6 MB a step kept would fail)
    # Rollout seconds per response token, the fastest step of each window: a beside test only adds time (the
    # median of wall seconds went 0.363 -> 0.450 s in a clean clone's suite and 0.336 -> 0.285 s quiet), and the
    # episodes' lengths change as the policy learns; a cost that grows with the steps lifts the fastest too.
    rollout = [t / n for t, n in zip(_series(scalars, "time/rollout"), _series(scalars, "response_length/mean"), strict=True)]
    early, late = min(rollout[10:30]), min(rollout[-20:])
    print(f"agent soak: rollout {early * 1e3:.1f} ms a token at its fastest in steps 10-30 -> {late * 1e3:.1f} ms (last 20)")
    assert late <= 1.2 * early, f"rollout {early * 1e3:.1f} ms a token at steps 10-30, {late * 1e3:.1f} ms over the last 20"
