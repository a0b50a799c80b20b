"""Checkpoint folders: the policy and its optimizer sharded (Megatron ``dist_checkpointing``), plus each
rank's Lightning trainer state (loops, callbacks, data-loader position, RNG).

A checkpoint is written into ``<name>.tmp`` and renamed to ``<name>`` only after every rank finished,
so a folder with the final name is complete. Layout::

    step=20.ckpt/
      weights/              Megatron distributed checkpoint (model + optimizer), any TP/PP/DP layout
      trainer_rank0.pt      Lightning's checkpoint dict for rank 0 (without the model)
      trainer_rank1.pt      ...
      hf/                   the policy's Hugging Face config and tokenizer (for export)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from yatt_lightning.models.cpu import megatron_cpu_context

WEIGHTS = "weights"
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")  # fmt: skip


def trainer_state_file(folder: Path, rank: int) -> Path:
    return folder / f"trainer_rank{rank}.pt"


def _sharded_state(policy, *, is_loading: bool) -> dict:
    model_sd = policy.local_module().sharded_state_dict(prefix="model.")
    state = {"model": model_sd}
    if policy.optimizer is not None:
        state["optimizer"] = policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


def save(strategy, checkpoint: dict[str, Any], filepath) -> None:
    """Collective: every rank writes its shards and trainer state; the folder appears complete or not at all."""
    from megatron.core import dist_checkpointing

    final = Path(filepath)
    tmp = final.with_name(final.name + ".tmp")
    if strategy.is_global_zero:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / WEIGHTS).mkdir(parents=True)
        (tmp / "hf").mkdir()
        model_path = Path(strategy.lightning_module.model_path)
        for name in HF_FILES:
            if (model_path / name).is_file():
                shutil.copy2(model_path / name, tmp / "hf" / name)
    strategy.barrier("checkpoint-mkdir")
    policy = strategy.lightning_module.policy
    with megatron_cpu_context():
        dist_checkpointing.save(_sharded_state(policy, is_loading=False), str(tmp / WEIGHTS))
    torch.save(checkpoint, trainer_state_file(tmp, strategy.global_rank))
    strategy.barrier("checkpoint-written")
    if strategy.is_global_zero:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    strategy.barrier("checkpoint-renamed")


def load_trainer_state(strategy, filepath) -> dict[str, Any]:
    folder = Path(filepath)
    state_file = trainer_state_file(folder, strategy.global_rank)
    if not (folder / WEIGHTS).is_dir() or not state_file.is_file():
        raise FileNotFoundError(
            f"{folder} is not a complete yatt-lightning checkpoint: expected {WEIGHTS}/ and {state_file.name}."
        )
    checkpoint = torch.load(state_file, map_location="cpu", weights_only=False)
    checkpoint["_yatt_checkpoint_dir"] = str(folder)
    return checkpoint


def load_policy(strategy, checkpoint: dict[str, Any]) -> None:
    """Collective: load the sharded model and optimizer into this rank's policy."""
    from megatron.core import dist_checkpointing

    folder = Path(checkpoint["_yatt_checkpoint_dir"])
    policy = strategy.lightning_module.policy
    with megatron_cpu_context():
        state = dist_checkpointing.load(_sharded_state(policy, is_loading=True), str(folder / WEIGHTS))
        policy.local_module().load_state_dict(state["model"])
        if policy.optimizer is not None and "optimizer" in state:
            policy.optimizer.load_state_dict(state["optimizer"])


def remove(filepath) -> None:
    shutil.rmtree(Path(filepath), ignore_errors=True)
