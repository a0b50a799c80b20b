"""A real `yatt fit` run with instrumentation for the checkpoint tests.

    python tests/scripts/faults.py OUT_DIR [--kill PHASE:STEP] [yatt CLI overrides...]

Records, per RL step, the prompt ids each rank trained on and the logged reward/loss (OUT_DIR/
record_rank<r>.jsonl, appended across resumed runs) and writes the final policy under Hugging Face
names (OUT_DIR/final.safetensors; with PPO's critic also its parameters, as ``critic.<name>``). ``--kill PHASE:STEP`` SIGKILLs the whole process group at step STEP:
in the middle of the rollout (``rollout``), after the first of two optimizer steps (``train``), while a
checkpoint's background writers run (``save``), or after a checkpoint's manifest is written but before
its folder is renamed (``finalize``). ``--kill sigterm:STEP`` sends SIGTERM to rank 0 only (preemption),
``--kill sigterm-group:STEP`` to every process of the run, checkpoint writers included (SLURM's way),
``--kill raise:STEP`` raises an exception in the rollout. ``--kill window:STEP:F`` SIGKILLs the group at a
fraction F (0-1) of the way through the finalisation window of step STEP's checkpoint, from the start of
the manifest's write to the ``latest`` tracker's replacement (see FinalisationWindow); rank 0 prints how
long each finalisation and its window took. At the end it also saves the Megatron policy's logits for
fixed token ids (OUT_DIR/logits.pt) for the export test.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

if __name__ == "__main__":
    from lightning.pytorch import Callback

    from yatt_lightning.module import RLHFModule
else:  # a spawned helper (the checkpoint writers' results queue) re-imports this file as `__mp_main__`:
    Callback = RLHFModule = object  # it needs none of this, and importing torch there costs ~7 s of CPU per run

KILL = {"phase": None, "step": -1, "fraction": 0.0}


def die(where: str) -> None:
    os.write(1, f"FAULT: SIGKILL {where}\n".encode())  # not print(): this may run in a signal handler
    os.killpg(os.getpgid(0), signal.SIGKILL)


class FinalisationWindow:
    """Wraps ``checkpoint.finalize`` and ``checkpoint._write_durable``: times each finalisation on rank 0
    and its tail from the moment the manifest starts being written (manifest, fsyncs, rename of the .tmp
    folder, replacement of the ``latest`` tracker), and for ``--kill window:STEP:F`` SIGKILLs the group
    F x (the median tail of this run's earlier finalisations but its first two, which are slower) into
    the tail of step STEP's, or at its end if it is shorter. The kill comes from an interval timer: its
    SIGALRM handler runs in the main thread between two bytecodes of the finalisation, or right after the
    system call in progress."""

    def __init__(self, ckpt) -> None:
        self.tails_ms: list[float] = []
        self._finalize, self._write_durable = ckpt.finalize, ckpt._write_durable
        self._manifest = ckpt.MANIFEST
        self._armed = False
        self._tail_start: float | None = None
        self._delay_ms = 0.0

    def finalize(self, strategy, final) -> None:
        step = int(Path(final).name.split("-")[1])
        self._armed = KILL["phase"] == "window" and step == KILL["step"] and strategy.is_global_zero
        self._tail_start = None
        t0 = time.perf_counter()
        self._finalize(strategy, final)
        end = time.perf_counter()
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            die(f"at the end of the finalisation of step {step} (its tail was shorter than {self._delay_ms:.2f} ms)")
        if strategy.is_global_zero and self._tail_start is not None:
            self.tails_ms.append((end - self._tail_start) * 1000)
            print(f"finalize of step {step} took {(end - t0) * 1000:.3f} ms, "
                  f"{self.tails_ms[-1]:.3f} ms of them from the manifest on", flush=True)  # fmt: skip

    def write_durable(self, path: Path, data: bytes, atomic: bool = False) -> None:
        if path.name == self._manifest and self._tail_start is None:  # rank 0, in finalize
            self._tail_start = time.perf_counter()
            if self._armed:
                warm = sorted(self.tails_ms[2:] or self.tails_ms or [2.0])
                self._delay_ms = KILL["fraction"] * warm[len(warm) // 2]
                where = (f"{self._delay_ms:.2f} ms after the manifest of step {KILL['step']} began "
                         f"({KILL['fraction']:.2f} of {warm[len(warm) // 2]:.2f} ms)")  # fmt: skip
                signal.signal(signal.SIGALRM, lambda signum, frame: die(where))
                signal.setitimer(signal.ITIMER_REAL, self._delay_ms / 1000)
        self._write_durable(path, data, atomic)


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

    def update(self, rollouts, advantages):
        if KILL["phase"] == "train" and self.trainer.global_step == KILL["step"]:
            original = self.optimizers().step

            def step_then_die(*args, **kwargs):
                original(*args, **kwargs)
                die(f"after the first optimizer step of step {KILL['step']}")

            self.optimizers().step = step_then_die
        return super().update(rollouts, advantages)


class Recorder(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.updates = 0  # the optimizer step of the last row (rows are per update)

    def on_train_start(self, trainer, module) -> None:
        self.updates = trainer.global_step  # a resumed run's

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        # No update this round (partial rollouts: no group finished yet; dynamic sampling: not enough groups)
        if not outputs or trainer.global_step == self.updates:
            return
        self.updates = trainer.global_step
        row = {
            "step": trainer.global_step,
            "ids": [r["_id"] for r in batch],
            "reward": float(metrics["reward/mean"]),
            "pg_loss": float(metrics["actor/pg_loss"]),
        }
        if "critic/value_loss" in metrics:  # PPO: the critic's loss, which its resumed state decides
            row["value_loss"] = float(metrics["critic/value_loss"])
        with open(self.out / f"record_rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        savers = [cb for cb in trainer.callbacks if type(cb).__name__ == "AsyncCheckpoint"]
        if KILL["phase"] == "save" and trainer.global_step == KILL["step"] and savers and savers[0]._pending:
            die(f"while the checkpoint of step {KILL['step']} is being written")

    def on_train_end(self, trainer, module) -> None:
        save_final(trainer, module, self.out)


def save_final(trainer, module, out: Path) -> None:
    """OUT/final.safetensors (the policy under Hugging Face names; PPO's critic as ``critic.<name>``, LoRA's
    adapters as ``adapter.<name>``) and
    OUT/logits.pt (the Megatron policy's logits for fixed token ids), from rank 0. Collective."""
    import torch

    weights = {n: t.clone() for n, t in module.policy.export_hf()}
    if getattr(module.policy, "lora", None) is not None:  # LoRA: the adapters too, as ``adapter.<PEFT name>``
        weights.update({f"adapter.{n}": t.clone() for n, t in module.policy.export_adapter()})
    critic = getattr(module, "critic_model", None)
    if critic is not None:  # PPO's critic (one process: its parameters are whole)
        weights.update({f"critic.{n}": p.detach().clone() for n, p in critic.local_module().named_parameters()})
    ids = torch.arange(2, 34).reshape(2, 16) * 7 % 290
    seen = []

    def keep(mb, logits):
        seen.append(logits.detach().clone())
        return torch.zeros(()), torch.tensor(1), {}

    module.policy.forward_backward([{"input_ids": ids}], keep, forward_only=True)
    if trainer.is_global_zero:
        from safetensors.torch import save_file

        save_file(weights, str(out / "final.safetensors"))
        if seen:  # one process, or rank 0 on the last pipeline stage
            torch.save({"ids": ids, "logits": seen[0]}, out / "logits.pt")


def main() -> None:
    from yatt_lightning.checkpoint import folder as ckpt
    from yatt_lightning.run.cli import YattCLI
    from yatt_lightning.run.logging_setup import configure_logging

    args = sys.argv[1:]  # Lightning re-runs this command line for the other ranks: leave sys.argv as it is
    out = Path(args.pop(0))
    out.mkdir(parents=True, exist_ok=True)
    if args and args[0] == "--kill":
        phase, step, *fraction = args[1].split(":")
        KILL.update(phase=phase, step=int(step), fraction=float(fraction[0]) if fraction else 0.0)
        args = args[2:]
    window = FinalisationWindow(ckpt)  # `begin` and `finalize` look these names up when they run
    ckpt.finalize, ckpt._write_durable = window.finalize, window.write_durable
    if KILL["phase"] == "finalize":
        original = ckpt._write_durable

        def write_then_die(path, data, atomic=False):
            original(path, data, atomic)
            if path.name == ckpt.MANIFEST and path.parent.name == ckpt.checkpoint_name(KILL["step"]) + ".tmp":
                die(f"after writing the manifest of step {KILL['step']}, before the rename")

        ckpt._write_durable = write_then_die
    configure_logging()
    config = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml")

    class FaultsCLI(YattCLI):
        """The real `yatt fit` (its `--ckpt_path last` included), with the recorder added."""

        def before_fit(self) -> None:
            self.trainer.callbacks.append(Recorder(out))
            super().before_fit()

    FaultsCLI(
        args=["fit", "--config", config, "--model.class_path", "__main__.Faulty", "--trainer.enable_checkpointing",
              "false", "--trainer.logger.init_args.save_dir", str(out / "tb"), *args],
        console=False,  # this script's own lines stay on stdout, where the tests read them
    )  # fmt: skip


if __name__ == "__main__":
    main()
