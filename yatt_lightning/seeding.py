"""One seed for the whole run: components whose ``seed`` is None follow ``seed_everything``."""

from __future__ import annotations

import os


def resolve_seed(seed: int | None) -> int:
    """``seed`` if given, else the seed Lightning's ``seed_everything`` exported (``PL_GLOBAL_SEED``), else 0."""
    if seed is not None:
        return seed
    return int(os.environ.get("PL_GLOBAL_SEED", "0"))
