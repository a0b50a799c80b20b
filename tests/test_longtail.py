"""Tier 3: long-tail policies in a real run (full colocation, one process)."""

import pytest

from tests.helpers import REPO, read_scalars, yatt

pytestmark = pytest.mark.slow

TINY = str(REPO / "configs" / "grpo_tiny.yaml")


def _fit(tmp_path, *overrides):
    yatt(
        ["fit", "--config", TINY, "--trainer.callbacks", "[]", "--trainer.logger.init_args.save_dir", str(tmp_path), *overrides],
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    return read_scalars(tmp_path / "grpo_tiny")


def test_over_provisioning_trains_on_the_first_groups_to_finish(tmp_path):
    s = _fit(tmp_path, "--trainer.max_steps", "2", "--model.long_tail", "yatt_lightning.rollout.longtail.OverProvision",
             "--model.long_tail.extra", "1.0")  # fmt: skip
    assert [v for _, v in s["long_tail/kept_groups"]] == [8.0, 8.0]  # 16 launched, 8 kept
    assert len(s["actor/pg_loss"]) == 2


# PartialRollout's figures in a real run: tests/test_checkpoint.py (one run shared with the failed-step tests).
