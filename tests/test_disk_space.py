"""Disk space for checkpoints: the arithmetic (tier 1), and runs whose disk fills (tier 3, on a small tmpfs)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, yatt
from tests.test_checkpoint import _fake_checkpoint
from yatt_lightning.checkpoint import folder as ckpt

REPO_CONFIGS = REPO / "configs"

def test_what_a_save_needs_and_what_a_full_disk_looks_like(tmp_path):
    """Tier 1: the estimate's arithmetic, the newest checkpoint's size winning over it, and a full disk
    recognised however deep its cause sits."""
    import errno

    from yatt_lightning.checkpoint import space

    fp32, bf16 = torch.zeros(1000), torch.zeros(1000, dtype=torch.bfloat16)
    assert space.estimate_bytes([fp32], 1) == 1000 * (4 + 8)  # weights, Adam's two moments
    assert space.estimate_bytes([bf16], 2) == 2 * 1000 * (2 + 8 + 4)  # and an fp32 master copy; 2 shards
    assert space.needed_bytes(tmp_path, lambda: 123) == (123, "an estimate from the policy's parameters")
    _fake_checkpoint(tmp_path, 4, payload=b"x" * 1000)
    (tmp_path / "latest").write_text("step-00000004")
    assert space.needed_bytes(tmp_path, lambda: 123) == (1000 + 5, "the size of step-00000004")

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("Worker failure") from inner
    except RuntimeError as outer:
        assert space.is_no_space(outer)
    assert space.is_no_space(RuntimeError("rank 1: OSError: [Errno 28] No space left on device"))
    assert not space.is_no_space(RuntimeError("unexpected pos 704 vs 598"))

    free = space.free_bytes(tmp_path)
    assert space.check(tmp_path, "step-00000005", free // 2, "x", "stop") is None
    error = space.check(tmp_path, "step-00000005", free * 2, "the size of step-00000004", "stop")
    assert isinstance(error, space.NoSpaceError)
    assert re.search(r"stopping before saving step-00000005: it needs about .* \(the size of step-00000004\) and "
                     r".* free \(`on_no_space: stop`\); `latest` still names step-00000004", str(error))  # fmt: skip


@pytest.fixture
def small_disk(tmp_path):
    """A 7 MB filesystem: the tiny model's first checkpoint (4.7 MB) fits, a second does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine cannot mount a tmpfs ({mounted.stderr.strip()})")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill_disk(disk: Path, tmp_path: Path, **saver) -> tuple[subprocess.CompletedProcess, str]:
    callbacks = [{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
                  "init_args": {"every_n_steps": 1, "dirpath": str(disk / "ckpts"), **saver}}]  # fmt: skip
    proc = yatt(["fit", "--config", str(REPO_CONFIGS / "grpo_tiny.yaml"), "--trainer.max_steps", "3",
                 "--trainer.default_root_dir", str(disk / "runs"), "--trainer.callbacks", json.dumps(callbacks)],
                cwd=tmp_path, timeout=300, check=False)  # fmt: skip
    return proc, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_gives_one_screen_no_tmp_and_an_intact_latest(small_disk, tmp_path):
    """The logs are on the full disk too, as a run's default layout puts them."""
    proc, out = _fill_disk(small_disk, tmp_path)
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"WARNING\] step-00000002 needs about 4\.\d MB \(the size of step-00000001\) and \S+ckpts has "
                     r"\d\.\d MB free: the save will likely fail", out), out[-3000:]  # fmt: skip
    errors = [line for line in out.splitlines() if line.startswith("yatt: error:")]
    assert len(errors) == 1 and re.search(
        r"NoSpaceError: no space left on the disk of \S+ckpts while saving step-00000002: it needs about 4\.\d MB and "
        r"\d\.\d MB is free now that its partial write \(step-00000002\.tmp\) is removed; `latest` still names "
        r"step-00000001", errors[0]), out[-3000:]  # fmt: skip
    assert "Traceback" not in out and len(out.splitlines()) < 40, out[-3000:]
    ckpts = small_disk / "ckpts"
    assert not list(ckpts.glob("*.tmp"))
    assert ckpt.tracked(ckpts).name == "step-00000001" and ckpt.verify(ckpts / "step-00000001") == []


@pytest.mark.slow
def test_on_no_space_stop_refuses_the_first_save_by_its_estimate_before_writing(small_disk, tmp_path):
    subprocess.run(["mount", "-o", "remount,size=3m", str(small_disk)], check=True)
    proc, out = _fill_disk(small_disk, tmp_path, on_no_space="stop")
    assert proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("yatt: error:")]
    assert len(errors) == 1 and re.search(
        r"stopping before saving step-00000001: it needs about 4\.\d MB \(an estimate from the policy's parameters\) "
        r"and \S+ckpts has \d\.\d MB free \(`on_no_space: stop`\); `latest` still names no checkpoint", errors[0]
    ), out[-3000:]  # fmt: skip
    assert [p.name for p in (small_disk / "ckpts").iterdir() if not p.name.startswith(".")] == []
