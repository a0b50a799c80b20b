"""What a reward function takes from a row against what the row gives it, told before any engine starts.

A rule reward (``model.reward_fn``, :class:`~yatt_lightning.rewards.base.RuleReward`) is called
``f(prompt, completion, **fields)`` and a tool environment's ``score`` ``f(prompt, answer, **fields)``, with
``fields`` the row's public fields (:func:`~yatt_lightning.rewards.base.public_fields`); a judge's template
is filled from the same fields and ``prompt`` and ``completion``. A row without a field the function
requires, or with one it does not take (no ``**kwargs``), would fail every call at the first step, after
the engines started: :func:`field_mismatch` finds it from the signature alone, as Python binds the call
(two arguments by position, the fields by keyword). The preflight asks it for every row of the data set.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class FieldMismatch:
    """Why ``f(a, b, **fields)`` cannot bind: each tuple sorted, at least one not empty."""

    missing: tuple[str, ...] = ()  # required parameters no field fills
    unexpected: tuple[str, ...] = ()  # fields no parameter takes (and no ``**kwargs``)
    repeated: tuple[str, ...] = ()  # fields named as a parameter already given by position

    def describe(self, what: str, fields: Collection[str]) -> str:
        """``what`` (``reward function rw.score(prompt, completion, answer)``) and the problem, with its fix."""
        given = ", ".join(sorted(fields)) or "none"
        if self.missing:
            names = _names(self.missing)
            return (
                f"{what} needs the row field{'s' * (len(self.missing) > 1)} {names}, which this row lacks (its fields: "
                f"{given}); add {names} to every row, or give the parameter a default ({self.missing[0]}=None)."
            )
        if self.unexpected:
            names = _names(self.unexpected)
            return (
                f"{what} does not take the row field{'s' * (len(self.unexpected) > 1)} {names}; every public field "
                f"of a row is passed by keyword (this row's: {given}): add **row to its parameters to accept the "
                f"fields it does not use, or drop {names} from the rows (a field named '_...' is not passed)."
            )
        names = _names(self.repeated)
        return (
            f"{what} gets {names} both by position and as a row field of that name; rename the parameter, or "
            f"the field in the rows."
        )


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(repr(n) for n in names)


def field_mismatch(fn: Callable, fields: Collection[str], positional: int = 2) -> FieldMismatch | None:
    """What stops ``fn(<positional> arguments, **{name: ... for name in fields})`` from binding, or ``None``
    (also when the signature cannot be read: a builtin's). A parameter with a default is optional; a
    ``**kwargs`` parameter takes any field; too few positional parameters are ``load_callable``'s to refuse."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    by_position: set[str] = set()  # filled by the positional arguments (a field of that name repeats it)
    by_keyword: set[str] = set()  # what a field may fill
    required: list[str] = []
    any_keyword = False
    left = positional
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and left > 0:
            left -= 1
            if p.kind == p.POSITIONAL_OR_KEYWORD:
                by_position.add(p.name)
            continue
        if p.kind == p.VAR_POSITIONAL:
            left = 0
        elif p.kind == p.VAR_KEYWORD:
            any_keyword = True
        else:
            if p.kind != p.POSITIONAL_ONLY:
                by_keyword.add(p.name)
            if p.default is p.empty:
                required.append(p.name)
    names = set(fields)
    missing = tuple(sorted(n for n in required if n not in names or n not in by_keyword))
    repeated = tuple(sorted(names & by_position))
    unexpected = () if any_keyword else tuple(sorted(names - by_keyword - by_position))
    if missing or unexpected or repeated:
        return FieldMismatch(missing, unexpected, repeated)
    return None


def signature_of(fn: Callable) -> str:
    """``module.name(params)`` of a function (or of a callable object's ``__call__``), as an error names it."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        params = "(...)"
    else:  # the names only: what a field must match
        plain = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
        params = str(sig.replace(parameters=plain, return_annotation=sig.empty))
    return f"{module}.{name}{params}"
