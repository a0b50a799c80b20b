"""The ``yatt`` command: LightningCLI over RLHFModule, PromptDataModule and MegatronStrategy.

``yatt fit --config configs/grpo_tiny.yaml [--trainer.max_steps 20 ...]`` trains; ``--print_config``
shows the resolved configuration. Every ``__init__`` argument of the module, data module, strategy
and callbacks is a config key with its docstring in ``--help``.
"""

from __future__ import annotations

import os

# Before torch (and vLLM) are imported: one thread per process (two threads per process on a loaded
# 2-core machine made steps 3-10x slower), offline Hugging Face, vLLM in-process.
for _key, _value in {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)

from yatt_lightning.rollout.vllm_engine import set_vllm_env  # noqa: E402

set_vllm_env()

import torch  # noqa: E402
from jsonargparse import lazy_instance  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from yatt_lightning.datamodules.prompt import PromptDataModule  # noqa: E402
from yatt_lightning.logging_setup import quiet_third_party  # noqa: E402
from yatt_lightning.module import RLHFModule  # noqa: E402
from yatt_lightning.strategy import MegatronStrategy  # noqa: E402


class YattCLI(LightningCLI):
    """LightningCLI with yatt-lightning's defaults (strategy, logger, checkpointing, data sharding)."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            RLHFModule,
            PromptDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={
                "strategy": lazy_instance(MegatronStrategy),
                "accelerator": "auto",
                "devices": 1,
                "use_distributed_sampler": False,  # PromptDataModule shards by data-parallel rank itself
                "logger": lazy_instance(TensorBoardLogger, save_dir="runs", name="yatt"),
                "num_sanity_val_steps": 0,
                "log_every_n_steps": 1,
            },
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )


def main(args: list[str] | None = None) -> None:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    quiet_third_party()
    YattCLI(args=args)


if __name__ == "__main__":
    main()
