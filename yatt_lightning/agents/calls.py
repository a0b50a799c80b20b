"""How tool calls are written in the model's text, and how their results are written back: a call format,
chosen by ``class_path``.

:class:`HermesCalls` (the default) is the format of Qwen's and Hermes' chat templates:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, results in ``<tool_response>...</tool_response>``.
:class:`RegexCalls` reads one argument of one tool with a regular expression (``Action: search[(.*)]``,
ReAct-style, or the built-in tiny tasks' one-letter calls, which a random policy hits often enough to learn
from). A call that cannot be read (bad JSON, no name) is a :class:`Call` with its ``error`` set: the model
reads the error, as a real agent would.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    """One tool call read from a turn: the tool's name and its arguments, or why it could not be read."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str | None = None


class CallFormat:
    """Base class: :meth:`parse` a turn's text into calls (none: the turn is the final answer) and
    :meth:`render` the results as the next observation's text."""

    def parse(self, text: str) -> list[Call]:
        raise NotImplementedError

    def render(self, results: list[str]) -> str:
        return "\n".join(results)


class HermesCalls(CallFormat):
    """``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``, any number per
    turn; each result in ``<tool_response>...</tool_response>``."""

    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[Call]:
        calls = []
        for body in self.CALL.findall(text):
            try:
                value = json.loads(body.strip())
            except json.JSONDecodeError as err:
                calls.append(Call(error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})"))
                continue
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                calls.append(Call(error='a tool call must be {"name": <tool>, "arguments": {...}}'))
                continue
            arguments = value.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    calls.append(Call(value["name"], error="the arguments are not valid JSON"))
                    continue
            if not isinstance(arguments, dict):
                calls.append(Call(value["name"], error="the arguments must be a JSON object"))
                continue
            calls.append(Call(value["name"], arguments))
        return calls

    def render(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


class RegexCalls(CallFormat):
    """A turn whose text matches ``pattern`` calls ``tool``, with the pattern's group as its ``argument``.

    Args:
        pattern: A regular expression (searched in the turn's text), with one group when ``argument`` is set
            and none otherwise.
        tool: The tool it calls.
        argument: The argument the group fills; ``None``: the call has no arguments.
        prefix: Put in front of each result (``=``, say).
    """

    def __init__(self, pattern: str, tool: str, argument: str | None = None, prefix: str = "") -> None:
        try:
            compiled = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"RegexCalls: `pattern` {pattern!r} is not a regular expression: {err}.") from None
        want = 1 if argument is not None else 0
        if compiled.groups != want:
            raise ValueError(
                f"RegexCalls: `pattern` {pattern!r} must have {'exactly one group (the argument)' if want else 'no group (no argument)'}."
            )
        self.pattern, self.tool, self.argument, self.prefix = compiled, tool, argument, prefix

    def parse(self, text: str) -> list[Call]:
        match = self.pattern.search(text)
        if not match:
            return []
        return [Call(self.tool, {self.argument: match.group(1)} if self.argument is not None else {})]

    def render(self, results: list[str]) -> str:
        return "\n".join(self.prefix + r for r in results)
