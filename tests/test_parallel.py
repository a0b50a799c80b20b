"""Tier 2/3: tensor, pipeline and data parallelism on 2 gloo processes (real Megatron-Core and vLLM)."""

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, SCRIPTS, read_scalars, read_texts, run, yatt

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAYOUTS = {
    "tp2": ["--trainer.strategy.tensor_model_parallel_size", "2"],
    "pp2": ["--trainer.strategy.pipeline_model_parallel_size", "2"],
    "dp2": [],
}


# tp2: test_tp2_engine_samples_what_a_tp1_engine_samples; dp2 (engine logprobs = policy's): test_launchers.py
@pytest.mark.parametrize("layout", ["pp2"])
def test_layout_trains_and_engine_matches_policy(layout, tmp_path):
    """grpo_tiny end to end on 2 processes; after the weight push the engine's logprobs equal the policy's
    (bench/rollout_consistency.py at its smoke size and more)."""
    proc = run(
        [sys.executable, str(REPO / "bench" / "rollout_consistency.py"), "--trainer.max_steps", "3",
         "--trainer.devices", "2", *LAYOUTS[layout]],
        cwd=tmp_path, timeout=500,
    )  # fmt: skip
    diff = float(re.search(r"^max_abs_logprob_diff=(\S+)$", proc.stdout, re.M).group(1))
    stale = float(re.search(r"stale \(initial weights\)\s+(\S+)", proc.stdout).group(1))
    assert "trained steps: 3" in proc.stdout
    assert diff < 1e-3
    assert stale > 1e-2


def test_tp2_engine_samples_what_a_tp1_engine_samples(tmp_path):
    """The engine in the loop under TP=2: one vLLM engine split across the 2 ranks, fed the gathered weights
    after every update, samples exactly the tokens a TP=1 engine samples for the same per-prompt seeds
    (vLLM's sampler draws from a per-request generator; in fp32 the row-parallel sums leave the logits
    within ~1e-7, too little to flip a sampled token here). So the rewards, lengths and sample texts are
    identical, the losses on those identical tokens agree to float precision, and the engine's logprobs
    match the TP-sharded policy's."""
    runs = {}
    for tp in (1, 2):
        root = tmp_path / f"tp{tp}"
        yatt(
            ["fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--trainer.max_steps", "3",
             "--trainer.devices", str(tp), "--trainer.strategy.tensor_model_parallel_size", str(tp),
             "--trainer.callbacks", "[]", "--trainer.default_root_dir", str(root)],
            cwd=tmp_path, timeout=500,
        )  # fmt: skip
        runs[tp] = read_scalars(root), read_texts(root)["rollout/samples/text_summary"]
    (one, one_text), (two, two_text) = runs[1], runs[2]
    assert two_text == one_text and len(two_text) == 3
    for tag in ("reward/mean", "response_length/mean"):
        assert [v for _, v in two[tag]] == [v for _, v in one[tag]], tag
    for tag in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert [v for _, v in two[tag]] == pytest.approx([v for _, v in one[tag]], rel=1e-5, abs=1e-6), tag
    assert max(v for _, v in two["rollout/logprob_diff_max"]) < 1e-3


def _train_fixed(out: Path, *overrides: str):
    common = [
        "--trainer.max_steps",
        "6",
        "--model.ppo_epochs",
        "2",
        "--model.micro_batch_size",
        "16",
        "--data.batch_size",
        "8",
        # PPO with its critic: GAE's whitening spans every DP rank, the value head is replicated over TP,
        # and the values reach every PP stage; a mistake in any of them changes the policy's weights.
        "--model.advantage_estimator",
        "yatt_lightning.algorithms.GAE",
        "--model.critic",
        '{"value_clip": 0.2, "optimizer": {"lr": 0.002, "clip_grad": 1.0}}',
    ]
    run([sys.executable, str(SCRIPTS / "train_fixed.py"), str(out), *common, *overrides], cwd=out.parent, timeout=500)
    from safetensors.torch import load_file

    return load_file(str(out / "weights.safetensors")), read_scalars(out / "tb")


def test_tp_pp_dp_match_a_single_process(tmp_path):
    """Same seed and data (fixed rollouts): TP=2, PP=2 and DP=2 reach TP=1's losses and weights, PPO's
    critic included (its value loss and mean value, and through GAE the policy's weights).

    6 optimizer steps (3 RL steps x 2 epochs) with gradient clipping; Adam amplifies float-reduction
    differences, hence the 1e-4 weight tolerance (the weights themselves are ~0.02-1)."""
    base_w, base_s = _train_fixed(tmp_path / "tp1", "--trainer.devices", "1", "--data.batch_size", "8")
    for name, layout in LAYOUTS.items():
        extra = ["--data.batch_size", "4"] if name == "dp2" else []  # 8 prompts per step in every layout
        w, s = _train_fixed(tmp_path / name, "--trainer.devices", "2", *layout, *extra)
        assert w.keys() == base_w.keys()
        worst = max((w[k] - base_w[k]).abs().max().item() for k in w)
        assert worst < 1e-4, f"{name}: weights differ from TP=1 by {worst}"
        for tag in ("actor/pg_loss", "reward/mean", "actor/grad_norm", "critic/value_loss", "critic/value_mean"):
            ours, ref = [v for _, v in s[tag]], [v for _, v in base_s[tag]]
            assert len(ours) == len(ref) == 3
            assert torch.allclose(torch.tensor(ours), torch.tensor(ref), atol=1e-5), (name, tag, ours, ref)


def test_a_reward_error_under_the_single_controller_stops_every_rank(tmp_path):
    """Rank 0 scores for everyone; when that fails, the others (waiting for their scores) learn of it."""
    (tmp_path / "flaky_reward.py").write_text(
        "def reward(prompt, completion, **row):\n    raise ZeroDivisionError('the reward server is down')\n"
    )
    proc = yatt(
        ["fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--trainer.max_steps", "2",
         "--trainer.devices", "2", "--trainer.strategy.controller", "yatt_lightning.rollout.controller.SingleController",
         "--model.reward_fn", "flaky_reward.reward", "--trainer.callbacks", "[]",
         "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")],
        cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "reward function flaky_reward.reward raised ZeroDivisionError: the reward server is down" in proc.stderr
    # rank 1 stopped too, instead of waiting for its scores; its consequence is in its log, not on the terminal
    assert proc.stderr.count("yatt: error:") == 1, proc.stderr[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "runs").rglob("output.rank1.log"))
    assert "another rank failed" in logs


def test_load_balancer_evens_tokens_without_changing_the_update(tmp_path):
    """DP=2 with DPLoadBalancer deciding by tokens (independent of the machine's timings; without a token
    budget it moves sequences wherever that lowers the heaviest rank's tokens): the imbalance (max/mean
    tokens per rank) drops to ~1, and because the loss is aggregated over all tokens of the step, the
    trained weights equal the unbalanced run's."""
    common = ["--trainer.devices", "2", "--data.batch_size", "4", "--model.micro_batch_size", "8"]
    plain_w, _ = _train_fixed(tmp_path / "plain", *common)
    balanced_w, scalars = _train_fixed(
        tmp_path / "balanced", *common, "--trainer.callbacks+=yatt_lightning.callbacks.DPLoadBalancer",
        "--trainer.callbacks.decide_by", "tokens",
    )  # fmt: skip
    before = [v for _, v in scalars["balance/imbalance_before"]]
    after = [v for _, v in scalars["balance/imbalance_after"]]
    moved = [v for _, v in scalars["balance/moved"]]
    assert len(after) == 3 and any(moved), moved
    assert all(a <= b + 1e-9 for a, b in zip(after, before, strict=True))
    assert all(a <= 1.05 and a < b for a, b, m in zip(after, before, moved, strict=True) if m)
    worst = max((balanced_w[k] - plain_w[k]).abs().max().item() for k in plain_w)
    assert worst < 1e-4
