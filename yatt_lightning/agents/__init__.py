"""Multi-turn agentic RL: environments, tools, and episodes run concurrently on the rollout engine.

``model.agent`` (:class:`Agent`) turns each sample into an episode of an :class:`Environment`; the
trajectory trained on is the engine's sampled ids with the observations' ids between them (each observation
tokenized once), the loss covers only the model's own tokens, and each turn's reward lands on its last
token (:class:`EnvironmentReward`).
"""

from yatt_lightning.agents.agent import Agent
from yatt_lightning.agents.calls import Call, CallFormat, HermesCalls, RegexCalls
from yatt_lightning.agents.endpoint import OpenAIEndpoint
from yatt_lightning.agents.environment import Environment, Episode, Observation
from yatt_lightning.agents.games import GuessEnvironment, lookup_score
from yatt_lightning.agents.reward import EnvironmentReward
from yatt_lightning.agents.sandbox import Python
from yatt_lightning.agents.tool_env import ToolEnvironment
from yatt_lightning.agents.tools import Calculator, Lookup, Tool, ToolError

__all__ = [
    "Agent", "Calculator", "Call", "CallFormat", "Environment", "EnvironmentReward", "Episode", "GuessEnvironment",
    "HermesCalls", "Lookup", "Observation", "OpenAIEndpoint", "Python", "RegexCalls", "Tool", "ToolEnvironment", "ToolError",
    "lookup_score",
]  # fmt: skip
