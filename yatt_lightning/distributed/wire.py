"""Bytes that cross the wire: one counter around ``torch.distributed``'s tensor primitives.

:func:`install` wraps every collective and point-to-point function of ``torch.distributed``
(``all_reduce``, ``broadcast``, ``all_gather*``, ``reduce_scatter*``, ``gather``, ``scatter``, ``reduce``,
``all_to_all*``, ``send``/``recv``/``isend``/``irecv``, barriers) and counts, per *category*, what each
call moves for this rank. The object collectives (``gather_object``, ``scatter_object_list``,
``broadcast_object_list``, ...) and ``batch_isend_irecv`` are built on those primitives in torch 2.13 and
are counted through them, padding included (``gather_object`` pads every contribution to the largest).
A primitive that calls another (``send`` calls ``isend``, ``all_gather_into_tensor`` calls
``all_gather_single``) is counted once, at the outermost call. Calls made straight on a ``ProcessGroup``
object or through functional collectives (``torch.ops._c10d_functional``) are not seen; nothing in
this project, Megatron-Core 0.16.1's DDP and optimizer, or vLLM's CPU path uses them at TP=1.

Byte model (the same for every backend and algorithm): each piece of data goes in one hop from the
rank that holds it to each rank that needs it, and a reduction happens at the receiver. With ``W`` ranks
in the group and ``b`` the bytes of this rank's tensor (``numel * element_size``), this rank sends /
receives:

==================================================  ==============================  ==============================
primitive                                           sent                            received
==================================================  ==============================  ==============================
``send``/``isend`` (``recv``/``irecv``)             b (0)                           0 (b)
``broadcast``                                       root: (W-1) b, others 0         root: 0, others b
``scatter`` (``b`` = one rank's part)               root: (W-1) b, others 0         root: 0, others b
``gather`` / ``reduce``                             root: 0, others b               root: (W-1) b, others 0
``all_gather*`` (``b`` = the input)                 (W-1) b                         (W-1) b
``reduce_scatter*`` (``b`` = the output)            (W-1) b                         (W-1) b
``all_reduce`` (reduce-scatter, then all-gather)    2 (W-1) / W b                   2 (W-1) / W b
``all_to_all*``                                     the parts for other ranks       the parts from other ranks
``barrier``                                         0                               0
==================================================  ==============================  ==============================

A group of one moves nothing. Both directions are counted; ``Traffic.total`` is their sum.

Categories come from :func:`category`, a context variable set at a few call sites; anything outside
one is ``"control"``:

- ``"rollout"``: prompts, rows, completions and scores moved by the controllers and placements (and the
  DP load balancer's exchange of samples);
- ``"gradients"``: the update's collectives: Megatron DDP's gradient all-reduce / reduce-scatter at the end
  of the backward schedule, the distributed optimizer's parameter all-gather, and the few scalars
  reduced with them (token count, gradient norm);
- ``"control"``: everything else (error flags, logging scalars, barriers, weight export, set-up).

Off unless installed: :func:`install` (the bench calls it) or ``YATT_WIRE_COUNT=1`` in the environment
(installed when this module is first imported). When off, nothing is wrapped and :func:`category` only
checks a flag.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

CATEGORIES = ("rollout", "gradients", "control", "weights")
ENV = "YATT_WIRE_COUNT"


@dataclass(frozen=True)
class Traffic:
    """Bytes sent and received, and calls, per category (a snapshot; subtract two for a window)."""

    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    received: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    def total(self, category: str | None = None) -> int:
        """Sent + received, for one category or all."""
        names = CATEGORIES if category is None else (category,)
        return sum(self.sent[c] + self.received[c] for c in names)

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(
            {c: self.sent[c] - other.sent[c] for c in CATEGORIES},
            {c: self.received[c] - other.received[c] for c in CATEGORIES},
            {c: self.calls[c] - other.calls[c] for c in CATEGORIES},
        )


# ---------------------------------------------------------------------------------------------- byte model
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _root(group, global_rank: int | None, group_rank: int | None) -> int:
    """The root's rank in ``group`` from a call's ``src``/``dst`` (global) or ``group_src``/``group_dst``."""
    if group_rank is not None:
        return group_rank
    if global_rank is None:
        return 0  # torch's default root
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _rooted_out(a: dict, w: int, me: int, part: int, root_key: str) -> tuple[int, int]:
    """The root sends ``part`` to each other rank (broadcast, scatter)."""
    root = _root(a["group"], a.get(root_key), a.get(f"group_{root_key}"))
    return ((w - 1) * part, 0) if me == root else (0, part)


def _rooted_in(a: dict, w: int, me: int, part: int, root_key: str) -> tuple[int, int]:
    """Each other rank sends ``part`` to the root (gather, reduce)."""
    root = _root(a["group"], a.get(root_key), a.get(f"group_{root_key}"))
    return (0, (w - 1) * part) if me == root else (part, 0)


def _all_to_all_single(a: dict, w: int, me: int) -> tuple[int, int]:
    def others(t: torch.Tensor, splits) -> int:
        if not splits:  # equal parts
            return _nbytes(t) * (w - 1) // w
        row = _nbytes(t) // max(sum(splits), 1)
        return row * (sum(splits) - splits[me])

    return others(a["input"], a["input_split_sizes"]), others(a["output"], a["output_split_sizes"])


def _others(tensors: list[torch.Tensor], me: int) -> int:
    return sum(_nbytes(t) for i, t in enumerate(tensors) if i != me)


def _all_reduce(b: int, w: int) -> tuple[int, int]:
    return (2 * (w - 1) * b // w,) * 2


def _p2p(a: dict, me: int, sending: bool) -> tuple[int, int]:
    key = "dst" if sending else "src"
    peer = a.get(f"group_{key}")
    if peer is None and a.get(key) is not None:
        peer = _root(a["group"], a[key], None)
    b = 0 if peer == me else _nbytes(a["tensor"])
    return (b, 0) if sending else (0, b)


# (bytes sent, bytes received) of one call, from its bound arguments, the group size and this rank's rank in it.
MODEL: dict[str, Callable[[dict, int, int], tuple[int, int]]] = {
    "send": lambda a, w, me: _p2p(a, me, sending=True),
    "isend": lambda a, w, me: _p2p(a, me, sending=True),
    "recv": lambda a, w, me: _p2p(a, me, sending=False),
    "irecv": lambda a, w, me: _p2p(a, me, sending=False),
    "broadcast": lambda a, w, me: _rooted_out(a, w, me, _nbytes(a["tensor"]), "src"),
    "scatter": lambda a, w, me: _rooted_out(a, w, me, _nbytes(a["tensor"]), "src"),
    "gather": lambda a, w, me: _rooted_in(a, w, me, _nbytes(a["tensor"]), "dst"),
    "reduce": lambda a, w, me: _rooted_in(a, w, me, _nbytes(a["tensor"]), "dst"),
    "all_reduce": lambda a, w, me: _all_reduce(_nbytes(a["tensor"]), w),
    "all_reduce_coalesced": lambda a, w, me: _all_reduce(sum(_nbytes(t) for t in a["tensors"]), w),
    "all_gather": lambda a, w, me: ((w - 1) * _nbytes(a["tensor"]), _others(a["tensor_list"], me)),
    "all_gather_single": lambda a, w, me: ((w - 1) * _nbytes(a["input_tensor"]),) * 2,
    "all_gather_into_tensor": lambda a, w, me: ((w - 1) * _nbytes(a["input_tensor"]),) * 2,
    "_all_gather_base": lambda a, w, me: ((w - 1) * _nbytes(a["input_tensor"]),) * 2,
    "all_gather_coalesced": lambda a, w, me: (
        (w - 1) * sum(_nbytes(t) for t in a["input_tensor_list"]),
        sum(_others(out, me) for out in a["output_tensor_lists"]),
    ),
    "reduce_scatter": lambda a, w, me: (_others(a["input_list"], me), (w - 1) * _nbytes(a["output"])),
    "reduce_scatter_single": lambda a, w, me: ((w - 1) * _nbytes(a["output"]),) * 2,
    "reduce_scatter_tensor": lambda a, w, me: ((w - 1) * _nbytes(a["output"]),) * 2,
    "_reduce_scatter_base": lambda a, w, me: ((w - 1) * _nbytes(a["output"]),) * 2,
    "all_to_all": lambda a, w, me: (_others(a["input_tensor_list"], me), _others(a["output_tensor_list"], me)),
    "all_to_all_single": _all_to_all_single,
    "barrier": lambda a, w, me: (0, 0),
    "monitored_barrier": lambda a, w, me: (0, 0),
}


def bytes_of(name: str, args: tuple, kwargs: dict, world: int, rank: int) -> tuple[int, int]:
    """(sent, received) by the rank ``rank`` of a group of ``world`` for ``torch.distributed.<name>(*args,
    **kwargs)``, under the byte model above. Pure: needs no process group when ``src``/``dst`` are group
    ranks or the group is the default one (``group=None``)."""
    return _bytes(name, _bind(name, args, kwargs), world, rank)


def _bind(name: str, args: tuple, kwargs: dict) -> dict:
    bound = _SIGNATURES[name].bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _bytes(name: str, arguments: dict, world: int, rank: int) -> tuple[int, int]:
    if world <= 1 or rank < 0:  # a group of one, or this rank is not in the group (size and rank are -1)
        return 0, 0
    return MODEL[name](arguments, world, rank)


_SIGNATURES = {name: inspect.signature(getattr(c10d, name)) for name in MODEL}

# ---------------------------------------------------------------------------------------------- counting
_category: contextvars.ContextVar[str] = contextvars.ContextVar("yatt_wire_category", default="control")
_lock = threading.Lock()
_inside = threading.local()  # depth of wrapped calls on this thread: only the outermost counts
_totals = Traffic()
_originals: dict[str, Callable] = {}
_rebound: list[tuple[dict, str, Callable]] = []  # (module globals, name, original) for other modules' copies


@contextlib.contextmanager
def category(name: str) -> Iterator[None]:
    """Count the collectives inside the block (on this thread / task) as ``name`` (a decorator too)."""
    if name not in CATEGORIES:
        raise ValueError(f"wire.category: {name!r} is not one of {', '.join(CATEGORIES)}.")
    if not _originals:
        yield
        return
    token = _category.set(name)
    try:
        yield
    finally:
        _category.reset(token)


def installed() -> bool:
    return bool(_originals)


def snapshot() -> Traffic:
    """The totals counted so far in this process."""
    with _lock:
        return Traffic(dict(_totals.sent), dict(_totals.received), dict(_totals.calls))


def reset() -> None:
    with _lock:
        for counts in (_totals.sent, _totals.received, _totals.calls):
            counts.update(dict.fromkeys(CATEGORIES, 0))


def _wrap(name: str, original: Callable) -> Callable:
    def counted(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_inside, "depth", 0)
        if depth == 0:
            _count(name, args, kwargs)
        _inside.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _inside.depth = depth

    counted.__name__ = counted.__qualname__ = name
    counted.__doc__ = original.__doc__
    counted.__wrapped__ = original
    return counted


def _count(name: str, args: tuple, kwargs: dict) -> None:
    if not dist.is_initialized():
        return  # the call itself will raise
    arguments = _bind(name, args, kwargs)
    group = arguments["group"]
    sent, received = _bytes(name, arguments, dist.get_world_size(group), dist.get_rank(group))
    key = _category.get()
    with _lock:
        _totals.sent[key] += sent
        _totals.received[key] += received
        _totals.calls[key] += 1


def install() -> None:
    """Start counting in this process (idempotent). Also rebinds copies of the primitives that modules
    imported before (Megatron's DDP keeps ``dist_reduce_scatter_func = torch.distributed.reduce_scatter_tensor``)."""
    if _originals:
        return
    originals = {name: getattr(c10d, name) for name in MODEL}
    wrappers = {name: _wrap(name, fn) for name, fn in originals.items()}
    by_id = {id(fn): wrappers[name] for name, fn in originals.items()}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if callable(value) and id(value) in by_id and by_id[id(value)].__wrapped__ is value:
                namespace[key] = by_id[id(value)]
                _rebound.append((namespace, key, value))
    _originals.update(originals)


def uninstall() -> None:
    """Stop counting and restore every function :func:`install` replaced (the totals are kept)."""
    for namespace, key, original in reversed(_rebound):
        namespace[key] = original
    _rebound.clear()
    _originals.clear()


if os.environ.get(ENV) == "1":
    install()
