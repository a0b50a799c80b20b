"""Tools as an environment: each turn's calls are read (:mod:`~yatt_lightning.agents.calls`), run, and
their results are the next observation; a turn without a call is the final answer and ends the episode
(scored by the reward functions, which read the whole completion).

A call that cannot be read, names no tool, has arguments its schema refuses, raises, or runs past its
tool's ``timeout_s`` becomes an error observation (``error: ...``) and is counted (``agent/tool_errors``):
the model sees what a real agent would, and the run goes on, unless ``on_tool_error: raise``.
"""

from __future__ import annotations

import time
from typing import Literal

from yatt_lightning.agents.calls import Call, CallFormat, HermesCalls
from yatt_lightning.agents.environment import Environment, Episode, Observation
from yatt_lightning.agents.tools import Tool, ToolError
from yatt_lightning.rewards.base import load_callable, public_fields
from yatt_lightning.rewards.deadline import DeadlineExceeded, TimedCaller, WorkerLost
from yatt_lightning.rewards.fields import field_mismatch, signature_of


class ToolEnvironment(Environment):
    """Args:
    tools: The tools the model may call (``class_path`` each).
    call_format: How calls are written (default: ``<tool_call>`` JSON, Qwen / Hermes style).
    on_tool_error: ``observe``: a failed call is an error observation; ``raise``: it stops the run.
    max_calls_per_turn: Calls run per turn at most (the rest are refused, as errors).
    max_output_chars: A result longer than this is cut (and says so).
    score: A function ``f(prompt, answer, **row) -> float`` (dotted import path, as ``model.reward_fn``) that
        scores the final answer (the text of the turn without a call); its score is that turn's reward.
        ``None``: the reward functions score the episode.

    ``tools: []`` switches the tools off: the calls are read as always, and each is answered with an error.
    """

    def __init__(
        self,
        tools: list[Tool],
        call_format: CallFormat | None = None,
        on_tool_error: Literal["observe", "raise"] = "observe",
        max_calls_per_turn: int = 4,
        max_output_chars: int = 2000,
        score: str | None = None,
    ) -> None:
        for k, tool in enumerate(tools):
            if not isinstance(tool, Tool):
                raise ValueError(
                    f"`model.agent.environment.init_args.tools[{k}]` must be a Tool (a class_path to a subclass of "
                    f"yatt_lightning.agents.Tool), got {type(tool).__name__}."
                )
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"`model.agent.environment.init_args.tools`: two tools share a name ({names}).")
        if on_tool_error not in ("observe", "raise"):
            raise ValueError(f"`on_tool_error` must be 'observe' or 'raise', got {on_tool_error!r}.")
        if max_calls_per_turn < 1 or max_output_chars < 1:
            raise ValueError("`max_calls_per_turn` and `max_output_chars` must be >= 1.")
        self.tools = {tool.name: tool for tool in tools}
        self.call_format = call_format or HermesCalls()
        self.on_tool_error = on_tool_error
        self.max_calls_per_turn = max_calls_per_turn
        self.max_output_chars = max_output_chars
        self.score = load_callable(score, "model.agent.environment.init_args.score") if score else None

    def reset(self, row: dict, seed: int) -> Episode:
        return ToolEpisode(self, row)

    def row_problem(self, fields: frozenset[str]) -> str | None:
        """``score`` is called ``score(prompt, final answer, **fields)``: its parameters against the fields."""
        if self.score is None:
            return None
        mismatch = field_mismatch(self.score, fields)
        what = f"`model.agent.environment.init_args.score` {signature_of(self.score)}"
        return None if mismatch is None else mismatch.describe(what, fields)

    def tool_schemas(self) -> list[dict] | None:
        return [tool.schema() for tool in self.tools.values()] or None

    def call(self, call: Call, row: dict) -> tuple[str, bool]:
        """A call's result text, and whether it failed."""
        tool = self.tools.get(call.name)
        try:
            if call.error is not None:
                raise ToolError(call.error)
            if tool is None:
                raise ToolError(f"no tool named {call.name!r} (tools: {', '.join(self.tools)})")
            tool.check_arguments(call.arguments)
            text = _within(tool, call.arguments, row)
        except Exception as err:  # noqa: BLE001 (every failure of a call is an observation, or stops the run)
            if self.on_tool_error == "raise" or isinstance(err, WorkerLost):  # the process, not the tool, failed
                raise
            message = str(err) if isinstance(err, ToolError | TimeoutError) else f"{type(err).__name__}: {err}"
            return f"error: {message}", True
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + f"\n[output cut at {self.max_output_chars} characters]"
        return text, False


class ToolEpisode(Episode):
    def __init__(self, env: ToolEnvironment, row: dict) -> None:
        self.env, self.row = env, row

    def step(self, text: str) -> Observation:
        calls = self.env.call_format.parse(text)
        if not calls:  # the final answer
            score = self.env.score
            return Observation(done=True, reward=None if score is None else float(score(self.row.get("prompt", ""), text, **public_fields(self.row))))
        t0 = time.monotonic()
        results, errors = [], 0
        for k, call in enumerate(calls):
            if k >= self.env.max_calls_per_turn:
                results.append(f"error: more than {self.env.max_calls_per_turn} calls in one turn")
                errors += 1
                continue
            result, failed = self.env.call(call, self.row)
            results.append(result)
            errors += failed
        figures = {"tool_calls": float(len(calls)), "tool_errors": float(errors), "tool_seconds": time.monotonic() - t0}
        return Observation(self.env.call_format.render(results), role="tool", figures=figures)


def _within(tool: Tool, arguments: dict, row: dict) -> str:
    """``tool.run`` on a worker thread of its own (episodes call tools at once), at most ``tool.timeout_s``
    (a tool that never returns is left behind: a Python thread cannot be stopped; the Python tool kills its
    own process)."""
    try:
        with TimedCaller(tool.timeout_s, name=f"yatt-tool-{tool.name}") as caller:  # its thread ends with the call
            return str(caller(tool.run, arguments, row, tool.timeout_s))
    except DeadlineExceeded:
        raise TimeoutError(f"{tool.name} did not return within {tool.timeout_s:g} s") from None
