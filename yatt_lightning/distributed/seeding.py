"""One seed for the whole run: components whose ``seed`` is None follow ``seed_everything``."""

from __future__ import annotations

import os
import random
import zlib

import torch


def resolve_seed(seed: int | None) -> int:
    """``seed`` if given, else the seed Lightning's ``seed_everything`` exported (``PL_GLOBAL_SEED``), else 0."""
    if seed is not None:
        return seed
    return int(os.environ.get("PL_GLOBAL_SEED", "0"))


def sampling_seed(run_seed: int, step: int, row: dict, position: int, *parts: object) -> int:
    """The one formula of rollout seeds: fixed by the run's seed, the step, the row (its ``_id``, which
    PromptDataModule gives every row; else its ``position`` in the step) and any further ``parts`` (a
    partial rollout's sample index and tokens so far), so a resumed run samples the same."""
    key = row.get("_id", position)
    return zlib.crc32(":".join(str(p) for p in (run_seed, step, key, *parts)).encode()) % (2**31 - 1)


def rng_states() -> dict:
    """Every generator's state in this process (Python, NumPy, torch, CUDA, Megatron's tracker), as a checkpoint keeps it."""
    import numpy as np
    from megatron.core.tensor_parallel import random as mrandom

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if mrandom._CUDA_RNG_STATE_TRACKER is not None:
        states["megatron"] = {k: v.clone() for k, v in mrandom._CUDA_RNG_STATE_TRACKER.get_states().items()}
    return states


def set_rng_states(states: dict) -> None:
    """Put back what :func:`rng_states` captured."""
    import numpy as np
    from megatron.core.tensor_parallel import random as mrandom

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "megatron" in states and mrandom._CUDA_RNG_STATE_TRACKER is not None:
        mrandom._CUDA_RNG_STATE_TRACKER.set_states(states["megatron"])
