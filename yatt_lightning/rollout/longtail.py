"""Long-tail mitigation: a few very long responses should not hold up a whole step.

With long-tailed response lengths, most of a rollout's wall time can go to the last few samples while
the devices sit mostly idle. Three policies, chosen with ``model.long_tail``:

* :class:`WaitForAll` (default): every prompt is generated to the end. Unbiased.
* :class:`OverProvision`: launch more prompts than a step trains on and keep the groups that finish
  first; the rest are aborted. **Bias**: prompts whose responses are long are kept less often, so the
  policy sees short-answer prompts more than the data holds (and long reasoning less).
* :class:`PartialRollout`: cap the tokens generated per step; samples not finished continue in the next
  step (with the weights of that step) and their group trains once all its samples are finished.
  **Bias**: a continued sample's early tokens were drawn from an older policy but are trained on as if
  drawn from the current one (the PPO ratio's "old" logprobs are recomputed with the current weights),
  an off-policy error that grows with the number of rounds a sample spans.

In partial colocation, scoring already overlaps generation; ``OverProvision`` works there too.
``PartialRollout`` works with full colocation and the parallel controller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from yatt_lightning.distributed.seeding import sampling_seed
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.rollout.types import Generation, Plan, RolloutRequest

MinOverRanks = Callable[[list[float]], list[float]]


class LongTailPolicy:
    """Base class: how a step's request is generated. :meth:`plan` says what to ask the engines for (and
    how many groups to keep); :meth:`collect` turns what came back into the step's batch. A policy's figures
    of the step travel in the batch it returns (``RolloutBatch.metrics``)."""

    def keep_count(self, n_prompts: int) -> int:
        return n_prompts

    def plan(self, request: RolloutRequest, run_seed: int) -> Plan:
        """What to generate for ``request``: here the request itself, keeping the first groups to finish."""
        return Plan(request, self.keep_count(len(request.prompt_ids)))

    def collect(
        self, plan: Plan, generation: Generation | None, tokenizer, min_over_ranks: MinOverRanks
    ) -> RolloutBatch:
        """This step's rollouts from the planned generation (``min_over_ranks``: a collective, for policies
        whose ranks must agree on a count)."""
        request, groups = plan.request, generation.groups
        metrics = {}
        if plan.keep < len(request.prompt_ids):
            metrics["long_tail/kept_groups"] = float(sum(g is not None for g in groups))
        return RolloutBatch.from_groups(request.rows, request.prompt_ids, groups, tokenizer, metrics)


class WaitForAll(LongTailPolicy):
    """Generate every prompt to the end (no mitigation, no bias)."""


class OverProvision(LongTailPolicy):
    """Launch ``data.batch_size`` prompts, train on the ``batch_size / (1 + extra)`` that finish first.

    Args:
        extra: Fraction of prompts launched beyond those trained on (0.25: 25% more).
    """

    def __init__(self, extra: float = 0.25) -> None:
        if extra <= 0:
            raise ValueError(f"`model.long_tail.extra` must be > 0, got {extra}.")
        self.extra = extra

    def keep_count(self, n_prompts: int) -> int:
        return max(1, math.floor(n_prompts / (1 + self.extra) + 1e-9))


@dataclass
class _Pending:
    row: dict
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = "length"
    versions: tuple[int, int] = (-1, -1)  # (first, last) policy version its tokens came from

    def copy(self) -> _Pending:
        return dataclasses.replace(self, token_ids=list(self.token_ids), logprobs=list(self.logprobs))


class PartialRollout(LongTailPolicy):
    """Generate at most ``max_new_tokens_per_step`` tokens per sample per step; unfinished samples continue.

    Args:
        max_new_tokens_per_step: Token budget per sample in one step (``sampling.max_new_tokens`` stays
            the limit of the whole response).
    """

    def __init__(self, max_new_tokens_per_step: int = 64) -> None:
        if max_new_tokens_per_step < 1:
            raise ValueError(f"`model.long_tail.max_new_tokens_per_step` must be >= 1, got {max_new_tokens_per_step}.")
        self.max_new_tokens_per_step = max_new_tokens_per_step
        self.carried: list[list[_Pending]] = []  # groups still generating, then groups finished but not yet trained
        self._next: list[list[_Pending]] | None = None  # ``carried`` once the step commits

    def plan(self, request: RolloutRequest, run_seed: int) -> Plan:
        """One round for every unfinished sample, of this step's prompts and the carried ones: each continues
        from its tokens so far, with at most ``max_new_tokens_per_step`` more. The carried groups change only
        at :meth:`commit` (when the step is done): a step that fails leaves them as they were."""
        n, total = request.sampling.n, request.sampling.max_new_tokens
        groups = [[sample.copy() for sample in group] for group in self.carried]
        groups += [
            [_Pending(row, ids) for _ in range(n)] for row, ids in zip(request.rows, request.prompt_ids, strict=True)
        ]
        todo = [(g, s) for g, group in enumerate(groups) for s, sample in enumerate(group) if not sample.finished]
        if not todo:
            return Plan(None, 0, (groups, []))
        cap = min(self.max_new_tokens_per_step, total)
        sampling = dataclasses.replace(request.sampling, n=1, max_new_tokens=cap)
        pending = [groups[g][s] for g, s in todo]
        # One seed per sample and round: the run's formula, keyed by the row, sample and tokens so far.
        seeds = [sampling_seed(run_seed, request.step, p.row, g, s, len(p.token_ids))
                 for (g, s), p in zip(todo, pending, strict=True)]  # fmt: skip
        continued = RolloutRequest(
            rows=[p.row for p in pending], prompt_ids=[p.prompt_ids + p.token_ids for p in pending], seeds=seeds,
            sampling=sampling, step=request.step, weights_version=request.weights_version,
        )  # fmt: skip
        return Plan(continued, len(pending), (groups, pending, total, request.weights_version))

    def collect(
        self, plan: Plan, generation: Generation | None, tokenizer, min_over_ranks: MinOverRanks
    ) -> RolloutBatch:
        """Groups finished now, from this step's prompts or earlier ones; data-parallel ranks train the same
        number of groups (the fewest any rank finished)."""
        groups, pending = plan.state[0], plan.state[1]
        if generation is not None:
            total, version = plan.state[2], plan.state[3]
            for sample, out in zip(pending, generation.groups, strict=True):
                new = out[0]
                room = total - len(sample.token_ids)
                sample.token_ids += new.token_ids[:room]
                sample.logprobs += new.logprobs[:room]
                sample.versions = (version if sample.versions[0] < 0 else sample.versions[0], version)
                if new.finish_reason == "stop" or len(sample.token_ids) >= total:
                    sample.finished = True
                    sample.finish_reason = "stop" if new.finish_reason == "stop" else "length"
        done = [i for i, group in enumerate(groups) if all(s.finished for s in group)]
        take = done[: int(min_over_ranks([float(len(done))])[0])]
        taken = set(take)
        self._next = [group for i, group in enumerate(groups) if i not in taken]
        metrics = {
            "long_tail/carried_groups": float(len(self._next)),
            "long_tail/finished_groups": float(len(take)),
        }
        samples = [(k, s.row, s.prompt_ids, s) for k, i in enumerate(take) for s in groups[i]]
        batch = RolloutBatch.from_samples(samples, tokenizer, metrics)
        return dataclasses.replace(batch, versions=[s.versions for k, i in enumerate(take) for s in groups[i]])

    def commit(self) -> None:
        if self._next is not None:
            self.carried, self._next = self._next, None

    def state_dict(self) -> dict:
        return {"carried": self.carried}

    def load_state_dict(self, state: dict) -> None:
        self.carried = state["carried"]
