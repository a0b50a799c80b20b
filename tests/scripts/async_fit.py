"""Run ``yatt fit`` (the real CLI) and record, per step, what was trained on; for the asynchronous tests.

    python tests/scripts/async_fit.py OUT_DIR [--slow-train SECONDS] [--slow-generate SECONDS] [--fail-at STEP]
                                      [--kill WHAT:STEP] [--base CONFIG] [yatt fit overrides...]

Writes OUT_DIR/steps.json (on the rank that trains first: per step its completions' token ids, rewards
and the async figures; also appended as it goes to OUT_DIR/record.jsonl, across resumed runs) and
OUT_DIR/weights.safetensors (the final policy under Hugging Face names); every trainer writes its steps to
OUT_DIR/steps.rank<r>.json, every rollout rank the version its engine held at each step it produced to
OUT_DIR/produced.rank<r>.json (across resumed runs: appended). ``--slow-train``: every training
step sleeps that long first (a slow consumer); ``--slow-generate``: the rollout rank's engine sleeps that
long before each of its steps (a slow producer, in whose generations a published version lands).
``--fail-at``: the reward raises at that step on the rank that scores (a failing rollout rank).
``--kill sigterm-rollout:STEP`` (``sigterm-train:STEP``): the rollout rank (the trainer) sends itself
SIGTERM as its RL step STEP starts; ``--kill sigkill:STEP``: the trainer SIGKILLs the run's process group
as its RL step STEP starts. ``--base``: the config (default ``configs/grpo_async_tiny.yaml``; a colocated
one trains and rolls out on every rank). The run is the real ``yatt fit`` (``--ckpt_path last``, the exit
code 128 + signal).
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

from lightning.pytorch import Callback  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from yatt_lightning.module import RLHFModule  # noqa: E402

FAIL_AT = {"step": -1}


def failing_reward(prompt: str, completion: str, **row) -> float:
    """The alphabet reward, raising at ``--fail-at``'s step (where the rows say so)."""
    from yatt_lightning.rewards.rules import alphabet_reward

    if row.get("fail_injected"):
        raise RuntimeError("the reward service is down (injected)")
    return alphabet_reward(prompt, completion, **row)


class PlainTensorReward(RLHFModule):
    """A user's ``reward`` override that returns a plain ``[N]`` tensor (the hook allows it), for any placement:
    ``--model.class_path tests.scripts.async_fit.PlainTensorReward``."""

    def reward(self, rollouts):
        return super().reward(rollouts).total.clone()


class Record(Callback):
    def __init__(self, out: Path, slow: float, fail_at: int, kill: tuple[str, int] | None, slow_generate: float) -> None:
        self.out, self.slow, self.fail_at, self.kill, self.steps = out, slow, fail_at, kill, []
        self.slow_generate = slow_generate

    def on_train_start(self, trainer, module) -> None:
        if self.slow_generate and trainer.strategy.role.only_rolls_out:
            live = trainer.strategy.placement.live  # the engine asks it for newer weights before each of its steps
            newer = live.newer

            def slow_newer():
                time.sleep(self.slow_generate)
                return newer()

            live.newer = slow_newer

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        role = trainer.strategy.role
        step = getattr(trainer.strategy.placement, "steps", batch_idx)  # the RL step (colocated: the batch)
        if self.kill == (f"sigterm-{role}", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.kill == ("sigkill", step) and role.trains:
            os.write(1, f"FAULT: SIGKILL at step {step}\n".encode())
            os.killpg(os.getpgid(0), signal.SIGKILL)
        if self.slow and role.trains:
            time.sleep(self.slow)
        if batch_idx == self.fail_at and not role.only_trains:
            for row in batch:
                row["fail_injected"] = True

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.strategy.role.only_rolls_out:
            placement = trainer.strategy.placement
            with open(self.out / f"produced.rank{trainer.global_rank}.json", "a") as f:
                f.write(json.dumps({"step": placement.steps - 1, "version": placement.engine_version}) + "\n")
            return
        if outputs is None:
            return
        rollouts = module.last_rollouts
        scalars = outputs["stats"].scalars
        self.steps.append({
            # the RL step (colocated: the optimizer step, one per RL step in these runs, resumed or not)
            "step": getattr(trainer.strategy.placement, "steps", trainer.global_step) - 1,
            "completions": [list(c) for c in rollouts.completion_ids],
            "prompts": [list(p) for p in rollouts.prompt_ids],
            "rewards": rollouts.rewards.tolist(),
            "versions": [list(v) for v in rollouts.versions or []],
            "async": {k: v for k, v in scalars.items() if k.startswith("async/")},
            "trained": "actor/pg_loss" in scalars,
            "critic_loss": scalars.get("critic/value_loss"),  # PPO's critic, trained beside the policy
            "judge": scalars.get("reward/judge/mean"),  # a generative judge's mean score, where one scores
        })  # fmt: skip
        if trainer.global_rank == 0:
            with open(self.out / "record.jsonl", "a") as f:
                f.write(json.dumps(self.steps[-1]) + "\n")

    def on_train_end(self, trainer, module) -> None:
        if trainer.strategy.role.only_rolls_out:
            return
        weights = {name: t.clone() for name, t in module.policy.export_hf()}  # collective over the trainers
        (self.out / f"steps.rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))
        if trainer.global_rank == 0:
            from safetensors.torch import save_file

            save_file(weights, str(self.out / "weights.safetensors"))
            (self.out / "steps.json").write_text(json.dumps(self.steps))


def main() -> None:
    from yatt_lightning.run.cli import YattCLI
    from yatt_lightning.run.logging_setup import configure_logging

    out, args = Path(sys.argv[1]), sys.argv[2:]  # Lightning re-runs sys.argv for the other ranks: left as is
    slow = float(args[args.index("--slow-train") + 1]) if "--slow-train" in args else 0.0
    slow_generate = float(args[args.index("--slow-generate") + 1]) if "--slow-generate" in args else 0.0
    fail_at = int(args[args.index("--fail-at") + 1]) if "--fail-at" in args else -1
    kill = None
    if "--kill" in args:
        what, step = args[args.index("--kill") + 1].split(":")
        kill = (what, int(step))
    config = args[args.index("--base") + 1] if "--base" in args else str(REPO / "configs" / "grpo_async_tiny.yaml")
    for flag in ("--slow-train", "--slow-generate", "--fail-at", "--kill", "--base"):
        if flag in args:
            i = args.index(flag)
            del args[i : i + 2]
    out.mkdir(parents=True, exist_ok=True)
    overrides = [f"--trainer.logger.init_args.save_dir={out / 'tb'}"] + args
    if fail_at >= 0:
        overrides += ["--model.init_args.reward_fn=tests.scripts.async_fit.failing_reward"]
    configure_logging()

    class AsyncFitCLI(YattCLI):
        def before_fit(self) -> None:
            self.trainer.callbacks.append(Record(out, slow, fail_at, kill, slow_generate))
            super().before_fit()

    AsyncFitCLI(args=["fit", "--config", config, "--trainer.callbacks", "[]", *overrides], console=False)


if __name__ == "__main__":
    main()
