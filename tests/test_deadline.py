"""Tier 1: calls under a deadline (rewards, judges, tools) leave no thread behind, and a process that cannot
run a call stops the run instead of scoring zeros or observing errors forever."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from yatt_lightning.agents import ToolEnvironment
from yatt_lightning.agents.calls import Call
from yatt_lightning.agents.tools import Tool
from yatt_lightning.rewards.deadline import DeadlineExceeded, TimedCaller, WorkerLost


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def _settle(prefix: str, expected: int, within_s: float = 5.0) -> int:
    deadline = time.monotonic() + within_s
    while _threads(prefix) > expected and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return _threads(prefix)


def test_a_caller_per_call_leaves_no_thread_behind():
    """A caller made for one call (as each tool call makes one) ends its worker when closed or collected:
    500 calls, no thread left (each worker waited on its queue forever before: 26,342 threads in an agent run)."""
    for _ in range(250):
        with TimedCaller(5.0, name="yatt-test-closed") as caller:
            assert caller(lambda x: x + 1, 1) == 2
    for _ in range(250):
        assert TimedCaller(5.0, name="yatt-test-dropped")(lambda: 3) == 3  # dropped without close: collected
    assert _settle("yatt-test-closed", 0) == 0
    assert _settle("yatt-test-dropped", 0) == 0


def test_an_abandoned_call_ends_its_worker_when_it_returns_and_a_kept_caller_reuses_one():
    release = threading.Event()
    caller = TimedCaller(0.2, name="yatt-test-late")
    with pytest.raises(DeadlineExceeded):
        caller(release.wait)
    assert caller.abandoned == 1 and _threads("yatt-test-late") == 1  # still in the call
    assert caller(lambda: 5) == 5  # a new worker serves the next call
    release.set()
    assert _settle("yatt-test-late", 1) == 1  # the abandoned one ended as its call returned; one serves
    for k in range(20):
        assert caller(lambda k=k: k) == k
    assert _threads("yatt-test-late") == 1
    caller.close()
    assert _settle("yatt-test-late", 0) == 0


def test_no_thread_to_run_a_call_stops_the_run_instead_of_becoming_a_tool_error(monkeypatch):
    """A process out of threads cannot run a tool: that is not the tool's failure to observe (every later call
    would fail the same way and the run would go on learning nothing); it raises WorkerLost, which stops the run."""

    class Echo(Tool):
        name = "echo"
        description = "echo"
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

        def run(self, arguments: dict, row: dict, timeout_s: float) -> str:
            return arguments["text"]

    env = ToolEnvironment([Echo()])  # on_tool_error: observe
    assert env.call(Call("echo", {"text": "hi"}), {}) == ("hi", False)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(WorkerLost, match="no thread to run the call on"):
        env.call(Call("echo", {"text": "hi"}), {})
    with pytest.raises(WorkerLost):
        TimedCaller(1.0, name="yatt-test-none")(lambda: 1)
