"""Tier 3: every placement at the layouts users run, not only at two processes (3 and 4 processes; real
vLLM engines, Megatron over gloo, the real CLI).

The disaggregated runs use ``fixed_lag`` (max_staleness 1), so what each step trains on is known exactly:
step ``s`` trains on what version ``max(0, s - 1)`` generated, on every trainer, and every rollout rank's
engine holds that version when it produces step ``s``. 2 trainers + 1 rollout rank (data parallel) is
``tests/test_async.py``'s learning run of ``configs/grpo_async_tiny.yaml``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, SCRIPTS, run, yatt

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FIT = SCRIPTS / "async_fit.py"
COMMON = ["--trainer.max_steps=8", "--data.init_args.batch_size=4",  # 4 RL steps of 2 optimizer steps
          "--trainer.strategy.placement.init_args.fixed_lag=true"]  # fmt: skip


def _fit(out: Path, *args: str, timeout: int = 600):
    return run([sys.executable, str(FIT), str(out), *args], cwd=REPO, timeout=timeout)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_versions(out: Path, trainers: list[int], rollout: list[int], steps: int) -> dict[int, list[dict]]:
    """Every trainer trained step s on version max(0, s - 1), one version old at most, and every rollout rank's
    engine held exactly that version when it produced step s: all saw the same published versions."""
    trained = {r: json.loads((out / f"steps.rank{r}.json").read_text()) for r in trainers}
    for r, rows in trained.items():
        assert [row["step"] for row in rows] == list(range(steps)), f"trainer {r}"
        for row in rows:
            expected = max(0, row["step"] - 1)
            assert row["async"]["async/version"] == expected, f"trainer {r} step {row['step']}"
            assert row["async"]["async/staleness_max"] == row["step"] - expected <= 1
            assert row["trained"], f"trainer {r} step {row['step']} trained nothing"
    for r in rollout:
        produced = {row["step"]: row["version"] for row in _lines(out / f"produced.rank{r}.json")}
        assert produced == {s: max(0, s - 1) for s in range(steps)}, f"rollout rank {r}"
    return trained


def _saver(dirpath: Path, every: int) -> str:
    return json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
                        "init_args": {"every_n_steps": every, "dirpath": str(dirpath)}}])  # fmt: skip


def test_tp2_trainers_and_a_rollout_rank_train_publish_and_resume(tmp_path):
    """3 processes: a TP=2 trainer group and one rollout rank. Both TP ranks train on the same batch at the
    same version; resumed from its step-8 checkpoint, the run goes on to step 12 with the versions in order."""
    out = tmp_path / "tp2"
    layout = ["--trainer.devices=3", "--trainer.strategy.placement.init_args.rollout_ranks=[2]",
              "--trainer.strategy.tensor_model_parallel_size=2"]  # fmt: skip
    _fit(out, *COMMON, *layout, "--trainer.callbacks", _saver(out / "ckpts", 4))
    trained = _check_versions(out, [0, 1], [2], steps=4)
    assert [r["completions"] for r in trained[0]] == [r["completions"] for r in trained[1]], "a TP group trains one batch"
    assert (out / "ckpts" / "step-00000008").is_dir()

    resumed = _fit(out, *COMMON[1:], "--trainer.max_steps=12", *layout, "--trainer.callbacks",
                   _saver(out / "ckpts", 4), "--ckpt_path", "last")  # fmt: skip
    assert f"resuming from {out / 'ckpts'}/step-00000008" in resumed.stdout + resumed.stderr
    # The end-of-run save holds no batch made ahead, and version 3 is gone: step 4 uses version 4 (said in
    # the log), step 5 is back at the fixed lag.
    assert "resumed after the run's end: step 4 uses version 4" in resumed.stdout + resumed.stderr
    for r in (0, 1):
        after = json.loads((out / f"steps.rank{r}.json").read_text())
        assert [s["step"] for s in after] == [4, 5] and [s["async"]["async/version"] for s in after] == [4, 4]
    produced = _lines(out / "produced.rank2.json")
    assert [(r["step"], r["version"]) for r in produced[-2:]] == [(4, 4), (5, 4)]


def test_two_trainers_and_two_rollout_ranks_each_pair_trains_its_own_batches(tmp_path):
    """4 processes: 2 data-parallel trainers, 2 rollout ranks (each serves one trainer, on its own rows with
    its own engine); trainer 0 publishes to both rollout ranks."""
    out = tmp_path / "2x2"
    _fit(out, *COMMON, "--trainer.devices=4", "--trainer.strategy.placement.init_args.rollout_ranks=[2,3]")
    trained = _check_versions(out, [0, 1], [2, 3], steps=4)
    for a, b in zip(trained[0], trained[1], strict=True):
        assert a["prompts"] != b["prompts"], f"step {a['step']}: both trainers got the same rows"


def test_a_rank_that_fails_shows_its_cause_once_and_its_peers_errors_go_to_their_logs(tmp_path):
    """2 trainers + 1 rollout rank through ``yatt fit``; the reward raises on the rollout rank. The terminal
    shows one error screen, the rollout rank's own cause; the trainers' consequences (the producer failed,
    lost peers) are in their logs, as is whatever the runtime prints on the way out."""
    (tmp_path / "bad_reward.py").write_text(
        "def score(prompt, completion, **row):\n    raise ValueError('the grader is down (injected)')\n"
    )
    proc = yatt(["fit", "--config", str(REPO / "configs" / "grpo_async_tiny.yaml"), "--trainer.devices", "3",
                 "--trainer.strategy.placement.init_args.rollout_ranks", "[2]", "--trainer.max_steps", "4",
                 "--model.init_args.reward_fn", "bad_reward.score", "--trainer.callbacks", "[]",
                 "--trainer.default_root_dir", str(tmp_path / "runs")], cwd=tmp_path, timeout=300, check=False)  # fmt: skip
    terminal = (proc.stdout + proc.stderr).splitlines()
    screens = [line for line in terminal if line.startswith("yatt: error:")]
    assert proc.returncode == 1, "\n".join(terminal[-40:])
    assert len(screens) == 1, "\n".join(terminal)
    assert "the grader is down (injected)" in screens[0]
    noise = [line for line in terminal if not line.startswith(("[yatt", "yatt:", "step ", "       "))]
    assert not noise, "third-party lines on the terminal:\n" + "\n".join(noise)
    logs = "".join(p.read_text() for p in (tmp_path / "runs").rglob("output*.log"))
    assert logs.count("yatt: error:") == 2, "each trainer's consequence is in its own log"

