"""What a rank's share of the training phase costs, in seconds, learned from the run's own steps.

The data-parallel load balancer (:class:`~yatt_lightning.callbacks.DPLoadBalancer`) has to turn an even
split of the work into a shorter step, and token counts alone do not say what a step costs: on 2 CPU
cores a micro-batch's fixed cost (a pass through Megatron's schedule, Python, kernel launches) weighs as
much as a few hundred tokens, and moving sequences between ranks costs collectives; on GPUs the
attention of long sequences grows with their square. :class:`TrainCostModel` predicts one rank's training
time from the terms of its plan, :class:`Work`:

- ``tokens``: padded tokens (samples x longest, per micro-batch), the linear layers' work;
- ``attention``: samples x longest squared (thousands), per micro-batch, the attention scores' work;
- ``micro_batches``: the fixed cost of each micro-batch;
- ``moved_bytes``: the bytes this rank receives when sequences move, and ``exchanges`` (1 when the step
  exchanged at all): the exchange's bandwidth and latency.

``seconds = sum(coefficient x term)``, every coefficient >= 0, fitted by non-negative least squares
(:func:`scipy.optimize.nnls`) over the last ``window`` measurements, pulled gently toward a prior (one
token of work per token, ``micro_batch_overhead_tokens`` per micro-batch, an exchange as dear as a
micro-batch, a byte 1/64 of a token) scaled to the measured seconds, so that the terms a run has not
varied yet keep a sensible cost. Pure: no process group, no clock (the balancer measures and feeds it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import astuple, dataclass

import numpy as np

TERMS = ("tokens", "attention", "micro_batches", "moved_bytes", "exchanges")


@dataclass(frozen=True)
class Work:
    """The cost terms of one rank's training phase (see the module's docstring)."""

    tokens: float
    attention: float
    micro_batches: float
    moved_bytes: float = 0.0
    exchanges: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def plan_work(lengths: list[int], plan: list[list[int]], pad_to_multiple: int = 8) -> Work:
    """The compute terms of micro-batches ``plan`` (lists of indices into ``lengths``), each right-padded to
    its longest sequence rounded up to ``pad_to_multiple``, as :meth:`TrainingBatch.microbatches` pads."""
    tokens = attention = 0.0
    for mb in plan:
        longest = -(-max(lengths[i] for i in mb) // pad_to_multiple) * pad_to_multiple
        tokens += len(mb) * longest
        attention += len(mb) * longest * longest / 1000.0
    return Work(tokens, attention, float(len(plan)))


def microbatch_work(microbatches: list) -> Work:
    """The compute terms of micro-batches as built (their ``input_ids [b, s]``, padded)."""
    total = Work(0.0, 0.0, 0.0)
    for mb in microbatches:
        b, s = mb.input_ids.shape
        total = total + Work(float(b * s), b * s * s / 1000.0, 1.0)
    return total


class TrainCostModel:
    """Predicts a rank's training seconds from its :class:`Work`; learns from :meth:`observe`.

    Two fits: the compute terms (tokens, attention, micro-batches) against each rank's compute seconds,
    and the exchange terms (bytes, latency) against the exchange's own measured seconds (measured apart,
    so the compute's noise does not hide it).

    Args:
        micro_batch_overhead_tokens: The prior's cost of one micro-batch, and of one exchange, in tokens
            of work.
        window: How many recent measurements each fit uses (older steps are forgotten, so the model
            follows a machine whose load changes).
        prior_weight: How many measurements the prior counts as.
    """

    def __init__(self, micro_batch_overhead_tokens: float = 256, window: int = 96, prior_weight: float = 2.0) -> None:
        overhead = float(micro_batch_overhead_tokens)
        self.compute_prior = np.array([1.0, 0.0, overhead])
        self.exchange_prior = np.array([1.0 / 64, overhead])  # a byte, an exchange, in tokens of work
        self.prior_weight = prior_weight
        self.compute_samples: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self.exchange_samples: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self.scale = 1.0  # seconds per token of work by the prior (1.0: in tokens until the first measurement)
        self.compute = self.compute_prior.copy()
        self.exchange = self.exchange_prior.copy()
        self.rms_error = float("inf")

    def observe(self, work: Work, compute_seconds: float, exchange_seconds: float = 0.0) -> None:
        """One rank's measured seconds for ``work``: its compute, and its exchange's if it exchanged."""
        terms = np.array(astuple(work), dtype=float)
        if np.isfinite(compute_seconds) and compute_seconds > 0:
            self.compute_samples.append((terms[:3], float(compute_seconds)))
            self.compute, self.scale, self.rms_error = _fit(self.compute_samples, self.compute_prior, None,
                                                            self.prior_weight)  # fmt: skip
            if not self.exchange_samples:
                self.exchange = self.exchange_prior * self.scale
        if work.exchanges and np.isfinite(exchange_seconds) and exchange_seconds >= 0:
            self.exchange_samples.append((terms[3:], float(exchange_seconds)))
            self.exchange, _, _ = _fit(self.exchange_samples, self.exchange_prior, self.scale, self.prior_weight)

    def predict(self, work: Work) -> float:
        terms = astuple(work)
        return float(np.dot(self.compute, terms[:3]) + np.dot(self.exchange, terms[3:]))

    @property
    def fitted(self) -> bool:
        """Whether the coefficients are in seconds (at least one measurement)."""
        return bool(self.compute_samples)

    @property
    def coefficients(self) -> dict[str, float]:
        return dict(zip(TERMS, [*self.compute.tolist(), *self.exchange.tolist()], strict=True))

    def sequence_weight(self, length: int, pad_to_multiple: int = 8, token_budget: int | None = None) -> float:
        """What one sequence adds to its rank's cost, for the partition: its tokens, its attention, and its
        share of a micro-batch (``length / token_budget`` of one, or none without a budget)."""
        padded = -(-length // pad_to_multiple) * pad_to_multiple
        a, b, c = self.compute
        share = padded / token_budget if token_budget else 0.0
        return float(a * padded + b * padded * padded / 1000.0 + c * share)


def _fit(samples, prior: np.ndarray, scale: float | None, weight: float) -> tuple[np.ndarray, float, float]:
    """Non-negative least squares of ``samples`` (terms, seconds), pulled toward ``prior x scale`` as if by
    ``weight`` more measurements; ``scale`` ``None`` (the compute fit): fit the prior's scale to the
    data first. Returns the coefficients, that scale and the fit's rms error."""
    from scipy.optimize import nnls

    x = np.stack([s[0] for s in samples])
    y = np.array([s[1] for s in samples])
    if scale is None:
        guess = x @ prior
        scale = float(guess @ y / (guess @ guess)) if guess @ guess > 0 else 1.0
    # Each column on one scale: a coefficient's move is penalised by what it changes a typical prediction by.
    typical = np.sqrt((x * x).mean(axis=0))
    rows = np.sqrt(weight) * np.diag(np.where(typical > 0, typical, 1.0))
    coefficients, _ = nnls(np.vstack([x, rows]), np.concatenate([y, rows @ (prior * scale)]))
    return coefficients, scale, float(np.sqrt(np.mean((x @ coefficients - y) ** 2)))
