"""A callback for the launcher tests: each rank writes what Lightning made of its launch to ``rank<N>.json``.

Put this folder on ``PYTHONPATH`` and add ``cluster_probe.ClusterProbe`` to ``--trainer.callbacks``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback
from typing_extensions import override


class ClusterProbe(Callback):
    """Records the cluster environment, ranks and rendezvous address at fit start, and a checksum of this
    rank's policy parameters at train end (equal on data-parallel replicas, different on TP shards).

    Args:
        out_dir: Folder for the per-rank JSON files.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.record: dict = {}

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        from megatron.core import parallel_state as ps

        strategy = trainer.strategy
        self.record = {
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "role": strategy.role,
            "data_parallel_rank": strategy.data_parallel_rank,
            # A disaggregated rollout rank has no Megatron model, so no Megatron ranks
            "tensor_parallel_rank": ps.get_tensor_model_parallel_rank() if strategy.role.trains else None,
            "tensor_parallel_size": ps.get_tensor_model_parallel_world_size() if strategy.role.trains else None,
            "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
            "MASTER_PORT": os.environ.get("MASTER_PORT"),
        }

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        checksum = None
        if pl_module.policy is not None:
            with torch.no_grad():
                checksum = sum(p.double().abs().sum().item() for p in pl_module.policy.parameters())
        self.record.update(global_step=trainer.global_step, param_checksum=checksum)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))
