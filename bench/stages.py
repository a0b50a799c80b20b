"""The stages other than RL, as a user runs them: SFT, SFT -> GRPO, DPO, on-policy distillation.

Every run is the real `yatt` command on a config of configs/ (one process, one torch thread), read back
from its TensorBoard file:

- ``sft_loss_drop``: 1 - held-out loss after configs/sft_tiny.yaml / before it (target >= 0.5). The held-out
  rows' prompts occur in no training row: the configs draw prompts of 1 to 4 letters (104 distinct) and split
  them by a fixed rule (``AlphabetTask.is_held_out``: 26 held out); the bench prints the split it ran on.
- ``rl_steps_to_half_from_sft`` / ``rl_steps_to_half_from_scratch``: the first RL step (1-based) whose mean
  reward reaches 0.5, for configs/grpo_tiny.yaml started from the SFT run's checkpoint folder (the README's
  second command: exported once, loaded by Megatron and vLLM) and from the random initialisation (``>N``:
  not within the N steps run; target: from SFT in at most half the steps from scratch).
- ``dpo_heldout_accuracy``: configs/dpo_tiny.yaml's held-out accuracy at the end (the chosen answer's
  implicit reward above the rejected's; it starts at 0.5, the policy equal to its reference; target >= 0.8),
  on pairs whose prompts occur in no training pair (the same split as SFT's).
- ``distill_kl_drop``: 1 - the student's mean per-token KL to the teacher over the last 10 steps of
  configs/distill_tiny.yaml / over its first 5 (target >= 0.5); ``distill_reward_gap``: the teacher's mean
  task reward (its own samples, 10 steps at a learning rate of 1e-12) minus the student's over the last 10
  steps (target <= 0.1).

    python bench/stages.py [--smoke]

``--smoke`` (tests/test_benches.py): SFT 60 steps (40 were enough when the held-out prompts were training
prompts; on the disjoint split GRPO from a 40-step SFT stayed under 0.5 for 2 steps), GRPO from SFT 2 steps, DPO 10 steps, distillation 25
steps; no GRPO from scratch and no teacher run (printed as ``skipped``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _common import REPO, fit, pop_smoke


def steps_to(values: list[float], level: float) -> str:
    return next((str(k + 1) for k, v in enumerate(values) if v >= level), f">{len(values)}")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def split(config: str) -> str:
    """How a stage's config splits its rows: distinct prompts in training and held out, and how many are shared."""
    import importlib

    import yaml

    data = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())["data"]["init_args"]
    rows = {}
    for key in ("task", "val_task"):
        module, _, name = data[key]["class_path"].rpartition(".")
        rows[key] = getattr(importlib.import_module(module), name)(**data[key].get("init_args", {})).rows()
    train, held = ({r["prompt"] for r in rows[k]} for k in ("task", "val_task"))
    return (f"{config} split: {len(rows['task'])} training rows over {len(train)} prompts, {len(rows['val_task'])} "
            f"held-out rows over {len(held)} prompts, {len(train & held)} held-out prompts in training "
            f"(held out: the last letter's index + letters shown = 0 mod 4)")  # fmt: skip


def main() -> None:
    smoke = pop_smoke(sys.argv)
    work = Path(tempfile.mkdtemp(prefix="yatt-stages-"))
    steps = (
        {"sft": 60, "rl": 2, "dpo": 10, "distill": 25} if smoke else {"sft": 60, "rl": 100, "dpo": 30, "distill": 100}
    )
    print(split("sft_tiny"))
    print(split("dpo_tiny"))
    sft = fit("sft_tiny", work / "sft", "--trainer.max_steps", str(steps["sft"]))
    val = sft["sft/val_loss"]
    print(f"SFT held-out loss: {val[0]:.3f} before, {val[-1]:.3f} after {steps['sft']} steps")
    rl = ["--trainer.callbacks", "[]", "--trainer.max_steps"]
    checkpoints = str(work / "sft" / "sft_tiny" / "checkpoints")
    from_sft = fit(
        "grpo_tiny", work / "rl_sft", *rl, str(min(steps["rl"], 10)), "--model.init_args.policy.path", checkpoints
    )
    from_sft_steps = steps_to(from_sft["reward/mean"], 0.5)
    scratch_steps = "skipped"
    if not smoke:
        scratch = fit("grpo_tiny", work / "rl_scratch", *rl, str(steps["rl"]))
        scratch_steps = steps_to(scratch["reward/mean"], 0.5)
    print(f"GRPO mean reward at step 1: {from_sft['reward/mean'][0]:.3f} from SFT")
    # vLLM's logprobs of its samples against the Megatron policy's, both loaded from the SFT checkpoint's export
    print(f"sft_export_engine_vs_policy_logprob_diff={from_sft['rollout/logprob_diff_max'][0]:.2e}")
    dpo = fit("dpo_tiny", work / "dpo", "--trainer.max_steps", str(steps["dpo"]), "--trainer.val_check_interval",
              str(steps["dpo"]))  # fmt: skip
    acc = dpo["dpo/val_accuracy"]
    print(f"DPO held-out accuracy: {acc[0]:.3f} before, {acc[-1]:.3f} after {steps['dpo']} steps")
    distill = fit("distill_tiny", work / "distill", *rl, str(steps["distill"]))
    kl, task = distill["reward/teacher_kl/kl/mean"], distill["reward/alphabet/mean"]
    window = min(10, len(kl) // 3)
    kl_drop = 1 - mean(kl[-window:]) / mean(kl[:5])
    gap = "skipped"
    print(f"distillation: per-token KL {mean(kl[:5]):.3f} -> {mean(kl[-window:]):.3f}, task reward "
          f"{mean(task[:5]):.3f} -> {mean(task[-window:]):.3f}")  # fmt: skip
    if not smoke:
        teacher = fit("distill_tiny", work / "teacher", *rl, "10", "--model.init_args.policy.path",
                      "builtin:tiny-qwen2-sft", "--model.init_args.optimizer.lr", "1e-12")  # fmt: skip
        gap = f"{mean(teacher['reward/alphabet/mean']) - mean(task[-window:]):.3f}"
        print(f"teacher's task reward: {mean(teacher['reward/alphabet/mean']):.3f}")
    print(
        f"sft_loss_drop={1 - val[-1] / val[0]:.3f} rl_steps_to_half_from_sft={from_sft_steps} "
        f"rl_steps_to_half_from_scratch={scratch_steps} dpo_heldout_accuracy={acc[-1]:.3f} "
        f"distill_kl_drop={kl_drop:.3f} distill_reward_gap={gap}"
    )


if __name__ == "__main__":
    main()
