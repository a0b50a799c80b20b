"""A real `yatt fit` run with instrumentation for the checkpoint tests.

    python tests/scripts/faults.py OUT_DIR [--kill PHASE:STEP] [yatt CLI overrides...]

Records, per RL step, the prompt ids each rank trained on and the logged reward/loss (OUT_DIR/
record_rank<r>.jsonl, appended across resumed runs) and writes the final policy under Hugging Face
names (OUT_DIR/final.safetensors). ``--kill PHASE:STEP`` SIGKILLs the whole process group at step STEP:
in the middle of the rollout (``rollout``), after the first of two optimizer steps (``train``), while a
checkpoint's background writers run (``save``), or after a checkpoint's manifest is written but before
its folder is renamed (``finalize``). ``--kill sigterm:STEP`` sends SIGTERM to rank 0 only (preemption),
``--kill sigterm-group:STEP`` to every process of the run, checkpoint writers included (SLURM's way),
``--kill raise:STEP`` raises an exception in the rollout. At the end it also saves the Megatron policy's
logits for fixed token ids (OUT_DIR/logits.pt) for the export test.
"""

import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from lightning.pytorch import Callback  # noqa: E402

from yatt_lightning.module import RLHFModule  # noqa: E402

KILL = {"phase": None, "step": -1}


def die(where: str) -> None:
    print(f"FAULT: SIGKILL {where}", flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


class Faulty(RLHFModule):
    def rollout(self, batch):
        out = super().rollout(batch)
        if self.trainer.global_step == KILL["step"]:
            if KILL["phase"] == "rollout":
                die(f"during the rollout of step {KILL['step']}")
            if KILL["phase"] == "sigterm" and self.trainer.is_global_zero:
                os.kill(os.getpid(), signal.SIGTERM)
            if KILL["phase"] == "sigterm-group" and self.trainer.is_global_zero:
                os.killpg(os.getpgid(0), signal.SIGTERM)  # as SLURM does: every process of the job
            if KILL["phase"] == "raise":
                raise ValueError(f"injected failure in the rollout of step {KILL['step']}")
        return out

    def update(self, rollouts):
        if KILL["phase"] == "train" and self.trainer.global_step == KILL["step"]:
            original = self.optimizers().step

            def step_then_die(*args, **kwargs):
                original(*args, **kwargs)
                die(f"after the first optimizer step of step {KILL['step']}")

            self.optimizers().step = step_then_die
        return super().update(rollouts)


class Recorder(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        if not outputs:  # no update this step (partial rollouts: no group finished yet)
            return
        row = {
            "step": trainer.global_step,
            "ids": [r["_id"] for r in batch],
            "reward": float(metrics["reward/mean"]),
            "pg_loss": float(metrics["actor/pg_loss"]),
        }
        with open(self.out / f"record_rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        savers = [cb for cb in trainer.callbacks if type(cb).__name__ == "AsyncCheckpoint"]
        if KILL["phase"] == "save" and trainer.global_step == KILL["step"] and savers and savers[0]._pending:
            die(f"while the checkpoint of step {KILL['step']} is being written")

    def on_train_end(self, trainer, module) -> None:
        import torch

        weights = {n: t.clone() for n, t in module.policy.export_hf()}
        ids = torch.arange(2, 34).reshape(2, 16) * 7 % 290
        seen = []

        def keep(mb, logits):
            seen.append(logits.detach().clone())
            return torch.zeros(()), torch.tensor(1), {}

        module.policy.forward_backward([{"input_ids": ids}], keep, forward_only=True)
        if trainer.is_global_zero:
            from safetensors.torch import save_file

            save_file(weights, str(self.out / "final.safetensors"))
            torch.save({"ids": ids, "logits": seen[0]}, self.out / "logits.pt")


def main() -> None:
    from yatt_lightning import checkpoint as ckpt
    from yatt_lightning.cli import YattCLI
    from yatt_lightning.logging_setup import configure_logging

    args = sys.argv[1:]  # Lightning re-runs this command line for the other ranks: leave sys.argv as it is
    out = Path(args.pop(0))
    out.mkdir(parents=True, exist_ok=True)
    if args and args[0] == "--kill":
        phase, step = args[1].split(":")
        KILL.update(phase=phase, step=int(step))
        args = args[2:]
    if KILL["phase"] == "finalize":
        original = ckpt._write_durable

        def write_then_die(path, data, atomic=False):
            original(path, data, atomic)
            if path.name == ckpt.MANIFEST and path.parent.name == ckpt.checkpoint_name(KILL["step"]) + ".tmp":
                die(f"after writing the manifest of step {KILL['step']}, before the rename")

        ckpt._write_durable = write_then_die
    ckpt_path = None
    if "--ckpt_path" in args:
        i = args.index("--ckpt_path")
        ckpt_path = args[i + 1]
        del args[i : i + 2]
    configure_logging()
    config = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml")
    cli = YattCLI(
        args=["--config", config, "--model.class_path", "__main__.Faulty", "--trainer.enable_checkpointing", "false",
              "--trainer.logger.init_args.save_dir", str(out / "tb"), *args],
        run=False,
    )  # fmt: skip
    cli.trainer.callbacks.append(Recorder(out))
    if ckpt_path == "last":  # what `yatt fit --ckpt_path last` does
        saver = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "AsyncCheckpoint")
        target = ckpt.resume_target(saver.dirpath)
        ckpt_path = None if target is None else str(target)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
