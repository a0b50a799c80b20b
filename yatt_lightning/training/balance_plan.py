"""Which rank trains which sequence: the load balancer's decision, made the same on every rank.

Given every data-parallel rank's sequence lengths (rank ``r`` owns the ``r``-th block of ``n``), a
:class:`~yatt_lightning.training.cost_model.TrainCostModel` and how the update will cut micro-batches,
:func:`choose_parts` predicts the step's training phase (its slowest rank) for a few candidate splits and
keeps the one predicted fastest, counting what moving its sequences costs:

- the ranks' own rows (nothing moves, nothing to exchange);
- the path of swaps from the own rows toward even costs, after 1, 2, 4, ... swaps (a few sequences move,
  so the exchange is small);
- the evenest split of the costs (Karmarkar-Karp refined, :func:`balanced_partition`), each part given
  to the rank that already owns most of it.

A split other than the own rows is kept only if its predicted saving exceeds ``min_saving`` of the
step, so noise in the model does not buy an exchange that does not pay. With ``decide_by="tokens"`` the
decision ignores the model (the evenest split of token counts, kept where it lowers the slowest rank's
padded tokens plus the micro-batch overhead): a choice that does not depend on measured times, so a run
is reproducible bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from yatt_lightning.rollout.batch import mini_batch_slices
from yatt_lightning.training.cost_model import TrainCostModel, Work, plan_work
from yatt_lightning.training.packing import pack_by_tokens, packed_cost
from yatt_lightning.training.partition import balanced_partition, swap_path

DECIDE_BY = ("cost", "tokens")


@dataclass(frozen=True)
class Planner:
    """How the update cuts a rank's sequences into micro-batches: ``mini_batches`` mini-batches (of a
    shuffled order: here, consecutive slices stand for them), each under ``token_budget`` (packed, with
    ``overhead_tokens`` per micro-batch) or in ``micro_batch_size`` samples; ``passes`` training passes over
    them per step (``ppo_epochs``)."""

    token_budget: int | None
    overhead_tokens: int
    micro_batch_size: int
    passes: int = 1
    mini_batches: int = 1

    def work(self, lengths: list[int]) -> Work:
        total = Work(0.0, 0.0, 0.0)
        for part in mini_batch_slices(len(lengths), self.mini_batches):
            mini = lengths[part]
            if self.token_budget:
                plan = pack_by_tokens(mini, self.token_budget, self.overhead_tokens)
            else:
                plan = [list(range(s, min(s + self.micro_batch_size, len(mini))))
                        for s in range(0, len(mini), self.micro_batch_size)]  # fmt: skip
            total = total + plan_work(mini, plan)
        return Work(total.tokens * self.passes, total.attention * self.passes, total.micro_batches * self.passes)


@dataclass(frozen=True)
class Choice:
    """The split kept (``parts[r]``: global sequence indices rank ``r`` trains), the predicted seconds of
    the slowest rank without moving and with this split, each rank's predicted work, and how many
    sequences move."""

    parts: list[list[int]]
    predicted_unmoved: float
    predicted: float
    work: list[Work]
    moved: int

    @property
    def moves(self) -> bool:
        return self.moved > 0


def choose_parts(
    lengths: list[int],
    dp: int,
    model: TrainCostModel,
    planner: Planner,
    sequence_bytes: list[float],
    *,
    decide_by: str = "cost",
    min_saving: float = 0.02,
) -> Choice:
    """The split of ``lengths`` (``dp`` blocks of equal size, block ``r`` owned by rank ``r``) to train
    on; ``sequence_bytes[i]`` is what sequence ``i`` weighs on the wire."""
    if decide_by not in DECIDE_BY:
        raise ValueError(f"decide_by must be one of {DECIDE_BY}, got {decide_by!r}")
    n = len(lengths) // dp
    unmoved = [list(range(r * n, (r + 1) * n)) for r in range(dp)]
    if decide_by == "tokens":
        return _by_tokens(lengths, unmoved, model, planner, sequence_bytes)
    weights = [model.sequence_weight(length, token_budget=planner.token_budget) for length in lengths]
    path = list(swap_path(weights, unmoved, max_swaps=4 * n))
    keep = sorted({len(path) - 1, *(2**k - 1 for k in range(len(path).bit_length()))} & set(range(len(path))))
    candidates = [unmoved, *(path[k] for k in keep)]
    candidates.append(_owned_most(balanced_partition(weights, dp), unmoved))
    scored = [_score(lengths, p, unmoved, model, planner, sequence_bytes) for p in candidates]
    best = min(range(len(candidates)), key=lambda j: (scored[j][0], _moved(candidates[j], unmoved)))
    base = scored[0][0]
    if base - scored[best][0] <= min_saving * base:
        best = 0
    return Choice(candidates[best], base, scored[best][0], scored[best][1], _moved(candidates[best], unmoved))


def _by_tokens(lengths, unmoved, model, planner, sequence_bytes) -> Choice:
    parts = _owned_most(balanced_partition([float(x) for x in lengths], len(unmoved)), unmoved)

    def planned(p):
        if not planner.token_budget:
            return (0.0, max(sum(lengths[i] for i in q) for q in p))
        return (max(packed_cost([lengths[i] for i in q], pack_by_tokens([lengths[i] for i in q], planner.token_budget,
                    planner.overhead_tokens), planner.overhead_tokens) for q in p), 0.0)  # fmt: skip

    base, after = (_score(lengths, p, unmoved, model, planner, sequence_bytes) for p in (unmoved, parts))
    if planned(unmoved) <= planned(parts):
        return Choice(unmoved, base[0], base[0], base[1], 0)
    return Choice(parts, base[0], after[0], after[1], _moved(parts, unmoved))


def _score(lengths, parts, unmoved, model, planner, sequence_bytes) -> tuple[float, list[Work]]:
    """The slowest rank's predicted seconds under ``parts``, and every rank's work."""
    exchanges = 1.0 if _moved(parts, unmoved) else 0.0
    works = []
    for r, part in enumerate(parts):
        own = set(unmoved[r])
        received = sum(sequence_bytes[i] for i in part if i not in own)
        compute = planner.work([lengths[i] for i in part])
        works.append(Work(compute.tokens, compute.attention, compute.micro_batches, received, exchanges))
    return max(model.predict(w) for w in works), works


def _moved(parts, unmoved) -> int:
    return sum(len(set(p) - set(u)) for p, u in zip(parts, unmoved, strict=True))


def _owned_most(parts: list[list[int]], unmoved: list[list[int]]) -> list[list[int]]:
    """``parts`` reordered so that part ``r`` is the one sharing most sequences with rank ``r``'s own
    (the fewest sequences move)."""
    from scipy.optimize import linear_sum_assignment

    overlap = [[len(set(p) & set(u)) for p in parts] for u in unmoved]
    rows, cols = linear_sum_assignment(overlap, maximize=True)
    return [sorted(parts[c]) for _, c in sorted(zip(rows, cols, strict=True))]
