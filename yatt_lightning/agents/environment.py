"""What an agent acts in: an :class:`Environment` (chosen by ``class_path``) starts one :class:`Episode` per
sample, and each episode answers the model's turns with :class:`Observation` s.

An episode starts from its row's prompt (the module's prompt ids, as every rollout). After each of the
model's turns the episode gets the turn's text and returns what the model sees next (text, or token ids
when the environment tokenizes itself), the turn's reward (optional) and whether the episode is done.
Tools are one kind of environment (:class:`~yatt_lightning.agents.tool_env.ToolEnvironment`). An episode's
:meth:`Episode.step` runs on a worker thread while the engine generates for the other episodes, so it may
block (a tool call); it must not touch the engine or the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one turn of the model.

    Args:
        text: What the model sees next (a tool's result, the game's reply), rendered as the next message of
            the conversation (a ``tool`` message with a chat template, else the text as it is).
        token_ids: The same as token ids, when the environment tokenizes itself (used as they are).
        reward: The reward of the turn just taken (lands on its last token), or ``None``.
        done: The episode ends here (no further turn).
        role: The chat role of the observation's message (``tool`` for a tool's result, ``user`` for a
            reply).
        figures: Counts to add to the episode's figures (``tool_calls``, ``tool_errors``, ``tool_seconds``).
    """

    text: str = ""
    token_ids: list[int] | None = None
    reward: float | None = None
    done: bool = False
    role: str = "tool"
    figures: dict[str, float] = field(default_factory=dict)


class Episode:
    """One sample's episode. Subclasses implement :meth:`step`."""

    def step(self, text: str) -> Observation:
        """The observation after the model's turn ``text`` (what the engine sampled, decoded)."""
        raise NotImplementedError


class Environment:
    """Base class: :meth:`reset` starts an episode for a row. Constructor arguments are the config
    (``model.agent.environment.init_args``), checked at construction."""

    def reset(self, row: dict, seed: int) -> Episode:
        """A new episode for ``row`` (the dataset's row); ``seed`` is the sample's (an environment that draws
        at random draws from it, so that a run is reproducible)."""
        raise NotImplementedError

    def tool_schemas(self) -> list[dict] | None:
        """Tools the prompts should describe (OpenAI's function format, rendered by the chat template), or
        None."""
        return None

    def row_problem(self, fields: frozenset[str]) -> str | None:
        """What would stop this environment scoring a row with these public fields (its own reward function's
        parameters against them), checked before any engine starts; ``None``: nothing."""
        return None

    def check_row(self, row: dict, where: str) -> None:
        """Raise a ValueError naming ``where`` (the row's source) if this environment cannot run ``row``."""
