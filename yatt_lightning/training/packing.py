"""Packing sequences into training micro-batches under a token budget, with as little padding as pays.

A micro-batch is right-padded to its longest sequence (rounded up to ``pad_to_multiple``), so it costs
``samples x longest`` padded tokens, plus a fixed cost of its own (one more pass through the schedule,
its kernel launches or Python overhead), counted here as ``overhead_tokens``. Filling each micro-batch to
the budget, longest first, pays padding whenever a long sequence shares a micro-batch with much shorter
ones: on long-tailed lengths that is 15-40% of the padded tokens. :func:`pack_by_tokens` instead takes
the sequences longest first and cuts them into contiguous runs so that padded tokens plus
``overhead_tokens`` per micro-batch is smallest (an exact dynamic programme over the cut points; a
contiguous run of the sorted order is what any optimal packing of this cost uses).
"""

from __future__ import annotations

import numpy as np


def pack_by_tokens(
    lengths: list[int], token_budget: int, overhead_tokens: int = 256, pad_to_multiple: int = 8
) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches whose padded size (samples x longest, rounded up
    to ``pad_to_multiple``) fits ``token_budget``, minimising padded tokens + ``overhead_tokens`` per
    micro-batch. Longest first; a sequence longer than the budget gets a micro-batch of its own."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    padded = [-(-lengths[i] // pad_to_multiple) * pad_to_multiple for i in order]
    n = len(order)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):  # a micro-batch starting at sorted position i is as long as padded[i]
        room = max(1, min(n - i, token_budget // max(padded[i], 1)))
        cost = best[i] + overhead_tokens + padded[i] * np.arange(1, room + 1)
        ends = slice(i + 1, i + room + 1)
        better = cost < best[ends]
        best[ends] = np.where(better, cost, best[ends])
        cut[ends] = np.where(better, i, cut[ends])
    plan: list[list[int]] = []
    end = n
    while end > 0:
        start = int(cut[end])
        plan.append(order[start:end])
        end = start
    return plan[::-1]


def packed_cost(lengths: list[int], plan: list[list[int]], overhead_tokens: int = 256, pad_to_multiple: int = 8) -> int:
    """Padded tokens of ``plan`` plus ``overhead_tokens`` per micro-batch: the cost :func:`pack_by_tokens`
    minimises."""
    total = 0
    for mb in plan:
        longest = max(lengths[i] for i in mb)
        total += len(mb) * (-(-longest // pad_to_multiple) * pad_to_multiple) + overhead_tokens
    return total
