"""Asynchronous RL on the disaggregated placement: pure parts, then real 2-process runs of ``yatt fit``."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import REPO, growth, read_scalars, run, spawn_gloo, yatt
from yatt_lightning.distributed.layout import Layout
from yatt_lightning.placement import Disaggregated
from yatt_lightning.placement.weight_buckets import fill, layout, pack, unpack

SCRIPT = REPO / "tests" / "scripts" / "async_fit.py"


# ---------------------------------------------------------------------------------------------- pure
def test_the_layout_and_its_keys_are_checked_naming_the_key():
    placement = Disaggregated()
    placement.check(Layout(4, 1, 1))
    assert (placement.trainers, placement.rollout) == ([0, 1], [2, 3])
    assert placement.serves(2) == [0] and placement.serves(3) == [1]
    assert [placement.source(t) for t in (0, 1)] == [2, 3]
    one = Disaggregated(rollout_ranks=[3])
    one.check(Layout(4, 1, 1))
    assert one.trainers == [0, 1, 2] and one.serves(3) == [0, 1, 2]
    cases = [
        (dict(max_staleness=-1), "max_staleness"),
        (dict(on_stale="skip"), "on_stale"),
        (dict(on_stale="drop", fixed_lag=True), "fixed_lag"),
        (dict(max_staleness=1, publish_every=3), "publish_every"),
        (dict(fixed_lag=True, publish_every=2), "publish_every"),
        (dict(queue_size=0), "queue_size"),
        (dict(fixed_lag=True, in_flight_updates=True), "in_flight_updates"),
    ]
    for kwargs, key in cases:
        with pytest.raises(ValueError, match=key):
            Disaggregated(**kwargs)
    with pytest.raises(ValueError, match="rollout_ranks.*last ranks"):
        Disaggregated(rollout_ranks=[0]).check(Layout(2, 1, 1))
    with pytest.raises(ValueError, match="rollout_ranks.*must divide"):
        Disaggregated(rollout_ranks=[1, 2]).check(Layout(3, 1, 1))
    with pytest.raises(ValueError, match="does not divide the 1 trainer"):
        Disaggregated().check(Layout(2, 2, 1))


def test_what_the_disaggregated_placement_cannot_run_is_refused_before_start_naming_the_key(tmp_path):
    """In-process `yatt fit`, nothing starts: dynamic sampling with `on_stale: wait` (a round that fills no
    update publishes no version the producer could wait for)."""
    from tests.helpers import yatt_in_process

    dapo = ["fit", "--config", str(REPO / "configs" / "dapo_async_tiny.yaml"), "--trainer.callbacks", "[]"]
    code, err = yatt_in_process([*dapo, "--trainer.strategy.placement.init_args.on_stale", "wait"], cwd=tmp_path)
    assert code == 2 and "`model.dynamic_sampling` with `trainer.strategy.placement: Disaggregated` needs" in err, err
    assert "on_stale: drop" in err


def test_weights_travel_in_buckets_and_come_back_bitwise():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c", torch.randint(0, 9, (2, 2), generator=g)), ("big", torch.randn(300, generator=g))]  # fmt: skip
    entries, buckets = pack(named, bucket_bytes=64)
    assert [b.numel() for b in buckets] == [60, 14 + 2 + 32, 1200]  # a; b and c (16-byte aligned) share one; big its own
    assert layout(named, bucket_bytes=64) == (entries, [b.numel() for b in buckets])  # the index before any copy
    assert sum(e.nbytes for e in entries) == sum(t.numel() * t.element_size() for _, t in named)
    back = unpack(entries, [b.clone() for b in buckets])
    for (name, t), (name2, t2) in zip(named, back, strict=True):
        assert name == name2 and t2.dtype == t.dtype and torch.equal(t, t2)
    named[0][1].add_(1.0)  # the trainer steps on: what was packed is a copy
    assert not torch.equal(named[0][1], unpack(entries, buckets)[0][1])


def test_buckets_grow_from_a_small_first_one_and_a_later_version_must_match_the_index():
    named = [(str(i), torch.zeros(4)) for i in range(16)]  # 16 bytes each
    entries, sizes = layout(named, bucket_bytes=64, first_bytes=16)
    assert sizes == [16, 32, 64, 64, 64, 16]  # caps 16, 32, 64, then bucket_bytes: the first copy is short
    changed = [*named[:3], ("3", torch.zeros(5)), *named[4:]]  # a later export whose shapes differ
    with pytest.raises(RuntimeError, match=r"expected 3 \(4,\) torch.float32, got 3 \(5,\) torch.float32"):
        list(fill(changed, entries, sizes, lambda size: torch.empty(size, dtype=torch.uint8)))


def test_large_storages_go_as_they_are_and_their_views_come_back_bitwise():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(12, 8, generator=g)  # 384 bytes: a fused weight, exported as three strided views
    q, k, v = qkv.view(4, 3, 8).unbind(1)
    small, big = torch.randn(5, generator=g), torch.randn(40, generator=g)
    named = [("q", q), ("small", small), ("k", k), ("v", v), ("big", big), ("big_t", big.view(8, 5).t())]
    entries, sizes = layout(named, bucket_bytes=64, direct_bytes=128)
    # qkv's storage when its last view (v) is read, then big's (big and its transpose: 160 bytes, shared)
    # at big_t; small is packed, in the bucket closed at the end
    assert sizes == [384, 160, 20] and [e.bucket for e in entries] == [0, 2, 0, 0, 1, 1]
    assert entries[0].stride == (24, 1) and entries[2].offset == 32 and entries[1].stride is None
    sent = list(fill(named, entries, sizes, lambda size: torch.empty(size, dtype=torch.uint8)))
    assert [packed for _, packed in sent] == [False, False, True]
    assert sent[0][0].data_ptr() == qkv.data_ptr()  # no copy: the storage's own bytes
    back = unpack(entries, [b.clone() for b, _ in sent])  # as the receiver holds them: its own buffers
    for (name, t), (name2, t2) in zip(named, back, strict=True):
        assert name == name2 and t2.stride() == t.stride() and torch.equal(t, t2)
    moved = [(n, t.clone()) if n == "q" else (n, t) for n, t in named]  # a later export, q in a storage of its own
    with pytest.raises(RuntimeError, match="expected q"):
        list(fill(moved, entries, sizes, lambda size: torch.empty(size, dtype=torch.uint8)))
    assert layout(moved, bucket_bytes=64, direct_bytes=128) != (entries, sizes)  # the publisher sends a new index


def _megatron_tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """A one-layer trainer's parameters under Megatron names, views of one storage (as a disaggregated
    trainer keeps them), their values set by ``version``."""
    shapes = [("embedding.word_embeddings.weight", (40, 32)), ("decoder.layers.0.self_attention.linear_qkv.weight", (64, 32)),
              ("decoder.layers.0.self_attention.linear_qkv.bias", (64,)), ("decoder.layers.0.mlp.linear_fc1.weight", (48, 32)),
              ("decoder.final_layernorm.weight", (32,)), ("output_layer.weight", (40, 32))]  # fmt: skip
    flat = torch.randn(sum(torch.Size(s).numel() for _, s in shapes), generator=torch.Generator().manual_seed(version))
    named, offset = [], 0
    for name, shape in shapes:
        named.append((name, flat[offset : offset + torch.Size(shape).numel()].view(shape)))
        offset += torch.Size(shape).numel()
    return named


def _tiny_names():
    from transformers import Qwen2Config

    from yatt_lightning.models.families import arch_of
    from yatt_lightning.models.hf_names import HFNames

    # 4 query heads in 2 groups of head_dim 8: q, k and v are not views of the fused weight
    config = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_hidden_layers=1, intermediate_size=24, vocab_size=40, tie_word_embeddings=False)  # fmt: skip
    return HFNames(arch_of(config))


def _weight_channel_rank(rank, port, queue):
    from yatt_lightning.placement.weight_channel import END, WEIGHTS, WeightPublisher, WeightReceiver

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group, names, out = torch.distributed.new_group([0, 1], backend="gloo"), _tiny_names(), []
    data = torch.distributed.new_group([0, 1], backend="gloo")  # the buckets' group: receives posted ahead
    if rank == 0:
        publisher = WeightPublisher(group, 0, bucket_bytes=1 << 20, direct_bytes=1024, part_bytes=4096, data_group=data)
    else:
        receiver = WeightReceiver(group, 0, part_bytes=4096, data_group=data)
    for version in (1, 2, 3, 4):
        rename = names if version < 4 else None  # version 4: a new index (not renamed) into receives posted for the old
        if rank == 0:
            publisher.flush(60, only_direct=True)  # before the trainer changes what it sent as it is
            publisher.publish(WEIGHTS, version, version - 1, _megatron_tensors(version), rename=rename)
            out.append(publisher.sent_bytes)
        else:
            receiver.wait(lambda s, v=version: s.latest >= v, f"version {version}", 60)
            got = receiver.take(version)
            expected = [(n, t.clone()) for name, full in _megatron_tensors(version)
                        for n, t in (names(name, full) if rename else [(name, full)])]  # fmt: skip
            same = [n for n, _ in got] == [n for n, _ in expected] and all(
                a.shape == b.shape and torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True)
            )  # fmt: skip
            q = dict(got).get("model.layers.0.self_attn.q_proj.weight")
            out.append((same, None if q is None else q.data_ptr(), receiver._ahead is not None))
        torch.distributed.barrier()  # the next version is sent after this one was taken
    if rank == 0:
        publisher.publish(END, 4, 4)  # zeros into the receives posted for a version 5
        publisher.flush(60)
    else:
        receiver.wait(lambda s: s.ended, "the end", 60)
        receiver.join(60)
        out.append(receiver._thread.is_alive())
    queue.put((rank, out))


@pytest.mark.distributed
def test_parameters_sent_as_they_are_in_parts_arrive_renamed_to_the_export():
    """The trainer's one storage travels in parts into receives the rollout rank posted ahead; its take renames
    them (q, k and v copied out of the fused QKV into buffers it reuses at the next take). A new index and the
    end fill the receives posted for the old one with zeros."""
    results = spawn_gloo(_weight_channel_rank, timeout=120)
    sent, received = results[0], results[1]
    assert sent == [4 * sum(torch.Size(s).numel() for s in [(40, 32), (64, 32), (64,), (48, 32), (32,), (40, 32)])] * 4
    assert sent[0] > 3 * 4096  # more than three parts
    assert all(same for same, _, _ in received[:4]), "a version arrived different from what was sent"
    assert all(ahead for _, _, ahead in received[:4]), "the next version's receives were not posted ahead"
    # the take renames into buffers the engine has copied out of (the version taken before's)
    assert received[0][1] == received[1][1] == received[2][1]
    assert received[4] is False, "the receiving thread did not end at END"


# ---------------------------------------------------------------------------------------------- real runs
def _fit(out, *args, timeout=600, check=True):
    return run([sys.executable, str(SCRIPT), str(out), *args], cwd=REPO, timeout=timeout, check=check)


# The rule reward, and a tiny random judge constrained to a digit (its scores are noise, but deterministic noise).
JUDGED = [
    {"class_path": "yatt_lightning.rewards.RuleReward",
     "init_args": {"path": "yatt_lightning.rewards.rules.alphabet_reward", "name": "alphabet"}},
    {"class_path": "yatt_lightning.rewards.GenerativeRewardModel",
     "init_args": {"model": "builtin:tiny-qwen2", "template": "after {prompt} the answer {completion} scores",
                   "parser": {"class_path": "yatt_lightning.rewards.NumberParser", "init_args": {"low": 0, "high": 9}},
                   "choices": list("0123456789"), "max_new_tokens": 2, "max_judge_tokens": 48, "weight": 0.1}},
]  # fmt: skip


def _steps(out) -> list[dict]:
    return json.loads((out / "steps.json").read_text())


@pytest.mark.slow
@pytest.mark.distributed
def test_lag_zero_reproduces_the_colocated_step_exactly(tmp_path):
    """Disaggregated with max_staleness 0 (1 rollout + 1 trainer) against the colocated step on one process,
    same seeds, PPO with its critic (GAE) and a generative judge beside the rule reward (on the rollout rank, its
    engine beside the policy's): the same samples, judgments, rewards, critic losses and final weights. Both run a
    user's ``reward`` override that returns a plain tensor (the hook allows it; the asynchronous step once read
    it as scores and failed)."""
    from safetensors.torch import load_file

    from yatt_lightning.checkpoint.model_source import resolve_model_path

    steps = ["--trainer.max_steps=8", "--data.init_args.batch_size=8",  # 4 RL steps of 2 optimizer steps
             "--model.class_path=tests.scripts.async_fit.PlainTensorReward",
             "--model.advantage_estimator=yatt_lightning.algorithms.GAE", "--model.critic={}",
             f"--model.rewards={json.dumps(JUDGED)}"]  # fmt: skip
    _fit(tmp_path / "async", *steps, "--trainer.strategy.placement.init_args.max_staleness=0",
         "--trainer.strategy.placement.init_args.fixed_lag=true")  # fmt: skip
    colocated = ["--trainer.devices=1", "--trainer.strategy.placement=yatt_lightning.placement.FullColocation"]
    _fit(tmp_path / "colocated", *steps, *colocated)
    a, c = _steps(tmp_path / "async"), _steps(tmp_path / "colocated")
    assert len(a) == len(c) == 4
    for k, (x, y) in enumerate(zip(a, c, strict=True)):
        assert x["completions"] == y["completions"], f"step {k}: different samples"
        assert x["rewards"] == y["rewards"], f"step {k}: different rewards"
        assert x["critic_loss"] == y["critic_loss"] is not None, f"step {k}: the critic trained differently"
        assert x["judge"] == y["judge"] is not None, f"step {k}: the judge scored differently"
        assert x["async"]["async/staleness_max"] == 0.0
    wa, wc = load_file(tmp_path / "async" / "weights.safetensors"), load_file(tmp_path / "colocated" / "weights.safetensors")
    assert wa.keys() == wc.keys()
    assert all(torch.equal(wa[k], wc[k]) for k in wa), "the final weights differ"
    initial = load_file(resolve_model_path("builtin:tiny-qwen2") / "model.safetensors")
    assert any(not torch.equal(initial[k], wa[k]) for k in wa if k in initial), "nothing was trained"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_slow_consumer_never_trains_on_a_batch_older_than_max_staleness(tmp_path):
    """The trainer sleeps 1 s a step. ``wait``: the producer waits and every batch is at most 1 version old;
    ``drop`` with max_staleness 0 and a queue of 2: the producer runs a batch ahead, and a batch one version old
    is dropped and counted, never trained on."""
    common = ["--trainer.max_steps=12", "--data.init_args.batch_size=4", "--slow-train", "1.0"]  # 6 RL steps
    _fit(tmp_path / "wait", *common)
    wait = _steps(tmp_path / "wait")
    assert max(s["async"]["async/staleness_max"] for s in wait) <= 1.0
    assert max(s["async"]["async/staleness_max"] for s in wait) == 1.0, "the producer never ran ahead"
    scalars = read_scalars(tmp_path / "wait" / "tb")
    for key in ("staleness_mean", "staleness_max", "dropped", "queue_depth", "producer_idle", "consumer_idle"):
        assert f"async/{key}" in scalars, f"async/{key} not logged"
    assert max(v for _, v in scalars["async/producer_idle"]) > 0.3, "the producer should wait for the slow trainer"
    _fit(tmp_path / "drop", *common, "--trainer.strategy.placement.init_args.max_staleness=0",
         "--trainer.strategy.placement.init_args.on_stale=drop", "--trainer.strategy.placement.init_args.queue_size=2")  # fmt: skip
    drop = _steps(tmp_path / "drop")
    assert drop[-1]["async"]["async/dropped"] >= 1, "a producer ahead of a slow trainer makes stale batches"
    for s in drop:  # a step either trained on a fresh batch or dropped a stale one (and counted it)
        assert s["async"]["async/staleness_max"] == 0.0 or s["trained"] is False
        assert s["trained"] is (s["async"]["async/staleness_max"] == 0.0)
    assert sum(not s["trained"] for s in drop) == drop[-1]["async"]["async/dropped"]


@pytest.mark.slow
@pytest.mark.distributed
def test_the_engine_applies_a_newer_version_mid_generation_and_samples_record_their_versions(tmp_path):
    """A slow producer (its engine sleeps 40 ms before each step: a generation of 32 tokens takes > 1.3 s)
    against quick updates (~0.2 s): the trainer publishes while the rollout rank generates, and its engine
    loads the new version between two of its steps (in-flight updates, on by default without ``fixed_lag``);
    a sample records the first and last version of its tokens, and its staleness counts from the first."""
    _fit(tmp_path / "live", "--trainer.max_steps=10", "--data.init_args.batch_size=4", "--slow-generate", "0.04",
         "--model.init_args.sampling.max_new_tokens=32")  # fmt: skip
    steps = _steps(tmp_path / "live")
    assert len(steps) == 5
    for s in steps:  # trained at version s (one update a step), on tokens of versions s - 1 .. s
        firsts, lasts = [v[0] for v in s["versions"]], [v[1] for v in s["versions"]]
        assert len(s["versions"]) == len(s["completions"])
        assert min(firsts) >= max(0, s["step"] - 1) and max(lasts) <= s["step"]
        assert all(a <= b for a, b in s["versions"])
        assert s["async"]["async/staleness_max"] == s["step"] - min(firsts)
        assert s["async"]["async/version_span_max"] == max(b - a for a, b in s["versions"])
    # From step 2 on the producer starts step s with version s - 1 while the trainer trains step s - 1 and
    # publishes version s, ~1 s before the generation ends.
    spanned = [s["step"] for s in steps if s["async"]["async/version_span_max"] >= 1]
    assert len(spanned) >= 2, f"a version should land mid-generation; spans only at steps {spanned}"


def _saver(dirpath, every: int) -> str:
    return json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
                        "init_args": {"every_n_steps": every, "dirpath": str(dirpath)}}])  # fmt: skip


def _fit_alone(out, *args, timeout=300) -> subprocess.CompletedProcess:
    """A run in its own process group (``--kill sigkill`` kills that group)."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(SCRIPT), str(out), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip


def _records(out) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "record.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}  # a resumed run's rows replace the killed run's


@pytest.mark.slow
@pytest.mark.distributed
def test_a_deterministic_run_stopped_by_sigterm_then_killed_resumes_bitwise(tmp_path):
    """``fixed_lag`` (max_staleness 1), checkpoints every 2 RL steps. SIGTERM reaches the rollout rank only, as
    its step 3 starts: the trainers save at their next safe point (holding the batch generated ahead of them)
    and both ranks exit 143. Resumed, the trainer SIGKILLs the whole run at step 6. Resumed again, SIGTERM
    reaches the trainer as its step 6 starts, within queue_size - 1 steps of the end: the rollout rank follows
    that decision after producing step 7, its last, and is saved there. Resumed a last time, the rollout rank
    has no step left but still follows the trainers to their end: the run ends at once (a wait would time
    out). Every step's samples and rewards and the final weights equal those of a run never interrupted."""
    from safetensors.torch import load_file

    common = ["--trainer.max_steps=16", "--data.init_args.batch_size=4",  # 8 RL steps of 2 optimizer steps
              "--trainer.strategy.placement.init_args.fixed_lag=true"]  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _fit(whole, *common, "--trainer.callbacks", _saver(whole / "ckpts", 4))
    saver = ["--trainer.callbacks", _saver(cut / "ckpts", 4), "--trainer.strategy.placement.init_args.timeout_s=150"]

    first = _fit_alone(cut, "--kill", "sigterm-rollout:3", *common, *saver)
    log = first.stdout + first.stderr
    assert first.returncode == 128 + signal.SIGTERM, log[-4000:]
    stopped = re.findall(r"preemption: received SIGTERM; saved step (\d+) to \S+; stopping training", log)
    assert len(stopped) == 2 and stopped[0] == stopped[1], "both ranks stop after saving the same step"
    saved = int(stopped[0])
    assert saved in (6, 8), f"the trainer one step behind the rollout rank saves at its next safe point, not {saved}"
    assert f"checkpoint saved: step {saved}" in log

    second = _fit_alone(cut, "--kill", "sigkill:6", *common, *saver, "--ckpt_path", "last")
    log = second.stdout + second.stderr
    assert second.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), log[-4000:]
    assert f"resuming from {cut / 'ckpts'}/step-{saved:08d}" in log
    reported = [int(m) for m in re.findall(r"checkpoint saved: step (\d+)", log)]

    third = _fit_alone(cut, "--kill", "sigterm-train:6", *common, *saver, "--ckpt_path", "last")
    log = third.stdout + third.stderr
    assert third.returncode == 128 + signal.SIGTERM, log[-4000:]
    assert f"resuming from {cut / 'ckpts'}/step-{max(reported, default=saved):08d}" in log
    assert len(re.findall(r"received SIGTERM; saved step 14 to", log)) == 2, log[-4000:]

    t0 = time.monotonic()
    last = _fit_alone(cut, *common, *saver, "--ckpt_path", "last")
    log = last.stdout + last.stderr
    assert last.returncode == 0, log[-4000:]
    assert f"resuming from {cut / 'ckpts'}/step-00000014" in log
    # a wait would last the 150 s timeout; the run itself takes 25-60 s (the latter with the machine loaded)
    assert time.monotonic() - t0 < 120, "the resumed run waited for the rollout rank"

    a, b = _records(whole), _records(cut)
    assert sorted(a) == sorted(b) == list(range(8))
    for step in a:
        assert a[step]["completions"] == b[step]["completions"], f"step {step}: different samples"
        assert a[step]["rewards"] == b[step]["rewards"], f"step {step}: different rewards"
        assert a[step]["async"]["async/version"] == b[step]["async"]["async/version"] == max(0, step - 1)
    wa, wb = load_file(whole / "weights.safetensors"), load_file(cut / "weights.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run's final weights differ"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rollout_rank_that_raises_stops_both_ranks_with_its_cause_and_both_save_what_they_reached(tmp_path):
    """The reward raises on the rollout rank as it scores step 3 (batches 0-2 sent). The trainer trains them,
    and both ranks save that state (no save was scheduled) before they stop with the cause; resumed, the run
    goes on past the failed step's batch to its end."""
    out = tmp_path / "fail"
    args = ["--trainer.max_steps=12", "--data.init_args.batch_size=4", "--trainer.callbacks", _saver(out / "ckpts", 100)]
    t0 = time.monotonic()
    result = _fit(out, *args, "--fail-at", "3", timeout=300, check=False)
    elapsed = time.monotonic() - t0
    assert result.returncode == 1, (result.stdout + result.stderr)[-4000:]  # a run-time failure
    text = result.stdout + result.stderr
    assert "the reward service is down (injected)" in text
    assert "rank 1" in text, "the trainer's error names the rollout rank"
    assert elapsed < 240, f"both ranks should stop within a bounded time, took {elapsed:.0f} s"
    saved = re.findall(r"the trainers' state after step (\d+) and the rollout rank's after the last batch it sent", text)
    assert saved == ["6", "6"], text[-4000:]  # both ranks: 3 RL steps of 2 optimizer steps
    assert "checkpoint saved: step 6" in text
    resumed = _fit(out, *args, "--fail-at", "99", "--ckpt_path", "last", timeout=300)
    assert f"resuming from {out / 'ckpts'}/step-00000006" in resumed.stdout + resumed.stderr
    assert sorted(_records(out)) == list(range(6))  # steps 0-2 before, 3-5 after (on the rows after step 3's)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_async_tiny_config_learns_on_two_trainers_and_a_rollout_rank_and_logs_its_async_figures(tmp_path):
    """``yatt fit --config configs/grpo_async_tiny.yaml --trainer.devices 3`` with ``rollout_ranks [2]`` (2
    data-parallel trainers, each training half of the rollout rank's batch; 150 RL steps), as a user runs it."""
    yatt(["fit", "--config", str(REPO / "configs" / "grpo_async_tiny.yaml"), "--trainer.devices", "3",
          "--trainer.strategy.placement.init_args.rollout_ranks", "[2]",
          f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}"], cwd=tmp_path, timeout=600)  # fmt: skip
    scalars = read_scalars(tmp_path / "tb")
    rewards = [v for _, v in scalars["reward/mean"]]
    assert len(rewards) == 150
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.4, f"first 10 steps {first:.3f}, last 10 {last:.3f}"
    staleness = [v for _, v in scalars["async/staleness_max"]]
    # the first batch is generated by version 0 and trained at it; later ones run one version behind at most,
    # and do so (the producer overlaps the trainers)
    assert staleness[0] == 0.0 and set(staleness) <= {0.0, 1.0} and staleness.count(1.0) > len(staleness) // 2
    for key in ("staleness_mean", "dropped", "queue_depth", "producer_idle", "consumer_idle"):
        assert f"async/{key}" in scalars, f"async/{key} not logged"
    for rank in (0, 1):  # a long single-turn run accumulates nothing on either trainer (tests/test_soak.py: agents)
        grown = growth(scalars, rank)
        assert grown["threads"] <= 5 and grown["fds"] <= 8 and grown["rss_gb_per_100"] < 0.05, (rank, grown)


@pytest.mark.slow
@pytest.mark.distributed
def test_dapo_runs_disaggregated_rounds_without_an_update_publish_nothing_and_both_sides_stop(tmp_path):
    """``configs/dapo_async_tiny.yaml`` (dynamic sampling, ``on_stale: drop``) for 20 rounds, updating on 16
    informative groups (a round of 16 prompts has 13-16 early on): the trainer keeps each round's informative
    groups and updates when it holds 16; a round that filled no update publishes no version, and both sides
    still count every round, so the run ends at ``max_steps`` (a side that miscounted would wait out its
    timeout). The config as shipped (12 groups, 150 rounds) learns: -0.05 -> 0.415 mean reward, first 10
    rounds against the last 10 (bench/RESULTS.md)."""
    yatt(["fit", "--config", str(REPO / "configs" / "dapo_async_tiny.yaml"), "--trainer.max_steps", "40",
          "--model.init_args.dynamic_sampling.groups_per_update", "16", "--trainer.callbacks", "[]",
          f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}"], cwd=tmp_path, timeout=300)  # fmt: skip
    scalars = read_scalars(tmp_path / "tb")
    rounds = [v for _, v in scalars["sampling/rounds"]]
    versions = [v for _, v in scalars["async/version"]]  # what each round generated with: the updates so far
    assert len(rounds) == 20 and len(scalars["reward/mean"]) == 20
    assert max(rounds) > 1, "no round carried its groups to the next"
    assert 1 <= versions[-1] < 18, versions  # rounds without an update published nothing
