"""Many episodes at once on one engine: each episode's next turn goes to the engine as soon as its
observation is ready, and the environments answer on worker threads while the engine generates for the
other episodes.

The runner owns the order; the engine runs turns (``add_turn`` / ``step_turns``), the episodes answer
them (:meth:`~yatt_lightning.agents.environment.Episode.step`). Each environment call runs on a thread of
its own with a deadline: a call past it is abandoned (a Python thread cannot be stopped), and the episode
ends with the error counted, or the run stops naming the row (``on_error: raise``). A group (a prompt's
``n`` episodes) is yielded as soon as its last episode ends, as the engine's ``generate_stream`` yields
groups, so the long-tail policies work on episodes as they do on completions.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from yatt_lightning.agents.environment import Episode, Observation
from yatt_lightning.agents.turn_tokens import TurnTokens
from yatt_lightning.engines.base import AGENT_FIGURES, Completion, SamplingConfig, Turns


@dataclass
class EpisodeState:
    """One episode in flight: its prompt, what it has so far and how it is made."""

    key: str
    group: int  # the prompt's index
    row: dict
    prompt_ids: list[int]
    seed: int
    episode: Episode | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=lambda: dict.fromkeys(AGENT_FIGURES, 0.0))
    versions: tuple[int, int] | None = None
    last_turn: list[int] = field(default_factory=list)  # the ids of the model's last turn
    finish_reason: str = "stop"
    done: bool = False

    def add_turn(self, completion: Completion) -> None:
        self.last_turn = list(completion.token_ids)
        self.ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.mask += [1] * len(completion.token_ids)
        self.ends.append(len(self.ids) - 1)
        self.rewards.append(0.0)
        self.figures["turns"] += 1
        if completion.versions is not None:
            first = completion.versions[0] if self.versions is None else self.versions[0]
            self.versions = (first, completion.versions[1])

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def completion(self) -> Completion:
        turns = Turns(self.mask, self.ends, self.rewards, self.figures)
        return Completion(self.ids, self.logprobs, self.finish_reason, self.versions, turns)


@dataclass(frozen=True)
class Budgets:
    """An episode's limits (see :class:`~yatt_lightning.agents.agent.Agent`)."""

    max_turns: int
    max_tokens_per_turn: int
    max_total_tokens: int
    step_timeout_s: float
    on_error: str
    deterministic: bool = False


class _Call:
    """One environment call on a thread of its own; its result goes to ``done`` (a queue) when it returns."""

    def __init__(self, state: EpisodeState, text: str, done: queue.Queue, timeout_s: float) -> None:
        self.state, self.deadline, self.started = state, time.monotonic() + timeout_s, time.monotonic()
        self.result: Observation | BaseException | None = None

        def run() -> None:
            try:
                self.result = state.episode.step(text)
            except BaseException as err:  # noqa: BLE001 (handed to the runner, which decides)
                self.result = err
            done.put(self)

        threading.Thread(target=run, name=f"yatt-env-{state.key}", daemon=True).start()


def run_episodes(
    engine,
    environment,
    rows: list[dict],
    prompt_ids: list[list[int]],
    seeds: list[int],
    sampling: SamplingConfig,
    budgets: Budgets,
    tokens: TurnTokens,
) -> Iterator[tuple[int, list[Completion]]]:
    """``(prompt index, its n episodes as completions)`` as each prompt's episodes all end; closing it
    early aborts the turns still running."""
    n = sampling.n
    states = {}
    for g, (row, ids, seed) in enumerate(zip(rows, prompt_ids, seeds, strict=True)):
        for j in range(n):
            key = f"{g}.{j}"
            states[key] = EpisodeState(key, g, row, list(ids), (seed * 1_000_003 + j * 10_007) % 2**31)
    left = [n] * len(rows)
    answered: queue.Queue = queue.Queue()
    calls: dict[str, _Call] = {}
    running = 0

    def next_turn(state: EpisodeState) -> None:
        nonlocal running
        room = budgets.max_total_tokens - len(state.prompt_ids) - len(state.ids)
        if room < 1 or state.figures["turns"] >= budgets.max_turns:
            return finish(state, truncated=True)
        turn = int(state.figures["turns"])
        engine.add_turn(state.key, state.prompt_ids + state.ids, sampling, (state.seed + turn) % 2**31,
                        min(budgets.max_tokens_per_turn, room))  # fmt: skip
        running += 1

    finished: list[int] = []

    def finish(state: EpisodeState, truncated: bool = False) -> None:
        state.done = True
        if truncated:
            state.finish_reason = "length"
            state.figures["truncated"] = 1.0
        left[state.group] -= 1
        if left[state.group] == 0:
            finished.append(state.group)

    def answer(call: _Call) -> None:
        state, result = call.state, call.result
        state.figures["env_seconds"] += time.monotonic() - call.started
        if isinstance(result, BaseException) or result is None:
            late = result is None
            what = (f"did not answer within {budgets.step_timeout_s:g} s (`model.agent.step_timeout_s`)" if late
                    else f"raised {type(result).__name__}: {result}")  # fmt: skip
            if budgets.on_error == "raise":
                raise RuntimeError(f"the agent's environment {what} on the row {_clip(state.row)}") from (
                    None if late else result
                )
            state.figures["env_errors"] += 1
            return finish(state, truncated=True)
        for key, value in result.figures.items():
            state.figures[key] = state.figures.get(key, 0.0) + float(value)
        if result.reward is not None:
            state.rewards[-1] += float(result.reward)
        if result.done:
            return finish(state)
        if state.figures["turns"] >= budgets.max_turns:
            return finish(state, truncated=True)  # out of turns: the episode ends with the model's turn
        between = tokens.between(state.last_turn, result)
        if len(state.prompt_ids) + len(state.ids) + len(between) >= budgets.max_total_tokens:
            return finish(state, truncated=True)  # no room for the observation and a turn after it
        state.add_observation(between)
        next_turn(state)

    try:
        for state in states.values():
            state.episode = environment.reset(state.row, state.seed)
            next_turn(state)
        while True:  # groups are handed out at the top, so the last ones too before the loop ends
            while finished:
                g = finished.pop(0)
                yield g, [states[f"{g}.{j}"].completion() for j in range(n)]
            if not any(left):
                break
            if running:
                for key, completion in engine.step_turns():
                    running -= 1
                    state = states[key]
                    state.add_turn(completion)
                    calls[key] = _Call(state, tokens.tokenizer.decode(completion.token_ids, skip_special_tokens=True),
                                       answered, budgets.step_timeout_s)  # fmt: skip
                block = 0.0
            else:
                soonest = min((c.deadline for c in calls.values()), default=time.monotonic() + 1.0)
                block = max(0.0, soonest - time.monotonic())
            if budgets.deterministic:  # every answer before the next engine step, in the episodes' order
                for call in _settle(answered, calls):
                    answer(call)
                continue
            _drain(answered, calls, answer, block)
            now = time.monotonic()
            for key in [k for k, c in calls.items() if c.deadline <= now and c.result is None]:
                answer(calls.pop(key))  # abandoned: its thread may still return, unheard
    finally:
        engine.abort_turns()


def _drain(answered: queue.Queue, calls: dict, answer, block: float) -> None:
    """Hand every returned call to ``answer`` (waiting up to ``block`` seconds for the first)."""
    while True:
        try:
            call = answered.get(timeout=block) if block > 0 else answered.get_nowait()
        except queue.Empty:
            return
        block = 0.0
        if calls.get(call.state.key) is call:  # not one abandoned at its deadline
            answer(calls.pop(call.state.key))


def _settle(answered: queue.Queue, calls: dict) -> list[_Call]:
    """Every call in flight, once each has answered or passed its deadline, in the episodes' order (so the
    engine gets the next turns in the same order whatever the threads' timing)."""
    while any(c.result is None and time.monotonic() < c.deadline for c in calls.values()):
        soonest = min(c.deadline for c in calls.values() if c.result is None)
        try:
            answered.get(timeout=max(0.0, soonest - time.monotonic()))
        except queue.Empty:
            pass
    while not answered.empty():  # their wake-ups, read
        answered.get_nowait()
    return [calls.pop(key) for key in sorted(calls)]


def _clip(row: dict) -> str:
    text = repr({k: v for k, v in row.items() if not k.startswith("_")})
    where = f" ({row['_source']})" if "_source" in row else ""
    return (text if len(text) <= 200 else text[:200] + "...") + where
