"""Reward functions: the base class, error policy, and plain Python functions loaded by import path.

Every reward function scores a batch of samples and returns one float per sample (optionally per-token
rewards and metrics to log). Several are summed with their weights. A function that raises or returns
something that is not a finite number stops training with an error naming the function and the sample;
with ``on_error: zero`` the sample scores 0 instead and the count is logged (``reward/<name>/errors``).

Every call into a reward function has a deadline (``timeout_s``; unset, the module's
``model.reward_timeout_s``): a rule function's call on one sample, a batch scorer's (:meth:`RewardFunction.score`)
on the batch. A call past it is a failure like any other (``on_error``), named with the deadline's key and,
for a rule function, the sample; it is counted in ``reward/<name>/timeouts`` too. The call runs on a worker
thread (:mod:`yatt_lightning.rewards.deadline`), so a function that never returns cannot hold up the run.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from yatt_lightning.rewards.deadline import DeadlineExceeded, TimedCaller, WorkerLost
from yatt_lightning.rewards.fields import field_mismatch, signature_of

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function failed (raised, or returned something that is not a finite number) on a sample."""


@dataclass
class RewardOutput:
    """Scores of a batch: one per sample, metrics summed over ranks for logging and, from a
    :class:`TokenRewardFunction`, per-token rewards (one list per sample over its completion tokens)."""

    scores: list[float]
    metrics: dict[str, float] = field(default_factory=dict)
    token_rewards: list[list[float]] | None = None


def describe_sample(prompt: str, completion: str, row: dict) -> str:
    where = f" ({row['_source']})" if "_source" in row else ""
    return f"sample{where} with prompt {_clip(prompt)!r} and completion {_clip(completion)!r}"


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def public_fields(row: dict) -> dict:
    """The row's fields that reach a reward function (framework bookkeeping starts with '_')."""
    return {k: v for k, v in row.items() if not k.startswith("_") and k != "prompt"}


def drawn_fields(row: dict) -> frozenset[str]:
    """The names of :func:`public_fields` of ``row`` as the data set hands it out: a row of images, loaded
    with ``_images``, is drawn with them decoded as ``images``."""
    return frozenset(public_fields(row)) | ({"images"} if "_images" in row else frozenset())


class RewardFunction:
    """Base class. Subclasses implement :meth:`score`.

    Args:
        weight: Multiplies this function's scores in the sum of rewards.
        on_error: ``raise`` stops training naming the sample; ``zero`` scores the sample 0 and counts it.
        name: Name in logs (default: derived from the function).
        timeout_s: Deadline of one call (see the module's docstring); ``None``: ``model.reward_timeout_s``.
    """

    def __init__(
        self,
        weight: float = 1.0,
        on_error: Literal["raise", "zero"] = "raise",
        name: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if on_error not in ("raise", "zero"):
            raise ValueError(f"`on_error` must be 'raise' or 'zero', got {on_error!r}.")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"`timeout_s` of reward function {name or type(self).__name__} must be > 0, got {timeout_s}.")
        self.weight = weight
        self.on_error = on_error
        self.name = name or type(self).__name__
        self.timeout_s = timeout_s
        self.timeout_key = "timeout_s"  # the key that set the deadline, as an error names it
        self._caller: TimedCaller | None = None

    def set_default_timeout(self, timeout_s: float | None, key: str) -> None:
        """The deadline of a function that set none (the module's ``reward_timeout_s``)."""
        if self.timeout_s is None:
            self.timeout_s, self.timeout_key = timeout_s, key

    def timed(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` under this function's deadline (:class:`DeadlineExceeded` past it)."""
        if self._caller is None or self._caller.timeout_s != self.timeout_s:
            self._caller = TimedCaller(self.timeout_s, name=f"reward:{self.name}")
        return self._caller(fn, *args, **kwargs)

    def failure_message(self, err: Exception, where: str = "") -> str:
        """What the user reads when a call ``where`` (`` on <sample>``) raised ``err`` or ran past its deadline."""
        if isinstance(err, DeadlineExceeded):
            return (
                f"reward function {self.name} did not return within {self.timeout_s:g} s (`{self.timeout_key}`)"
                f"{where}; raise the deadline, or set `on_error: zero` to score such samples 0"
            )
        return f"reward function {self.name} raised {type(err).__name__}: {err}{where}"

    def __getstate__(self) -> dict:  # a worker thread does not travel (deepcopy, pickling)
        return {**self.__dict__, "_caller": None}

    def score(self, prompts: list[str], completions: list[str], rows: list[dict]) -> RewardOutput | list[float]:
        raise NotImplementedError

    def row_problem(self, fields: frozenset[str]) -> str | None:
        """What would stop this function scoring a row with these public fields (see
        :mod:`~yatt_lightning.rewards.fields`), checked before any engine starts; ``None``: nothing that the
        names tell."""
        return None

    def rollout_scores(self, batch) -> RewardOutput:
        """The scores of a rollout batch (:class:`~yatt_lightning.rollout.batch.RolloutBatch`)."""
        return self(batch.prompts, batch.completions, batch.rows)

    def metric_names(self) -> list[str]:
        """Every metric this function may report (the same on every rank, so ranks can sum them)."""
        return [f"reward/{self.name}/errors", f"reward/{self.name}/timeouts"]

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict]) -> RewardOutput:
        try:
            out = self.timed(self.score, prompts, completions, rows)
        except RewardError:
            raise
        except Exception as err:
            return self.failed(err, len(completions))
        return self.checked(out, prompts, completions, rows)

    def failed(self, err: Exception, n: int) -> RewardOutput:
        """What scoring ``n`` samples gives when it raised ``err``: a :class:`RewardError` naming this
        function (``on_error: raise``), or zeros, counted (``on_error: zero``)."""
        late = isinstance(err, DeadlineExceeded)
        what = self.failure_message(err, f" on a batch of {n} samples" if late else "")
        if self.on_error == "raise" or isinstance(err, WorkerLost):  # a process out of threads scores nothing
            raise RewardError(what) from err
        log.warning("%s; scoring the batch 0", what)
        metrics = {f"reward/{self.name}/errors": float(n)}
        if late:
            metrics[f"reward/{self.name}/timeouts"] = float(n)
        return RewardOutput([0.0] * n, metrics)

    def checked(self, out, prompts: list[str], completions: list[str], rows: list[dict]) -> RewardOutput:
        """``score``'s output with one finite float per sample; anything else raises a :class:`RewardError`
        naming the sample (``on_error: raise``) or scores 0, counted (``on_error: zero``)."""
        if not isinstance(out, RewardOutput):
            out = RewardOutput(list(out))
        if len(out.scores) != len(completions):
            raise RewardError(
                f"reward function {self.name} returned {len(out.scores)} scores for {len(completions)} samples"
            )
        errors = 0
        for i, value in enumerate(out.scores):
            score = _as_float(value)
            if math.isfinite(score):
                out.scores[i] = score
                continue
            if self.on_error == "raise":
                raise RewardError(
                    f"reward function {self.name} returned {value!r} (not a finite number) on "
                    f"{describe_sample(prompts[i], completions[i], rows[i])}"
                )
            out.scores[i] = 0.0
            errors += 1
        if errors or self.on_error == "zero":
            out.metrics[f"reward/{self.name}/errors"] = out.metrics.get(f"reward/{self.name}/errors", 0.0) + errors
        return out


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


class TokenRewardFunction(RewardFunction):
    """A reward given per completion token (a process reward, a per-token cost). Subclasses implement
    :meth:`score_tokens`; the rewards reach the advantage estimator as per-token rewards (GAE and
    REINFORCE++ credit each token; the group estimators add them to the sample's reward)."""

    def score_tokens(
        self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], rows: list[dict]
    ) -> list[list[float]]:
        raise NotImplementedError

    def score(self, prompts, completions, rows) -> RewardOutput:
        raise TypeError(f"reward function {self.name} scores tokens: it needs the rollout batch (rollout_scores)")

    def rollout_scores(self, batch) -> RewardOutput:
        n = len(batch)
        try:
            tokens = self.timed(self.score_tokens, batch.prompts, batch.completions, batch.completion_ids, batch.rows)
        except RewardError:
            raise
        except Exception as err:
            out = self.failed(err, n)
            return RewardOutput(out.scores, out.metrics, [[0.0] * len(c) for c in batch.completion_ids])
        if len(tokens) != n:
            raise RewardError(
                f"reward function {self.name} returned per-token rewards for {len(tokens)} of {n} samples"
            )
        for i, (values, ids) in enumerate(zip(tokens, batch.completion_ids, strict=True)):
            if len(values) != len(ids) or not all(math.isfinite(_as_float(v)) for v in values):
                raise RewardError(
                    f"reward function {self.name} returned {len(values)} per-token rewards (or one not finite) for "
                    f"{len(ids)} completion tokens of {describe_sample(batch.prompts[i], batch.completions[i], batch.rows[i])}"
                )
        return RewardOutput([0.0] * n, {}, [[float(v) for v in values] for values in tokens])


class RuleReward(RewardFunction):
    """A plain function ``f(prompt: str, completion: str, **row) -> float`` used as a reward.

    Args:
        path: Dotted import path, e.g. ``my_module.my_reward`` (importable from the working directory or
            the Python path).
        weight: Multiplies the scores in the sum of rewards.
        on_error: ``raise`` (default) or ``zero`` (score 0 and count it).
        name: Name in logs (default: the function's dotted path).
        timeout_s: Deadline of the function's call on one sample; ``None``: ``model.reward_timeout_s``.
    """

    def __init__(
        self,
        path: str,
        weight: float = 1.0,
        on_error: Literal["raise", "zero"] = "raise",
        name: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(weight=weight, on_error=on_error, name=name or path, timeout_s=timeout_s)
        self.fn = load_callable(path)

    def row_problem(self, fields: frozenset[str]) -> str | None:
        mismatch = field_mismatch(self.fn, fields)
        if mismatch is None:
            return None
        label = signature_of(self.fn)
        what = f"reward function {label}" if label.startswith(f"{self.name}(") else f"reward function {self.name} = {label}"
        return mismatch.describe(what, fields)

    def __call__(self, prompts, completions, rows) -> RewardOutput:
        return self.checked(self.score(prompts, completions, rows), prompts, completions, rows)

    def score(self, prompts, completions, rows) -> RewardOutput:
        """Each sample's score, one call (under the deadline) per sample."""
        scores, errors, late = [], 0, 0
        for prompt, completion, row in zip(prompts, completions, rows, strict=True):
            try:
                scores.append(self.timed(self.fn, prompt, completion, **public_fields(row)))
            except Exception as err:
                timed_out = isinstance(err, DeadlineExceeded)
                what = self.failure_message(err, f" on {describe_sample(prompt, completion, row)}")
                if self.on_error == "raise" or isinstance(err, WorkerLost):
                    raise RewardError(what) from err
                if timed_out:
                    log.warning("%s; scoring it 0", what)
                scores.append(0.0)
                errors += 1
                late += timed_out
        metrics = {f"reward/{self.name}/errors": float(errors)} if errors else {}
        if late:
            metrics[f"reward/{self.name}/timeouts"] = float(late)
        return RewardOutput(scores, metrics)


def load_callable(path: str, key: str = "model.reward_fn") -> Callable:
    """Import ``package.module.attr``; the current directory is importable, as for ``python -m``."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"`{key}`: {path!r} is not a dotted import path like 'my_module.my_reward'.")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"`{key}`: cannot import module {module_name!r} for {path!r} ({err}). Run from the folder that holds "
            f"{module_name.replace('.', '/')}.py or add it to PYTHONPATH."
        ) from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"`{key}`: module {module_name!r} has no function {attr!r}.")
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ValueError(
            f"`{key}`: {path} must accept (prompt, completion, **row); its signature is {inspect.signature(fn)}."
        )
    return fn
