"""Tools an agent calls: a name, a description, a JSON schema of the arguments, and a call.

A tool is a class chosen by ``class_path`` in ``model.agent.environment.init_args.tools``; its schema is
checked when it is built (before any engine starts), and each call's arguments against it (a call whose
arguments do not fit is an error observation, not a call). Built in: :class:`Calculator`, :class:`Lookup`
(a key-value store taken from the row) and :class:`~yatt_lightning.agents.sandbox.Python`.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

import jsonschema


class ToolError(Exception):
    """A call the tool refuses (bad arguments, a key that is not there): its message is what the model reads."""


class Tool:
    """Base class: set :attr:`name`, :attr:`description`, :attr:`parameters` (a JSON schema of an object) and
    implement :meth:`run`.

    Args:
        timeout_s: The longest one call may take; past it the call is an error observation.
    """

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

    def __init__(self, timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"tool {self.name or type(self).__name__}: `timeout_s` must be > 0, got {timeout_s}.")
        self.timeout_s = timeout_s
        self.check_schema()

    def check_schema(self) -> None:
        where = f"tool {type(self).__module__}.{type(self).__qualname__}"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"{where}: `name` must be an identifier, got {self.name!r}.")
        try:
            jsonschema.Draft202012Validator.check_schema(self.parameters)
        except jsonschema.SchemaError as err:
            raise ValueError(f"{where} ({self.name}): `parameters` is not a valid JSON schema: {err.message}.") from None
        if self.parameters.get("type") != "object":
            raise ValueError(f"{where} ({self.name}): `parameters` must be the schema of an object (\"type\": \"object\").")

    def schema(self) -> dict:
        """The tool as a chat template's ``tools`` entry (OpenAI's function format)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}  # fmt: skip

    def check_arguments(self, arguments: Any) -> None:
        """Raise a :class:`ToolError` saying what is wrong with ``arguments``."""
        try:
            jsonschema.validate(arguments, self.parameters)
        except jsonschema.ValidationError as err:
            raise ToolError(f"bad arguments for {self.name}: {err.message}") from None

    def run(self, arguments: dict, row: dict, timeout_s: float) -> str:
        """The call's result as text; ``row`` is the episode's row. Raise :class:`ToolError` to refuse."""
        raise NotImplementedError


_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}  # fmt: skip


class Calculator(Tool):
    """Arithmetic on numbers: ``+ - * / // % **`` and parentheses (no names, no calls)."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. (3 + 4) * 2."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    def run(self, arguments: dict, row: dict, timeout_s: float) -> str:
        expression = arguments["expression"]
        if len(expression) > 200:
            raise ToolError("expression too long (200 characters at most)")
        try:
            value = _evaluate(ast.parse(expression, mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as err:
            raise ToolError(f"cannot evaluate {expression!r}: {err}") from None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value)


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("power too large")
        value = _OPERATORS[type(node.op)](left, right)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("result is not finite")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses")


class Lookup(Tool):
    """Look a key up in the row's store (``row[field]``, a mapping): the only place the answer is, in the
    built-in lookup task.

    Args:
        field: The row's field that holds the store.
        key_field: Look up the row's field of this name instead of a key the call names (the call then has
            no arguments: the built-in tiny task's, whose random policy could not name a key).
        timeout_s: See :class:`Tool`.
    """

    name = "lookup"
    description = "Look up the value stored under a key."
    parameters = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}

    def __init__(self, field: str = "store", key_field: str | None = None, timeout_s: float = 10.0) -> None:
        if key_field is not None:
            self.parameters = {"type": "object", "properties": {}}
        super().__init__(timeout_s)
        self.field, self.key_field = field, key_field

    def run(self, arguments: dict, row: dict, timeout_s: float) -> str:
        store = row.get(self.field)
        if not isinstance(store, dict):
            raise ToolError(f"this row has no store (field {self.field!r})")
        key = arguments["key"] if self.key_field is None else row.get(self.key_field)
        if key not in store:
            raise ToolError(f"no key {key!r}")
        return str(store[key])
