"""Reward functions: the protocol, and plain Python functions loaded by their import path."""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from collections.abc import Callable
from typing import Protocol, runtime_checkable


class RewardError(RuntimeError):
    """A reward function failed (raised, or returned something that is not a finite number) on a sample."""


@runtime_checkable
class RewardFunction(Protocol):
    """Scores a batch of completions: one float per sample."""

    name: str

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]: ...


def describe_sample(prompt: str, completion: str, row: dict) -> str:
    where = f" ({row['_source']})" if "_source" in row else ""
    return f"sample{where} with prompt {_clip(prompt)!r} and completion {_clip(completion)!r}"


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def public_fields(row: dict) -> dict:
    """The row's fields that reach a reward function (framework bookkeeping starts with '_')."""
    return {k: v for k, v in row.items() if not k.startswith("_") and k != "prompt"}


class FunctionReward:
    """A plain function ``f(prompt: str, completion: str, **row) -> float`` used as a reward.

    Args:
        path: Dotted import path, e.g. ``my_module.my_reward`` (the module must be importable from the
            working directory or the Python path).
    """

    def __init__(self, path: str) -> None:
        self.name = path
        self.fn = load_callable(path)

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
        scores = []
        for prompt, completion, row in zip(prompts, completions, rows, strict=True):
            try:
                value = self.fn(prompt, completion, **public_fields(row))
            except Exception as err:
                raise RewardError(
                    f"reward function {self.name} raised {type(err).__name__}: {err} on {describe_sample(prompt, completion, row)}"
                ) from err
            try:
                score = float(value)
            except (TypeError, ValueError):
                score = math.nan
            if not math.isfinite(score):
                raise RewardError(
                    f"reward function {self.name} returned {value!r} (not a finite number) on "
                    f"{describe_sample(prompt, completion, row)}"
                )
            scores.append(score)
        return scores


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
