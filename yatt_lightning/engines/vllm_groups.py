"""A rank that runs no engine while others start theirs: it must still take part in vLLM's process groups."""

from __future__ import annotations

import torch

from yatt_lightning.engines.vllm_engine import set_vllm_env


def join_engine_groups() -> None:
    """On a rank that runs no engine while others start theirs (disaggregated trainers): take part in the
    process groups vLLM builds over the whole world when an in-process engine starts (it waits for every
    rank), as a tensor-parallel-1 engine's worker would, without loading a model."""
    from yatt_lightning.engines import vllm_shutdown

    set_vllm_env()
    vllm_shutdown.adapt_to_trainer_process()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    rank = torch.distributed.get_rank()
    config = VllmConfig()
    # The groups follow the model: an engine of a dense model builds no expert-parallel group, and vLLM
    # builds one when it has no model config; say "a dense model" so the same groups are built here.
    object.__setattr__(config, "model_config", _DenseModel())
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(1, rank, "env://", rank, "gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)


class _DenseModel:
    """What vLLM's group set-up reads of a model config (see :func:`join_engine_groups`)."""

    is_moe = False
    architecture = "dense"
