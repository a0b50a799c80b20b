"""A `yatt fit` run with a judge that records every sample it scores, for the placement tests.

    python tests/scripts/placement_run.py OUT_DIR CONFIG [yatt CLI overrides...]

OUT_DIR/scored_rank<r>.jsonl: per judge call, the ``_id`` of every scored sample's prompt.
OUT_DIR/kept_rank<r>.jsonl: per step, the ``_id`` of every sample this rank kept for training.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from lightning.pytorch import Callback  # noqa: E402

from yatt_lightning.rewards.genrm import GenerativeRewardModel  # noqa: E402

OUT = Path(sys.argv[1])


class RecordingJudge(GenerativeRewardModel):
    def judge_prompts(self, prompts, completions, rows):  # every judgment, batched or streamed, starts here
        import torch.distributed as dist

        with open(OUT / f"scored_rank{dist.get_rank()}.jsonl", "a") as f:
            f.write(json.dumps([row["_id"] for row in rows]) + "\n")
        if os.environ.get("JUDGE_FAILS"):
            raise RuntimeError("the judge engine is unreachable")
        return super().judge_prompts(prompts, completions, rows)


class Kept(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        rows = module.last_rollouts.rows
        with open(OUT / f"kept_rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": batch_idx, "ids": [r["_id"] for r in rows]}) + "\n")


def main() -> None:
    import yaml

    from yatt_lightning.run.cli import YattCLI
    from yatt_lightning.run.logging_setup import configure_logging

    OUT.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(Path(sys.argv[2]).read_text())
    for reward in config["model"]["init_args"]["rewards"]:
        if reward["class_path"].endswith("GenerativeRewardModel"):
            reward["class_path"] = "__main__.RecordingJudge"
            reward["init_args"]["on_error"] = os.environ.get("JUDGE_ON_ERROR", "raise")
    mine = OUT / f"config.{os.getpid()}.yaml"  # every rank runs this: each replaces the file whole, so none
    mine.write_text(yaml.safe_dump(config))  # reads one another rank is writing (it read it empty once)
    os.replace(mine, OUT / "config.yaml")
    configure_logging()
    cli = YattCLI(
        args=["--config", str(OUT / "config.yaml"), "--trainer.logger.init_args.save_dir", str(OUT / "tb"),
              "--trainer.callbacks", "[]", *sys.argv[3:]],
        run=False,
    )  # fmt: skip
    cli.trainer.callbacks.append(Kept())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


if __name__ == "__main__":
    main()
