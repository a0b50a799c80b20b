"""Episodes driven by the user's own agent through an OpenAI-compatible endpoint.

``environment: OpenAIEndpoint`` (with ``function: my_agent.run``): for each sample the rollout calls
``run(row, base_url, api_key)`` on a thread of its own; the function talks to the endpoint
(:mod:`~yatt_lightning.agents.openai_server`) as to any OpenAI-compatible server (the ``openai`` client:
``OpenAI(base_url=base_url, api_key=api_key)``), calling its own tools in between, and returns the episode's
reward (or ``None``: the reward functions score the episode's text). Its requests become one trajectory,
token-exact: the first request's messages are rendered once (the episode's prompt); each later request must
continue the conversation as the endpoint answered it (the earlier messages and the assistant's replies as
they came), and only its new messages are tokenized, once, between the engine's own ids. A request that
rewrites the history is answered with an error (409) and counted (``agent/env_errors``): an episode is one
conversation.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from yatt_lightning.agents.environment import Environment, Episode
from yatt_lightning.agents.openai_server import ChatRequest, ChatServer, reply
from yatt_lightning.agents.runner import Budgets, EpisodeState
from yatt_lightning.agents.turn_tokens import TurnTokens
from yatt_lightning.chat import messages_text, render
from yatt_lightning.engines.base import Completion, SamplingConfig
from yatt_lightning.rewards.base import load_callable


class OpenAIEndpoint(Environment):
    """Args:
    function: Dotted import path of ``f(row, base_url, api_key) -> float | None``: your agent, run once per
        episode against the endpoint (the API key names the episode).
    """

    def __init__(self, function: str) -> None:
        self.function = load_callable(function, "model.agent.environment.init_args.function")

    def reset(self, row: dict, seed: int) -> Episode:
        raise TypeError("OpenAIEndpoint's episodes are driven by the agent function, not by reset/step")


class _Endpoint(EpisodeState):
    """An episode of the agent function: the conversation the endpoint has answered so far."""

    messages: list[dict] | None = None  # the last request's messages and the reply, as answered
    request: ChatRequest | None = None  # waiting for the engine
    outcome: tuple | None = None  # the function's (ok, reward or error) once it returned


def run_endpoint_episodes(
    engine, endpoint: OpenAIEndpoint, rows: list[dict], prompt_ids: list[list[int]], seeds: list[int],
    sampling: SamplingConfig, budgets: Budgets, tokens: TurnTokens,
) -> Iterator[tuple[int, list[Completion]]]:  # fmt: skip
    """``(prompt index, its n episodes)`` as each prompt's episodes end (as
    :func:`~yatt_lightning.agents.runner.run_episodes`). An episode whose function returned before any
    request is the row's prompt and the end-of-text token, which the loss skips (counted as an error)."""
    server = ChatServer(timeout_s=budgets.step_timeout_s)
    states: dict[str, _Endpoint] = {}
    returned: queue.Queue = queue.Queue()
    for g, (row, seed) in enumerate(zip(rows, seeds, strict=True)):
        for j in range(sampling.n):
            key = f"episode-{g}-{j}"
            states[key] = _Endpoint(key, g, row, list(prompt_ids[g]), (seed * 1_000_003 + j * 10_007) % 2**31)
    left, finished, running = [sampling.n] * len(rows), [], 0

    def call(state: _Endpoint) -> None:
        try:
            state.outcome = (True, endpoint.function(state.row, server.base_url, state.key))
        except BaseException as err:  # noqa: BLE001 (handed to the runner)
            state.outcome = (False, err)
        returned.put(state)

    def finish(state: _Endpoint) -> None:
        if state.done:
            return
        state.done, left[state.group] = True, left[state.group] - 1
        if left[state.group] == 0:
            finished.append(state.group)

    def refuse(request: ChatRequest, code: int, message: str, state: _Endpoint | None = None) -> None:
        request.error = (code, message)
        request.done.set()
        if state is not None:
            state.figures["env_errors"] += 1

    def take(request: ChatRequest) -> None:
        nonlocal running
        state = states.get(request.episode)
        if state is None or state.done:
            return refuse(request, 401, "unknown or finished episode (use the api_key the agent was given)")
        if state.request is not None:
            return refuse(request, 409, "one request at a time per episode", state)
        between: list[int] = []
        if state.messages is None:  # the first request: the episode's prompt, rendered once
            state.prompt_ids = _first(tokens, request.messages)
        else:
            if request.messages[: len(state.messages)] != state.messages or len(request.messages) == len(state.messages):
                return refuse(request, 409, "the request does not continue the episode's conversation as answered", state)
            between = tokens.after_turn(state.last_turn, request.messages[len(state.messages) :])
        room = budgets.max_total_tokens - len(state.prompt_ids) - len(state.ids) - len(between)
        if room < 1 or state.figures["turns"] >= budgets.max_turns:  # the episode ends with the model's last turn
            state.finish_reason, state.figures["truncated"] = "length", 1.0
            return refuse(request, 400, "the episode's budget (model.agent max_turns / max_total_tokens) is spent")
        state.add_observation(between)
        state.messages, state.request = list(request.messages), request
        turn = int(state.figures["turns"])
        engine.add_turn(state.key, state.prompt_ids + state.ids, sampling, (state.seed + turn) % 2**31,
                        min(budgets.max_tokens_per_turn, room, request.max_tokens or room))  # fmt: skip
        running += 1

    threads = [threading.Thread(target=call, args=(s,), name=f"yatt-agent-{s.key}", daemon=True) for s in states.values()]
    try:
        for thread in threads:
            thread.start()
        while True:  # groups are handed out at the top, so the last ones too before the loop ends
            while finished:
                g = finished.pop(0)
                yield g, [_completion(states[f"episode-{g}-{j}"]) for j in range(sampling.n)]
            if not any(left):
                break
            block = 0.0 if running else 0.05
            try:
                while True:
                    take(server.requests.get(timeout=block) if block else server.requests.get_nowait())
                    block = 0.0
            except queue.Empty:
                pass
            if running:
                for key, completion in engine.step_turns():
                    running -= 1
                    state = states[key]
                    state.add_turn(completion)
                    text = tokens.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                    state.messages.append({"role": "assistant", "content": text})
                    request, state.request = state.request, None
                    request.reply = reply(text, completion.finish_reason, len(state.prompt_ids), len(completion.token_ids))
                    request.done.set()
            while not returned.empty():
                state = returned.get_nowait()
                ok, value = state.outcome
                if not ok:
                    if budgets.on_error == "raise":
                        raise RuntimeError(f"the agent function raised {type(value).__name__}: {value}") from value
                    state.figures["env_errors"] += 1
                elif value is not None and state.rewards:
                    state.rewards[-1] += float(value)
                if not state.ends:  # no request: nothing the model said to train on
                    state.add_observation([tokens.tokenizer.eos_token_id])
                    state.figures["env_errors"] += 1
                finish(state)
    finally:
        engine.abort_turns()
        server.close()


def _first(tokens: TurnTokens, messages: list[dict]) -> list[int]:
    if tokens.chat:
        return render(tokens.tokenizer, messages)
    return list(tokens.tokenizer(messages_text(messages), add_special_tokens=True)["input_ids"])


def _completion(state: _Endpoint) -> Completion:
    out = state.completion()
    out.prompt_ids = state.prompt_ids
    return out

