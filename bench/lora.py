"""LoRA against full fine-tuning, side by side in one run, from the same trained base.

The base is the small model (``builtin:small4-qwen2``, 13M parameters) after 6 steps of configs/sft_tiny.yaml:
it writes answers in the task's form and gets about half of them right. From its checkpoint folder two GRPO
runs of configs/grpo_tiny.yaml, equal but for what trains: the full weights (lr 3e-4) and LoRA rank 8 on
every projection (lr 3e-3, the base frozen, only the adapter pushed to vLLM after each update). Every figure
is read from the runs' own TensorBoard files and checkpoints:

- ``lora_gain`` / ``full_gain``: mean reward over the last 10 steps minus the first step's (the base's own
  samples, before any update); goals: ``lora_gain`` >= 0.3 and within 0.15 of ``full_gain``.
- ``trainable_share``: ``lora/trainable_params`` over the parameters in the full run's checkpoint (<= 0.05).
- ``sync_bytes_ratio``: ``rollout/push_bytes`` of the LoRA run over the full run's, per push (<= 0.05).
- ``optimizer_bytes_ratio``: the optimizer state in the LoRA run's last checkpoint over the full run's (<= 0.05).
- ``lora_logprob_diff``: the largest ``rollout/logprob_diff_max`` (engine vs Megatron policy, per token) of the
  LoRA run's steps after its first update (< 1e-3).

Before the last line, a third run (10 steps, ``lora.merge: true``) against the LoRA run's first 10: seconds a
step of the push and of the rollout after it, with the adapter pushed and with merged weights pushed.

    python bench/lora.py [--smoke]

``--smoke`` (tests/test_benches.py): the random tiny model as the base (no SFT), 2 GRPO steps each, no merged
run (the gains mean nothing there; the bytes and the logprobs do).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _common import fit, pop_smoke


def checkpoint_sizes(root: Path) -> tuple[int, int]:
    """(model parameters, optimizer state bytes) in the newest checkpoint under ``root``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from yatt_lightning.checkpoint import folder as ckpt

    (saves,) = {p.parent for p in root.rglob(ckpt.TRACKER)}
    metadata = FileSystemReader(str(ckpt.tracked(saves) / ckpt.WEIGHTS)).read_metadata().state_dict_metadata
    params = optimizer = 0
    for key, meta in metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        if key.startswith("model."):
            params += meta.size.numel()
        elif key.startswith("optimizer."):
            optimizer += meta.size.numel() * meta.properties.dtype.itemsize
    return params, optimizer


def gain(rewards: list[float]) -> float:
    last = rewards[-min(10, len(rewards) - 1) :]
    return sum(last) / len(last) - rewards[0]


def main() -> None:
    smoke = pop_smoke(sys.argv)
    work = Path(tempfile.mkdtemp(prefix="yatt-lora-"))
    base, rl_steps = "builtin:tiny-qwen2", 2  # the smoke size: the random tiny model, no SFT
    if not smoke:
        fit("sft_tiny", work / "sft", "--model.init_args.policy.path", "builtin:small4-qwen2", "--trainer.max_steps", "6",
            "--data.init_args.val_task", "null", "--trainer.num_sanity_val_steps", "0")  # fmt: skip
        base, rl_steps = str(work / "sft" / "sft_tiny" / "checkpoints"), 40
    common = ["--model.init_args.policy.path", base, "--trainer.max_steps", str(rl_steps)]
    full = fit("grpo_tiny", work / "full", *common, "--model.init_args.optimizer.lr", "3e-4")
    lora = fit("grpo_tiny", work / "lora", *common, "--model.init_args.optimizer.lr", "3e-3",
               "--model.init_args.lora", '{"rank": 8, "alpha": 16, "target_modules": "all-linear"}')  # fmt: skip
    if not smoke:  # `lora.merge`: the same adapters pushed merged into the weights, for the push's cost
        merged = fit("grpo_tiny", work / "merged", *common[:-1], "10", "--model.init_args.optimizer.lr", "3e-3",
                     "--model.init_args.lora", '{"rank": 8, "alpha": 16, "target_modules": "all-linear", "merge": true}')  # fmt: skip
        for name, run in (("adapter", lora), ("merged", merged)):
            steps = range(1, 10)  # every step after a push: vLLM reads a new adapter at its first request
            sync, roll = (sum(run[f"time/{t}"][k] for k in steps) / len(steps) for t in ("sync", "rollout"))
            print(f"{name} push: {run['rollout/push_bytes'][-1]:.0f} bytes, {sync:.3f} s push + {roll:.3f} s rollout a "
                  f"step (steps 2-10)")  # fmt: skip
    full_params, full_optimizer = checkpoint_sizes(work / "full")
    lora_params, lora_optimizer = checkpoint_sizes(work / "lora")
    trainable = lora["lora/trainable_params"][-1]
    assert lora_params == trainable, (lora_params, trainable)  # the LoRA checkpoint holds the adapters only
    pushes = full["rollout/push_bytes"], lora["rollout/push_bytes"]
    for name, run in (("full", full), ("LoRA", lora)):
        print(f"{name}: reward {run['reward/mean'][0]:.3f} at step 1 -> {gain(run['reward/mean']) + run['reward/mean'][0]:.3f} "
              f"over the last steps; {run['rollout/push_bytes'][-1]:.0f} bytes per push")  # fmt: skip
    print(f"parameters {full_params}, adapters {trainable:.0f}; optimizer state {full_optimizer} / {lora_optimizer} bytes")
    print(
        f"lora_gain={gain(lora['reward/mean']):.3f} full_gain={gain(full['reward/mean']):.3f} "
        f"trainable_share={trainable / full_params:.4f} sync_bytes_ratio={pushes[1][-1] / pushes[0][-1]:.4f} "
        f"optimizer_bytes_ratio={lora_optimizer / full_optimizer:.4f} "
        f"lora_logprob_diff={max(lora['rollout/logprob_diff_max'][1:]):.2e}"
    )


if __name__ == "__main__":
    main()
