"""When only some ranks train (a disaggregated placement), Megatron must see only them.

Megatron-Core builds its groups over ``torch.distributed.get_world_size()`` ranks and calls a few
collectives on the default group (``group=None``: the optimizer's parameter groups, distributed
checkpointing). :func:`training_world` makes, while Megatron code runs, the world size the trainers'
count and ``group=None`` the trainers' group. The trainers are global ranks ``0 .. T-1``, so their rank
in that group is their global rank. Nothing changes until :func:`set_training_ranks` is called.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator

import torch

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
                "all_gather_into_tensor", "reduce_scatter_tensor", "gather_object", "scatter_object_list", "gather",
                "scatter", "reduce_scatter", "all_to_all")  # fmt: skip
_state = threading.local()
_size: int | None = None
_group = None
_real: dict = {}


def set_training_ranks(size: int | None, group=None) -> None:
    """The first ``size`` ranks train, over ``group`` (``None``: every rank trains)."""
    global _size, _group
    _size, _group = size, group


def _patched(name: str):
    real = getattr(torch.distributed, name)
    params = inspect.signature(real).parameters

    @functools.wraps(real)
    def call(*args, **kwargs):
        bound = inspect.signature(real).bind_partial(*args, **kwargs)
        if bound.arguments.get("group") is None and _group is not None:
            bound.arguments["group"] = _group
        return real(*bound.args, **bound.kwargs)

    return call if "group" in params else real


@contextlib.contextmanager
def training_world() -> Iterator[None]:
    """Inside: the world is the training ranks (see the module's docstring). Re-entrant; a no-op when every
    rank trains."""
    if _size is None or getattr(_state, "depth", 0):
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    _state.depth = 1
    real_size = torch.distributed.get_world_size
    saved = {name: getattr(torch.distributed, name) for name in _COLLECTIVES}

    def world_size(group=None) -> int:
        return _size if group is None else real_size(group)

    torch.distributed.get_world_size = world_size
    if _group is not None:
        for name in _COLLECTIVES:
            setattr(torch.distributed, name, _patched(name))
    try:
        yield
    finally:
        torch.distributed.get_world_size = real_size
        for name, fn in saved.items():
            setattr(torch.distributed, name, fn)
        _state.depth = 0
