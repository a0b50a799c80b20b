"""Train a few steps on fixed, engine-independent rollouts and save what the equivalence test compares.

    python tests/scripts/train_fixed.py OUT_DIR [yatt CLI overrides...]

Writes OUT_DIR/weights.safetensors (the final policy under Hugging Face names, from rank 0) and logs
to OUT_DIR/tb. The rollouts depend only on the prompt rows, so any parallel layout trains on exactly the
same data and must reach the same losses and weights.
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402

from yatt_lightning.module import RLHFModule  # noqa: E402
from yatt_lightning.rollout.batch import RolloutBatch  # noqa: E402


class FixedRollouts(RLHFModule):
    """Completions drawn from a generator seeded by the prompt row, not by the engine (so none is started)."""

    needs_engine = False

    def rollout(self, batch):
        n = self.sampling.n
        prompt_ids = [self.tokenize_prompt(row) for row in batch]
        completions = []
        for row in batch:
            g = torch.Generator().manual_seed(1000 + row["_id"])
            for _ in range(n):
                length = int(torch.randint(2, self.sampling.max_new_tokens + 1, (1,), generator=g))
                completions.append(torch.randint(260, 296, (length,), generator=g).tolist())
        return RolloutBatch(
            prompts=[row["prompt"] for row in batch for _ in range(n)],
            prompt_ids=[p for p in prompt_ids for _ in range(n)],
            completion_ids=completions,
            completions=self.tokenizer.batch_decode(completions, skip_special_tokens=True),
            rows=[row for row in batch for _ in range(n)],
            group_ids=torch.arange(len(batch)).repeat_interleave(n),
            rollout_logprobs=[torch.zeros(len(c)) for c in completions],
            finish_reasons=["length"] * len(completions),
        )


class ExportAtEnd(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, module) -> None:
        weights = {name: t.clone() for name, t in module.policy.export_hf()}  # collective
        if trainer.is_global_zero:
            from safetensors.torch import save_file

            save_file(weights, str(self.path))


def main() -> None:
    from yatt_lightning.run.cli import YattCLI

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    config = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml")
    cli = YattCLI(
        args=["--config", config, "--model.class_path", "__main__.FixedRollouts", "--trainer.callbacks", "[]",
              "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", str(out / "tb"),
              *sys.argv[2:]],
        run=False,
    )  # fmt: skip
    cli.trainer.callbacks.append(ExportAtEnd(out / "weights.safetensors"))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


if __name__ == "__main__":
    main()
