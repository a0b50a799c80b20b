"""What a rollout engine is: the protocol the strategy drives, and the data it returns."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch


@dataclass
class SamplingConfig:
    """How completions are sampled.

    Args:
        n: Completions per prompt (the group size for GRPO).
        max_new_tokens: Longest completion, in tokens.
        temperature: Sampling temperature; the policy's logprobs in the loss use the same temperature.
        top_p: Nucleus sampling mass (1.0 = off).
        top_k: Keep the k most likely tokens (-1 = off).
    """

    n: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"`model.sampling.n` must be >= 1, got {self.n}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"`model.sampling.max_new_tokens` must be >= 1, got {self.max_new_tokens}.")
        if self.temperature <= 0:
            raise ValueError(
                f"`model.sampling.temperature` must be > 0, got {self.temperature}; RL needs sampling, not greedy decoding."
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`model.sampling.top_p` must be in (0, 1], got {self.top_p}.")


# An episode's figures (Turns.figures), summed over the step's episodes and logged per episode as
# ``agent/<name>_per_episode`` (``agent/truncated``: the step's episodes cut short by a budget).
AGENT_FIGURES = ("turns", "tool_calls", "tool_errors", "tool_seconds", "env_seconds", "env_errors", "truncated")


@dataclass
class Turns:
    """How a multi-turn completion (an agent's episode) is made: per token whether the model sampled it (1)
    or it is an observation's (0: a tool's result, the environment's reply, the chat template's tokens
    between turns), where each of the model's turns ends, the environment's reward of each turn, and the
    episode's figures (``agent/...``, summed over samples)."""

    mask: list[int]
    ends: list[int]  # the index of each model turn's last token in the completion
    rewards: list[float]  # one per turn (0.0 where the environment gave none)
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class Completion:
    """One sampled completion: its token ids and the engine's logprob of each token (0.0 for an
    observation's tokens in a multi-turn completion, whose ``turns`` say which tokens the model sampled)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "length"
    versions: tuple[int, int] | None = None  # (first, last) policy version of its tokens, when the engine tracks them
    turns: Turns | None = None  # a multi-turn completion's structure
    prompt_ids: list[int] | None = None  # the prompt it continues, when not its row's (an agent's own first request)


class WeightFeed(Protocol):
    """Newer weights an engine may apply between its own steps, in the middle of a generation
    (asynchronous RL: :class:`~yatt_lightning.placement.weight_channel.LiveWeights`)."""

    version: int | None  # the policy version the engine holds

    def newer(self) -> list[tuple[str, torch.Tensor]] | None:
        """A newer version's tensors to load now (``version`` is then that version's), or None."""


@runtime_checkable
class RolloutEngine(Protocol):
    """An inference engine the strategy owns: started once, fed fresh weights before each rollout."""

    def start(
        self,
        model_path: Path,
        *,
        tensor_parallel_size: int,
        seed: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: str,
    ) -> None:
        """Create the engine for the model in ``model_path`` (a Hugging Face folder)."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Completion]]:
        """``sampling.n`` completions for each prompt (token ids); ``seeds[i]`` seeds prompt i's samples."""

    def generate_stream(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int],
        max_new_tokens: list[int] | None = None,
    ) -> Iterator[tuple[int, list[Completion]]]:
        """``(prompt index, its completions)`` as each prompt's samples finish (the long-tail policies and
        partial colocation consume groups in this order); closing it early aborts the rest.
        ``max_new_tokens`` overrides ``sampling.max_new_tokens`` per prompt."""

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) Hugging Face-named tensors into the running engine, in place."""

    def sleep(self) -> None:
        """Free the engine's device memory (weights and KV cache) until :meth:`wake_up`."""

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed."""

    def shutdown(self) -> None:
        """Stop the engine and release everything it holds."""
