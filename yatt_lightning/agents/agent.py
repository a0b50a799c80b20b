"""``model.agent``: multi-turn rollouts. Each sample is an episode of an environment, its completion the
model's turns with the observations between them (:mod:`~yatt_lightning.agents.runner`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from yatt_lightning.agents.endpoint import OpenAIEndpoint, run_endpoint_episodes
from yatt_lightning.agents.environment import Environment
from yatt_lightning.agents.runner import Budgets, run_episodes
from yatt_lightning.agents.turn_tokens import TurnTokens
from yatt_lightning.engines.base import Completion


class Agent:
    """Multi-turn episodes in an environment instead of one completion per sample.

    Args:
        environment: What the model acts in (``class_path``: a
            :class:`~yatt_lightning.agents.tool_env.ToolEnvironment`, a game, your own
            :class:`~yatt_lightning.agents.environment.Environment`).
        max_turns: The model's turns per episode at most; an episode still going after them is cut short
            (counted in ``agent/truncated``).
        max_tokens_per_turn: Tokens the model may sample in one turn.
        max_total_tokens: The episode's whole sequence at most (prompt, turns and observations); an episode
            with no room for an observation and one more token is cut short. ``None``: the model's positions.
        step_timeout_s: How long the environment may take to answer one turn (a tool call included).
        on_error: An environment that raises or runs past ``step_timeout_s``: ``raise`` stops the run naming
            the row; ``end`` ends the episode there (counted in ``agent/env_errors``). Tools' own errors are
            the tool environment's (``on_tool_error``): they become observations.
        deterministic: The answers of one engine step all reach the engine before its next step, in the
            episodes' order, so a run (and a run killed and resumed) samples the same tokens whatever the
            threads' timing; environments then no longer answer while the engine generates. The
            environments must be deterministic too (``reset``'s seed).
    """

    def __init__(
        self,
        environment: Environment,
        max_turns: int = 4,
        max_tokens_per_turn: int = 32,
        max_total_tokens: int | None = None,
        step_timeout_s: float = 60.0,
        on_error: Literal["raise", "end"] = "raise",
        deterministic: bool = False,
    ) -> None:
        if not isinstance(environment, Environment):
            raise ValueError(
                f"`model.agent.environment` must be an Environment (a class_path to a subclass of "
                f"yatt_lightning.agents.Environment), got {type(environment).__name__}."
            )
        for key, value in (("max_turns", max_turns), ("max_tokens_per_turn", max_tokens_per_turn)):
            if value < 1:
                raise ValueError(f"`model.agent.{key}` must be >= 1, got {value}.")
        if max_total_tokens is not None and max_total_tokens < 2:
            raise ValueError(f"`model.agent.max_total_tokens` must be >= 2, got {max_total_tokens}.")
        if step_timeout_s <= 0:
            raise ValueError(f"`model.agent.step_timeout_s` must be > 0, got {step_timeout_s}.")
        if on_error not in ("raise", "end"):
            raise ValueError(f"`model.agent.on_error` must be 'raise' or 'end', got {on_error!r}.")
        self.environment = environment
        self.max_turns = max_turns
        self.max_tokens_per_turn = max_tokens_per_turn
        self.max_total_tokens = max_total_tokens
        self.step_timeout_s = step_timeout_s
        self.on_error = on_error
        self.deterministic = deterministic
        self.tokens: TurnTokens | None = None

    def configure(self, tokenizer, chat: bool, model_path, max_prompt_tokens: int) -> None:
        """Bind the policy's tokenizer (``chat``: observations go through its chat template) and check the
        budgets against the positions of the model in ``model_path`` (before any engine starts)."""
        from transformers import AutoConfig

        from yatt_lightning.models.families import arch_of

        positions = arch_of(AutoConfig.from_pretrained(model_path)).max_position_embeddings
        if self.max_total_tokens is None:
            self.max_total_tokens = positions
        if self.max_total_tokens > positions:
            raise ValueError(
                f"`model.agent.max_total_tokens`={self.max_total_tokens} is more than the policy's "
                f"{positions} positions; set it to at most {positions}."
            )
        if self.max_total_tokens <= max_prompt_tokens:
            raise ValueError(
                f"`model.agent.max_total_tokens`={self.max_total_tokens} leaves no room after a prompt of "
                f"`model.max_prompt_tokens`={max_prompt_tokens}; raise it or lower `model.max_prompt_tokens`."
            )
        self.tokens = TurnTokens(tokenizer, chat)

    def tool_schemas(self) -> list[dict] | None:
        """The environment's tools as a chat template's ``tools`` (the prompts describe them), or None."""
        return self.environment.tool_schemas()

    def episodes(self, engine, request) -> Iterator[tuple[int, list[Completion]]]:
        """``(prompt index, its n episodes)`` for a :class:`~yatt_lightning.rollout.types.RolloutRequest`, as
        each prompt's episodes end."""
        if self.tokens is None:
            raise RuntimeError("model.agent was used before the module configured it with the tokenizer")
        if request.max_new_tokens is not None:
            raise ValueError("`model.long_tail`: partial rollouts of episodes are not supported; use WaitForAll or OverProvision.")
        budgets = Budgets(self.max_turns, self.max_tokens_per_turn, self.max_total_tokens, self.step_timeout_s,
                          self.on_error, self.deterministic)  # fmt: skip
        if isinstance(self.environment, OpenAIEndpoint):  # the user's agent drives the episodes over HTTP
            return run_endpoint_episodes(engine, self.environment, request.rows, request.prompt_ids, request.seeds,
                                         request.sampling, budgets, self.tokens)  # fmt: skip
        return run_episodes(
            engine, self.environment, request.rows, request.prompt_ids, request.seeds, request.sampling, budgets,
            self.tokens,
        )  # fmt: skip
