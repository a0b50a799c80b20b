"""Checkpoints: format checks (tier 1), then real runs killed, preempted and resumed (tier 3)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import SCRIPTS, read_scalars, run, run_script, yatt, yatt_in_process
from yatt_lightning.checkpoint import folder as ckpt

# ----------------------------------------------------------------------------------------- tier 1


def _fake_checkpoint(root: Path, step: int, payload: bytes = b"x" * 100, run_id: str | None = None) -> Path:
    folder = root / ckpt.checkpoint_name(step)
    (folder / "weights").mkdir(parents=True)
    (folder / "weights" / "__0_0.distcp").write_bytes(payload)
    (folder / "trainer_rank0.pt").write_bytes(b"state")
    files = {rel: ckpt._describe(folder / rel) for rel in ("weights/__0_0.distcp", "trainer_rank0.pt")}
    manifest = {"format": 1, "world_size": 1, "step": step, "run_id": run_id, "files": files}
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_checkpoints_are_ordered_by_step_not_file_times(tmp_path):
    """A folder copied with `cp -r` (times reset, here the oldest step made the newest file): the newest
    checkpoint is the highest step; with it truncated, `last` falls back to the next step down."""
    from types import SimpleNamespace

    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step, run_id="run-a")
    (tmp_path / ckpt.TRACKER).write_text("step-00000003")
    for age, step in enumerate((3, 2, 1)):  # step 1 the most recently touched
        for f in (tmp_path / ckpt.checkpoint_name(step)).rglob("*"):
            os.utime(f, (1_000_000 + age, 1_000_000 + age))
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step-00000003", "step-00000002", "step-00000001"]
    shard = tmp_path / "step-00000003" / "weights" / "__0_0.distcp"
    shard.write_bytes(b"x" * 10)
    strategy = SimpleNamespace(global_rank=0, world_size=1)
    assert ckpt.resolve(strategy, tmp_path / ckpt.TRACKER).name == "step-00000002"


def test_falling_back_stays_within_the_tracked_run(tmp_path):
    """Two runs wrote into one folder (the second did not resume): a broken checkpoint of the tracked run
    falls back to that run's next step down, never to the other run's higher step."""
    from types import SimpleNamespace

    _fake_checkpoint(tmp_path, 150, run_id="old")
    _fake_checkpoint(tmp_path, 20, run_id="new")
    _fake_checkpoint(tmp_path, 40, run_id="new")
    (tmp_path / ckpt.TRACKER).write_text("step-00000040")
    (tmp_path / "step-00000040" / "trainer_rank0.pt").unlink()
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path, run_id="new")] == ["step-00000040", "step-00000020"]
    assert ckpt.resolve(SimpleNamespace(global_rank=0, world_size=1), tmp_path / ckpt.TRACKER).name == "step-00000020"


def test_a_missing_checkpoint_folder_is_named(tmp_path):
    from types import SimpleNamespace

    with pytest.raises(ckpt.CheckpointError, match=r"`--ckpt_path`: \S+nope does not exist"):
        ckpt.resolve(SimpleNamespace(global_rank=0, world_size=1), tmp_path / "nope")
    assert ckpt.verify(tmp_path / "nope") == [f"{tmp_path / 'nope'}: no such checkpoint folder"]


def test_verify_detects_truncation_corruption_and_missing_files(tmp_path):
    folder = _fake_checkpoint(tmp_path, 3)
    assert ckpt.verify(folder) == []
    shard = folder / "weights" / "__0_0.distcp"
    shard.write_bytes(b"x" * 50)
    assert ckpt.verify(folder) == [f"{shard}: 50 bytes, the manifest says 100 (truncated or overwritten)"]
    shard.write_bytes(b"y" * 100)
    assert ckpt.verify(folder) == [f"{shard}: checksum mismatch (corrupted)"]
    shard.unlink()
    assert ckpt.verify(folder) == [f"{shard}: missing"]
    (folder / ckpt.MANIFEST).unlink()
    assert "missing (the save did not finish)" in ckpt.verify(folder)[0]


def test_a_garbled_manifest_is_unusable_not_a_crash(tmp_path):
    folder = _fake_checkpoint(tmp_path, 3)
    for garbage in (b"\xff\xfe not utf-8", b"[1, 2]", b'{"files": {"a": 5}}'):
        (folder / ckpt.MANIFEST).write_bytes(garbage)
        assert "unreadable" in ckpt.verify(folder)[0]  # `--ckpt_path last` then tries the next older one


def test_resuming_with_another_number_of_processes_is_refused(tmp_path):
    from types import SimpleNamespace

    folder = _fake_checkpoint(tmp_path, 3)  # written by 1 process
    with pytest.raises(ckpt.CheckpointError, match=r"written by 1 processes and this run has 2.*yatt export"):
        ckpt.load_trainer_state(SimpleNamespace(world_size=2, global_rank=0), folder)


def test_a_writer_that_failed_is_reported_with_its_cause(tmp_path):
    """The background writer of a rank could not write its files (a full disk): finalising names the
    cause on every rank (they agree before any of them raises) and nothing is renamed or tracked."""
    from types import SimpleNamespace

    tmp = tmp_path / "step-00000005.tmp"
    (tmp / "weights").mkdir(parents=True)
    (tmp / "error_rank0.txt").write_text("OSError: [Errno 28] No space left on device")
    strategy = SimpleNamespace(global_rank=0, world_size=1)
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000005 was not saved: rank 0: OSError: \[Errno 28\]"):
        ckpt.finalize(strategy, tmp_path / "step-00000005")
    assert not (tmp_path / "step-00000005").exists() and ckpt.tracked(tmp_path) is None


def test_unfinished_saves_are_not_checkpoints(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    (tmp_path / "step-00000004.tmp" / "weights").mkdir(parents=True)  # a save killed midway
    (tmp_path / "step-00000006").mkdir()  # renamed without a manifest cannot happen, but is not trusted
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step-00000002"]


def test_checksums_are_split_between_ranks(tmp_path):
    folder = _fake_checkpoint(tmp_path, 1)
    (folder / "weights" / "__0_0.distcp").write_bytes(b"z" * 100)  # same size, other content
    found = [bool(ckpt.verify(folder, rank, 2)) for rank in range(2)]
    assert sorted(found) == [False, True], "exactly one of two ranks checksums each file"


# ----------------------------------------------------------------------------------------- tier 3


def _saver(dirpath: Path, every: int, async_save: bool = True) -> str:
    init = {"every_n_steps": every, "dirpath": str(dirpath), "async_save": async_save}
    return json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint", "init_args": init}])


def _faults(out: Path, *args: str, expect_kill: bool = False, timeout: float = 500):
    """Run tests/scripts/faults.py in its own process group (it may SIGKILL the group)."""
    cmd = [sys.executable, str(SCRIPTS / "faults.py"), str(out), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    killed = proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
    assert killed == expect_kill, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def _saved_steps(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"checkpoint saved: step (\d+)", log)]


def _resumed_step(log: str) -> int:
    """The step the run resumed from (0: it found no checkpoint and started over)."""
    m = re.search(r"resuming from \S*step-(\d+)", log)
    return int(m.group(1)) if m else 0


def _records(out: Path, rank: int = 0) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / f"record_rank{rank}.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}  # a resumed run's rows replace the killed run's


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final.safetensors"))


@pytest.mark.slow
# GRPO's resume after SIGKILLs, Ctrl-C and SIGTERM, bitwise on an uninterrupted run: bench/kill_resume.py and
# bench/interrupts.py at their smoke sizes (tests/test_benches.py), and the chain of kills below.
def test_ppo_with_its_critic_resumes_bitwise_on_two_processes(tmp_path):
    """PPO (GAE, a critic with its own optimizer and value clipping, two optimizer steps per RL step) on two
    data-parallel processes, SIGTERM to rank 0 at optimizer step 4 (finish the step, save, stop), then
    resumed with `--ckpt_path last`: the same policy and critic weights bit for bit, the same rewards,
    policy and value losses, the same prompts in the same order as a run that was never interrupted."""
    common = ["--trainer.max_steps", "8", "--trainer.devices", "2", "--data.batch_size", "8", "--model.mini_batches", "2",
              "--model.advantage_estimator", "yatt_lightning.algorithms.GAE", "--model.critic", '{"value_clip": 0.2}']  # fmt: skip
    whole = tmp_path / "whole"
    _faults(whole, *common, "--trainer.callbacks", _saver(whole / "ckpts", 2))

    cut = tmp_path / "cut"
    saver = _saver(cut / "ckpts", 2)
    log = _faults(cut, "--kill", "sigterm:4", *common, "--trainer.callbacks", saver)
    assert re.search(r"preemption: received SIGTERM; saved step 6 to \S+step-00000006; stopping training", log)
    log = _faults(cut, *common, "--trainer.callbacks", saver, "--ckpt_path", "last")
    assert _resumed_step(log) == 6

    a, b = _weights(whole), _weights(cut)
    assert a.keys() == b.keys() and any(k.startswith("critic.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    for rank in range(2):
        records = _records(whole, rank)
        assert records == _records(cut, rank) and all("value_loss" in r for r in records.values())


@pytest.mark.slow
def test_a_save_after_a_round_without_an_update_onloads_the_policy_and_resumes_bitwise(tmp_path):
    """Dynamic sampling wants 12 informative groups a step and a round gives at most 8, so a step's first
    round ends without an update, the training state still offloaded (on CPU too: its tensors are empty
    until onload). A SIGTERM then saves at that safe point: the save brings the state back first, and the
    run resumed from it ends bit for bit where an uninterrupted one does."""
    common = ["--trainer.max_steps", "3", "--data.batch_size", "8",
              "--model.dynamic_sampling", '{"groups_per_update": 12, "max_rounds": 3}']  # fmt: skip
    whole = tmp_path / "whole"
    _faults(whole, *common, "--trainer.callbacks", _saver(whole / "ckpts", 100))
    cut = tmp_path / "cut"
    saver = _saver(cut / "ckpts", 100)
    log = _faults(cut, "--kill", "sigterm:1", *common, "--trainer.callbacks", saver)
    assert "a round without an update left the training state offloaded: onloading it for the save" in log, log[-3000:]
    assert re.search(r"preemption: received SIGTERM; saved step 1 to \S+step-00000001; stopping training", log)
    log = _faults(cut, *common, "--trainer.callbacks", saver, "--ckpt_path", "last")
    assert _resumed_step(log) == 1
    a, b = _weights(whole), _weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
    assert _records(whole) == _records(cut)


@pytest.mark.slow
def test_sigkill_at_any_moment_resumes_from_the_last_reported_checkpoint(tmp_path):
    """SIGKILL while the writers run. `latest` names an intact checkpoint, the newest one that was reported
    saved. Its shard truncated, it is refused naming the file when asked for, and `last` falls back to the one
    reported before it and says so. (That a run resumes from the newest reported save, and a killed and resumed
    chain ends on an uninterrupted run's weights, bit for bit, with a kill at a uniform moment and one in the
    finalisation window between the manifest and the rename: bench/kill_resume.py's smoke size; one between two
    optimizer steps: tests/test_lora.py's killed run.)"""
    common = ["--trainer.max_steps", "10", "--model.mini_batches", "2"]  # 2 optimizer steps per RL step
    out = tmp_path / "chain"
    saver = _saver(out / "ckpts", 2)
    log = _faults(out, "--kill", "save:6", *common, "--trainer.callbacks", saver, expect_kill=True)
    reported = _saved_steps(log)
    assert len(reported) >= 2, "the saves of steps 2 and 4 were reported before the kill at step 6's"
    latest = ckpt.tracked(out / "ckpts")
    assert latest is not None and latest.name == ckpt.checkpoint_name(max(reported))
    assert ckpt.verify(latest) == []

    # A truncated shard: reported with the file when named explicitly; `last` falls back and says so.
    newest = latest
    shard = sorted((newest / "weights").glob("__0_*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    code, out_ = yatt_in_process(["export", "--ckpt_dir", str(newest), "--out", str(tmp_path / "x")], cwd=tmp_path)
    assert code != 0 and f"{shard}: 100 bytes, the manifest says" in out_
    more = [*common, "--trainer.callbacks", saver]
    proc = run(
        [sys.executable, str(SCRIPTS / "faults.py"), str(out), *more, "--ckpt_path", str(newest)],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert f"checkpoint {newest} is incomplete or corrupted: {shard}: 100 bytes" in proc.stderr
    log = _faults(out, *more, "--ckpt_path", "last")
    assert f"checkpoint {newest} is not usable ({shard}: 100 bytes" in log
    assert _resumed_step(log) == sorted(reported)[-2]


@pytest.mark.slow
def test_sigterm_to_every_process_of_the_run_saves_and_stops(tmp_path):
    """SLURM signals the whole job: the ranks, and the processes serving the background writers, which
    must outlive the signal for the in-flight and the preemption saves to complete."""
    out = tmp_path / "run"
    log = _faults(out, "--kill", "sigterm-group:3", "--trainer.max_steps", "8",
                  "--trainer.callbacks", _saver(out / "ckpts", 2))  # fmt: skip
    assert re.search(r"preemption: received SIGTERM; saved step 4 to \S+step-00000004; stopping training", log)
    assert _saved_steps(log) == [2, 4]
    latest = ckpt.tracked(out / "ckpts")
    assert latest.name == "step-00000004" and ckpt.verify(latest) == []


PARTIAL = ["--model.long_tail", "yatt_lightning.rollout.longtail.PartialRollout",
           "--model.long_tail.max_new_tokens_per_step", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def partial_runs(tmp_path_factory):
    """Two runs of the tiny config under PartialRollout (6-token responses, 4 tokens a step), shared by the tests
    below: ``failed`` raises in the rollout of step 2 of 6 (its process's result is returned), ``clean`` stops
    after step 2 (a checkpoint, its TensorBoard figures and the final policy's logits, ``logits.pt``)."""
    root = tmp_path_factory.mktemp("partial")
    failed, clean = root / "failed", root / "clean"
    proc = run(
        [sys.executable, str(SCRIPTS / "faults.py"), str(failed), "--kill", "raise:2", "--trainer.max_steps", "6",
         *PARTIAL, "--trainer.callbacks", _saver(failed / "ckpts", 10)],
        cwd=root, check=False,
    )  # fmt: skip
    _faults(clean, "--trainer.max_steps", "2", *PARTIAL, "--trainer.callbacks", _saver(clean / "ckpts", 10))
    return proc, failed, clean


@pytest.mark.slow
def test_exception_saves_consistent_state_and_says_so(partial_runs):
    proc, failed, _ = partial_runs
    assert proc.returncode != 0 and "injected failure in the rollout of step 2" in proc.stderr
    assert "after ValueError: the state after step 2 is consistent and was saved to" in proc.stderr
    assert ckpt.tracked(failed / "ckpts").name == "step-00000002"


@pytest.mark.slow
def test_a_failed_step_leaves_partial_rollouts_as_they_were(partial_runs):
    """PartialRollout: a step that fails after its rollout (which finished some carried groups and started
    the new batch's) saves the carried groups as they were before the step: the same as a run that
    stopped cleanly at that step, so no finished-but-untrained group is lost on resume."""
    proc, failed, clean = partial_runs
    assert "the state after step 2 is consistent and was saved" in proc.stderr, proc.stderr[-3000:]

    def carried(out: Path) -> list:
        state = torch.load(ckpt.trainer_state_file(ckpt.tracked(out / "ckpts"), 0), weights_only=False)
        groups = state["yatt_long_tail"]["carried"]
        return [[(s.row["_id"], s.token_ids, s.finished) for s in group] for group in groups]

    assert carried(failed) == carried(clean)
    assert carried(clean), "the check needs carried groups"


@pytest.mark.slow
def test_partial_rollout_continues_unfinished_samples_in_the_next_step(partial_runs):
    """The clean run's figures: nothing finishes in the first step (no update), then the first batch's groups
    finish in the second while the second batch's wait."""
    s = read_scalars(partial_runs[2] / "tb" / "grpo_tiny")
    finished = [v for _, v in s["long_tail/finished_groups"]]
    assert finished and all(v > 0 for v in finished)
    assert max(v for _, v in s["long_tail/carried_groups"]) >= 16
    assert len(s["actor/pg_loss"]) >= 1


@pytest.mark.slow
def test_export_loads_in_transformers_and_vllm_with_the_policy_logits(partial_runs, tmp_path):
    out = partial_runs[2]  # the clean run: its last checkpoint holds the final policy, whose logits it recorded
    yatt(["export", "--ckpt_dir", str(out / "ckpts"), "--out", str(tmp_path / "hf")], cwd=tmp_path)
    from transformers import AutoModelForCausalLM

    probe = torch.load(out / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        logits = model(probe["ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=2e-5, rtol=1e-5)
    assert run_script("vllm_generate.py", str(tmp_path / "hf"), timeout=300)["tokens"] > 0


# ----------------------------------------------------------------------------------------- one run per folder
_HOLD = """
import sys, time
from yatt_lightning.checkpoint.lock import FolderLock
FolderLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_folder_is_refused_naming_its_holder_and_a_dead_holders_lock_is_taken_over(tmp_path, caplog):
    from yatt_lightning.checkpoint.lock import FolderLock, FolderLocked

    folder = tmp_path / "ckpts"
    holder = _holder(folder)
    try:
        with pytest.raises(FolderLocked, match=rf"{folder} is in use by another run \(pid {holder.pid} on "):
            FolderLock(folder).acquire()
    finally:
        holder.kill()  # SIGKILL: the holder cannot clean up; the OS drops its lock
        holder.wait()
    lock = FolderLock(folder)
    with caplog.at_level("INFO", logger="yatt_lightning.checkpoint.folder"):
        lock.acquire()
    assert f"taking over the lock of a run that ended (pid {holder.pid} on" in caplog.text
    lock.release()
    caplog.clear()
    with caplog.at_level("INFO", logger="yatt_lightning.checkpoint.folder"):
        FolderLock(folder).acquire()  # released cleanly: no takeover to report
    assert "taking over" not in caplog.text


@pytest.mark.distributed
def test_a_second_run_on_a_held_checkpoint_folder_stops_every_rank_before_any_engine(tmp_path):
    folder = tmp_path / "ckpts"
    holder = _holder(folder)
    try:
        saver = json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint", "init_args": {"dirpath": str(folder)}}])
        proc = yatt(["fit", "--config", str(Path(__file__).resolve().parents[1] / "configs" / "grpo_tiny.yaml"),
                     "--trainer.devices", "2", "--trainer.max_steps", "2", "--trainer.callbacks", saver],
                    cwd=tmp_path, timeout=300, check=False)  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert f"{folder} is in use by another run (pid {holder.pid} on" in text
    assert "engine ready" not in text and "engines started" not in text
