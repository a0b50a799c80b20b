"""One seed for the whole run: components whose ``seed`` is None follow ``seed_everything``."""

from __future__ import annotations

import os
import zlib


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
