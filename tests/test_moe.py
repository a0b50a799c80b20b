"""Tier 3: a mixture of experts trained with expert parallelism through the real CLI (tests/scripts/faults.py:
`yatt fit` plus a recorder). One run serves three checks: it learns with the engine holding the pushed experts,
its end resumes bit for bit from a checkpoint, and its checkpoint exports to a folder transformers loads."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, read_scalars, yatt

pytestmark = pytest.mark.slow

MOE = ["--trainer.devices", "2", "--trainer.strategy.expert_model_parallel_size", "2", "--model.max_prompt_tokens", "48"]
STEPS, SAVED = 60, 56


def _faults(out, folder, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "faults.py"), str(out), *MOE,
                           "--model.policy.path", str(folder), *args],
                          cwd=out.parent, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def _saver(dirpath) -> str:
    return json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
                        "init_args": {"every_n_steps": SAVED, "dirpath": str(dirpath)}}])  # fmt: skip


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A user's Qwen3-MoE folder (tests/user_models.py: plain ``save_pretrained``, ChatML; 8 experts of 64, top 2
    renormalised) on 2 processes at EP=2 (4 experts a rank), 60 GRPO steps of the alphabet task, checkpoints at
    step 56 and at the end."""
    from tests.user_models import build

    root = tmp_path_factory.mktemp("moe")
    folder = build("qwen3-moe", root / "qwen3-moe")
    out = root / "whole"
    out.mkdir()
    _faults(out, folder, "--trainer.max_steps", str(STEPS), "--trainer.callbacks", _saver(out / "ckpts"))
    return out, folder


def test_a_users_qwen3_moe_at_ep2_learns_with_the_engine_holding_every_pushed_expert(moe_run):
    """Rewards rise by more than 0.4 (first 10 steps' mean to the last 10's; measured 0.04 -> 0.51 at 60 steps);
    on every step the engine's logprobs of its samples equal the policy's (< 1e-3): each rank's engine received all
    8 experts, gathered over the expert-parallel group, and packed them for its CPU kernel (without that, 0.1 off
    from the first push on). The routing figures are logged every step: the load-balancing loss (1 when even)
    and the busiest expert's load over the mean (between 1 and experts / top-k = 4)."""
    scalars = read_scalars(moe_run[0] / "tb")
    rewards = [v for _, v in sorted(scalars["reward/mean"])]
    assert len(rewards) == STEPS
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last >= first + 0.4, (first, last)
    assert max(v for _, v in scalars["rollout/logprob_diff_max"]) < 1e-3
    aux = [v for _, v in scalars["moe/aux_loss"]]
    load = [v for _, v in scalars["moe/expert_load_max_over_mean"]]
    assert len(aux) == len(load) == STEPS
    assert all(0.9 < a < 2.0 for a in aux) and all(1.0 <= x <= 4.0 for x in load), (min(aux), max(aux), min(load), max(load))


def test_an_ep2_run_resumed_from_its_checkpoint_ends_bitwise_where_it_did(moe_run, tmp_path):
    """The run resumed from its step-56 checkpoint (where a run killed after it restarts) trains steps 57-60 on
    the same prompts to the same rewards and ends with the same weights, every expert bit for bit; and every
    tensor moved from the user's folder in training (so the engine's agreement on every step, above, covered
    pushes of every expert)."""
    from safetensors.torch import load_file

    whole, folder = moe_run
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(whole / "ckpts" / f"step-{SAVED:08d}", cut / "from" / f"step-{SAVED:08d}")
    log = _faults(cut, folder, "--trainer.max_steps", str(STEPS), "--trainer.callbacks", _saver(cut / "ckpts"),
                  "--ckpt_path", str(cut / "from" / f"step-{SAVED:08d}"))  # fmt: skip
    assert f"step-{SAVED:08d}" in log
    a, b = load_file(str(whole / "final.safetensors")), load_file(str(cut / "final.safetensors"))
    assert a.keys() == b.keys() and sum(".experts." in k for k in a) == 2 * 8 * 3
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    initial = load_file(str(folder / "model.safetensors"))
    assert initial.keys() == a.keys() and not [k for k in a if torch.equal(a[k], initial[k])]
    for rank in range(2):
        before = {r["step"]: r for r in map(json.loads, (whole / f"record_rank{rank}.jsonl").read_text().splitlines())}
        resumed = {r["step"]: r for r in map(json.loads, (cut / f"record_rank{rank}.jsonl").read_text().splitlines())}
        assert resumed.keys() == set(range(SAVED + 1, STEPS + 1)) and all(resumed[s] == before[s] for s in resumed)


def test_an_ep2_checkpoint_exports_a_folder_transformers_loads_with_the_policys_logits(moe_run, tmp_path):
    """`yatt export` of the EP=2 checkpoint (each layer's experts stacked by global number): transformers loads
    every tensor, with the trained policy's logits (< 1e-4) and tensors (bitwise, against the live export)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    whole, _ = moe_run
    out = tmp_path / "hf"
    yatt(["export", "--ckpt_dir", str(whole / "ckpts"), "--out", str(out)], cwd=tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = torch.load(whole / "logits.pt")
    with torch.no_grad():
        logits = model(saved["ids"]).logits
    assert (logits - saved["logits"]).abs().max() < 1e-4
    exported, live = load_file(str(out / "model.safetensors")), load_file(str(whole / "final.safetensors"))
    assert exported.keys() == live.keys() and all(torch.equal(exported[k], live[k]) for k in live)
