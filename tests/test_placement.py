"""Tier 3: generative reward model under full and partial colocation, on 2 processes (real vLLM engines)."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import REPO, SCRIPTS, read_scalars, run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FULL = REPO / "configs" / "grpo_genrm_full.yaml"
PARTIAL = REPO / "configs" / "grpo_genrm_partial.yaml"


def _run(out: Path, config: Path, *overrides: str, check: bool = True, env: dict | None = None):
    return run(
        [sys.executable, str(SCRIPTS / "placement_run.py"), str(out), str(config), "--trainer.max_steps", "3", *overrides],
        cwd=out.parent, timeout=600, check=check, env=env,
    )  # fmt: skip


def _ids(out: Path, pattern: str) -> Counter:
    found = Counter()
    for path in out.glob(pattern):
        for line in path.read_text().splitlines():
            item = json.loads(line)
            found.update(item["ids"] if isinstance(item, dict) else item)
    return found


def test_full_and_partial_colocation_score_every_sample_once_and_agree(tmp_path):
    """Both placements with dynamic sampling: every generated sample reaches the judge exactly once (by
    prompt id: each prompt's 8 samples, no more, no fewer), and with the same seeds both placements produce
    the same samples, judgments and rewards; partial colocation logs each rank's idle time."""
    extra = ["--model.dynamic_sampling.groups_per_update", "4"]
    curves = {}
    for name, config in (("full", FULL), ("partial", PARTIAL)):
        out = tmp_path / name
        _run(out, config, *extra)
        kept, scored = _ids(out, "kept_rank*.jsonl"), _ids(out, "scored_rank*.jsonl")
        assert sum(kept.values()) == 3 * 2 * 8 * 8  # 3 steps x 2 ranks x 8 prompts x 8 samples
        assert scored == kept, f"{name}: samples lost or scored twice"
        assert set(kept.values()) == {8}
        curves[name] = read_scalars(out / "tb")
        # The constrained judge (one digit, stopped by length after one token) is always readable.
        assert {v for _, v in curves[name]["reward/judge/unparsed"]} == {0.0}, name
    if_partial = curves["partial"]
    assert "idle_fraction/rank1" in if_partial and "memory/rollout_rss_gb/rank0" in curves["full"]
    assert all(0 <= v <= 1 for _, v in if_partial["idle_fraction/rank1"])
    for tag in ("reward/mean", "reward/judge/mean", "reward/alphabet/mean", "sampling/kept_groups"):
        a = [v for _, v in curves["full"][tag]]
        b = [v for _, v in curves["partial"][tag]]
        assert a == pytest.approx(b, abs=1e-6), tag


def test_partial_colocation_with_two_judge_ranks_per_rollout_rank(tmp_path):
    """3 processes, one rollout rank: each judge rank gets its own groups back scored, none is lost."""
    out = tmp_path / "uneven"
    _run(out, PARTIAL, "--trainer.max_steps", "2", "--trainer.devices", "3",
         "--trainer.strategy.placement.init_args.rollout_ranks", "[0]")  # fmt: skip
    kept, scored = _ids(out, "kept_rank*.jsonl"), _ids(out, "scored_rank*.jsonl")
    assert sum(kept.values()) == 2 * 3 * 8 * 8  # 2 steps x 3 ranks x 8 prompts x 8 samples
    assert scored == kept
    assert {
        len(json.loads(line)["ids"])
        for r in range(3)
        for line in (out / f"kept_rank{r}.jsonl").read_text().splitlines()
    } == {64}


def test_over_provisioning_judges_only_kept_groups_and_a_failing_judge_under_on_error_zero_counts(tmp_path):
    """Partial colocation with over-provisioning (extra 0.6) and a judge that fails under ``on_error: zero``:
    the judge is asked about the kept groups only, and each of their samples scores 0 and is counted."""
    out = tmp_path / "op"
    _run(out, PARTIAL, "--trainer.max_steps", "2", "--model.long_tail", "yatt_lightning.rollout.longtail.OverProvision",
         "--model.long_tail.extra", "0.6", env={"JUDGE_FAILS": "1", "JUDGE_ON_ERROR": "zero"})  # fmt: skip
    kept, scored = _ids(out, "kept_rank*.jsonl"), _ids(out, "scored_rank*.jsonl")
    assert sum(kept.values()) == 2 * 2 * 5 * 8  # floor(8 / 1.6) = 5 groups kept per rank and step
    assert scored == kept
    curves = read_scalars(out / "tb")
    assert {v for _, v in curves["reward/judge/mean"]} == {0.0}
    assert [v for _, v in curves["reward/judge/errors"]] == [80.0, 80.0]  # 2 ranks x 5 kept groups x 8 samples


def test_a_failing_judge_stops_both_ranks_with_its_error(tmp_path):
    proc = _run(tmp_path / "fail", PARTIAL, check=False, env={"JUDGE_FAILS": "1"})
    assert proc.returncode != 0
    assert "reward function judge raised RuntimeError: the judge engine is unreachable" in proc.stderr
    assert "the other side of the rollout/judge stream failed" in proc.stderr
