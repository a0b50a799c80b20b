"""A real `yatt fit` of a stage's config (SFT, DPO) that keeps what the stage tests compare.

    python tests/scripts/stage_run.py OUT_DIR CONFIG [--kill-after STEP] [yatt CLI overrides...]

At the end it writes the final policy under Hugging Face names (OUT_DIR/final.safetensors) and the Megatron
policy's logits for fixed token ids (OUT_DIR/logits.pt); logs go to OUT_DIR/tb. ``--kill-after STEP``
SIGKILLs the whole process group once step STEP has trained (a run killed without warning).
"""

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

if __name__ == "__main__":
    from lightning.pytorch import Callback
else:  # a spawned helper (the checkpoint writers' queue) re-imports this file: it needs none of this
    Callback = object


class Keep(Callback):
    def __init__(self, out: Path, kill_after: int) -> None:
        self.out, self.kill_after = out, kill_after

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.kill_after:
            os.write(1, f"FAULT: SIGKILL after step {self.kill_after}\n".encode())
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_train_end(self, trainer, module) -> None:
        from faults import save_final  # this folder is on the path of a script run from it

        save_final(trainer, module, self.out)


def main() -> None:
    from yatt_lightning.run.cli import YattCLI
    from yatt_lightning.run.logging_setup import configure_logging

    args = sys.argv[1:]  # Lightning re-runs this command line for the other ranks: leave sys.argv as it is
    out, config = Path(args.pop(0)), args.pop(0)
    out.mkdir(parents=True, exist_ok=True)
    kill_after = -1
    if args and args[0] == "--kill-after":
        kill_after, args = int(args[1]), args[2:]

    configure_logging()

    class StageCLI(YattCLI):
        def before_fit(self) -> None:
            self.trainer.callbacks.append(Keep(out, kill_after))
            super().before_fit()

    StageCLI(
        args=["fit", "--config", config, "--trainer.enable_checkpointing", "false",
              "--trainer.logger.init_args.save_dir", str(out / "tb"), *args],
        console=False,
    )  # fmt: skip


if __name__ == "__main__":
    main()
