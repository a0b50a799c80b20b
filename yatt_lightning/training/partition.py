"""Splitting weighted items into k parts of equal count with sums as even as possible.

:func:`karmarkar_karp` is the largest differencing method (Karmarkar & Karp, 1982) generalised to k
parts (Michiels et al., 2012), constrained to equal cardinality: items are taken in descending order
k at a time, each such chunk is a partial partition with one item per part, and the two partial
partitions with the largest spread (max - min part sum) are merged repeatedly, the heaviest part of one
joined with the lightest of the other. Every partial partition holds the same number of items per
part, so the result does too. :func:`greedy_partition` (sorted, each item to the lightest part that
still has room) is the baseline. Neither dominates the other on every input (on small long-tailed
inputs the equal-count constraint forces KK to pair the largest items early), so
:func:`balanced_partition`, what the load balancer uses, keeps the more even of the two and then
improves it by swapping one item of the heaviest part for a lighter item of another part while that
lowers the heaviest sum. It is never worse than the greedy split.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Iterator


def balanced_partition(weights: list[float], k: int, max_swaps: int = 200) -> list[list[int]]:
    """Equal-count parts with even sums: the better of KK and greedy, refined by pairwise swaps."""
    kk = karmarkar_karp(weights, k)
    greedy = greedy_partition(weights, k)
    best = kk if _spread(weights, kk) <= _spread(weights, greedy) else greedy
    return _refine_by_swaps(weights, best, max_swaps)


def _refine_by_swaps(weights: list[float], parts: list[list[int]], max_swaps: int) -> list[list[int]]:
    last = deque(swap_path(weights, parts, max_swaps), maxlen=1)  # only where the path ends
    return sorted((sorted(p) for p in (last[0] if last else parts)), key=lambda p: p[0])


def swap_path(weights: list[float], parts: list[list[int]], max_swaps: int = 200) -> Iterator[list[list[int]]]:
    """The parts after each swap that lowers the heaviest part's sum (one item of the heaviest part for a
    lighter item of another, the pair that lowers it most), up to ``max_swaps`` swaps or until none does.
    Part ``j`` stays part ``j`` (the load balancer's part ``j`` is rank ``j``: a path from the ranks'
    own rows moves few of them)."""
    parts = [list(p) for p in parts]
    sums = [sum(weights[i] for i in p) for p in parts]
    for _ in range(max_swaps):
        h = max(range(len(parts)), key=lambda j: sums[j])
        best = None  # (new max of the two parts, part, i, j)
        for o in range(len(parts)):
            gap = sums[h] - sums[o]
            if o == h or gap <= 0:
                continue
            lighter = sorted(parts[o], key=lambda j: weights[j])
            light_w = [weights[j] for j in lighter]
            for i in parts[h]:
                # the ideal partner weighs w_i - gap/2; look at its neighbours in sorted order
                pos = bisect.bisect_left(light_w, weights[i] - gap / 2)
                for q in (pos - 1, pos):
                    if 0 <= q < len(lighter):
                        d = weights[i] - light_w[q]
                        if 0 < d < gap:
                            new_max = max(sums[h] - d, sums[o] + d)
                            if best is None or new_max < best[0]:
                                best = (new_max, o, i, lighter[q])
        if best is None:
            return
        _, o, i, j = best
        parts[h][parts[h].index(i)] = j
        parts[o][parts[o].index(j)] = i
        d = weights[i] - weights[j]
        sums[h] -= d
        sums[o] += d
        yield [list(p) for p in parts]


def _spread(weights, parts) -> tuple[float, float]:
    sums = [sum(weights[i] for i in p) for p in parts]
    return (max(sums), max(sums) - min(sums))


def karmarkar_karp(weights: list[float], k: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` parts of ``len(weights) // k`` items each.

    Raises:
        ValueError: if ``k`` < 1 or ``len(weights)`` is not a multiple of ``k``.
    """
    _check(weights, k)
    if k == 1:
        return [list(range(len(weights)))]
    order = sorted(range(len(weights)), key=lambda i: weights[i], reverse=True)
    counter = itertools.count()  # tie-breaker so the heap never compares partitions
    heap: list = []
    for start in range(0, len(order), k):
        parts = [([order[start + j]], weights[order[start + j]]) for j in range(k)]
        heapq.heappush(heap, _entry(parts, counter))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: p[1], reverse=True)  # heaviest first
        b = sorted(b, key=lambda p: p[1])  # lightest first
        merged = [(pa[0] + pb[0], pa[1] + pb[1]) for pa, pb in zip(a, b, strict=True)]
        heapq.heappush(heap, _entry(merged, counter))
    parts = heap[0][2]
    return sorted((sorted(items) for items, _ in parts), key=lambda p: p[0])


def greedy_partition(weights: list[float], k: int) -> list[list[int]]:
    """Baseline: heaviest item first, each into the lightest part that still has room."""
    _check(weights, k)
    size = len(weights) // k
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0.0] * k
    for i in sorted(range(len(weights)), key=lambda i: weights[i], reverse=True):
        j = min((j for j in range(k) if len(parts[j]) < size), key=lambda j: sums[j])
        parts[j].append(i)
        sums[j] += weights[i]
    return [sorted(p) for p in parts]


def imbalance(weights: list[float], parts: list[list[int]]) -> float:
    """max part sum / mean part sum (1.0 is perfect)."""
    sums = [sum(weights[i] for i in p) for p in parts]
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean > 0 else 1.0


def _entry(parts, counter) -> tuple:
    sums = [s for _, s in parts]
    return (-(max(sums) - min(sums)), next(counter), parts)


def _check(weights: list[float], k: int) -> None:
    if k < 1:
        raise ValueError(f"number of parts must be >= 1, got {k}")
    if len(weights) % k:
        raise ValueError(f"{len(weights)} items cannot be split into {k} parts of equal count")
