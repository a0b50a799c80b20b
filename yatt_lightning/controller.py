"""Who moves rollout data, and where: the parallel controller and, for comparison, a single one.

:class:`ParallelController` (the default) follows WeChat-YATT: every data-parallel (DP) rank owns its
prompts, rollouts and rewards. The ranks of one model-parallel (MP) group share a DP rank, so they load
the same prompts; they drive one rollout engine together (vLLM tensor parallel across the group, the
same prompts and seeds on each rank), and only the group's head (its first rank) scores the samples and
broadcasts the scores inside the group. Nothing crosses DP ranks except scalars for logging, so the
cost on any one rank does not grow with the number of ranks.

:class:`SingleController` is the driver design users would otherwise pick (verl's single controller):
global rank 0 gathers every rank's prompts (with all their fields, images included), generates all of
them on its own engine, scores them and scatters the results back. It exists to measure what that costs
(``bench/controller_scaling.py``).

Both count the bytes each rank receives through them (:attr:`Controller.bytes_received`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch

from yatt_lightning.rollout.base import Completion, SamplingConfig

ScoreFn = Callable[[list[str], list[str], list[dict]], torch.Tensor]


class Controller:
    """Base class; the strategy calls :meth:`attach` once its process groups exist."""

    def __init__(self) -> None:
        self.strategy = None
        self.bytes_received = 0

    def attach(self, strategy) -> None:
        self.strategy = strategy

    def check_layout(self, tensor_model_parallel_size: int, pipeline_model_parallel_size: int) -> None:
        """Raise a ValueError naming the key if this controller cannot serve the layout."""

    def generate(
        self, prompts: list[list[int]], rows: list[dict], sampling: SamplingConfig, seeds: list[int], keep: int
    ):
        """Completions (``sampling.n`` per prompt) for this rank's prompts; with ``keep`` < len(prompts) only
        the first groups to finish (the others ``None``)."""
        raise NotImplementedError

    def score(self, rollouts, score_fn: ScoreFn) -> torch.Tensor:
        """This rank's per-sample rewards; ``score_fn(prompts, completions, rows)`` computes them."""
        raise NotImplementedError

    def engine_batch_scale(self) -> int:
        """How many ranks' prompts one engine may be asked to generate at once."""
        return 1

    def all_reduce(self, tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
        """Reduce logging scalars over all ranks (in place); counted like every other transfer."""
        if _world() > 1:
            torch.distributed.all_reduce(tensor, op=op)
            self.bytes_received += tensor.numel() * tensor.element_size()
        return tensor


class ParallelController(Controller):
    """Every DP rank generates and scores its own prompts; the head of each MP group scores."""

    def generate(self, prompts, rows, sampling, seeds, keep):
        groups: list = [None] * len(prompts)
        with self.strategy.rollout_context() as engine:
            for index, group in self.strategy.lightning_module.generate_groups(engine, prompts, sampling, seeds, keep):
                groups[index] = group
        return groups

    def score(self, rollouts, score_fn):
        from megatron.core import parallel_state as ps

        local = (rollouts.prompts, rollouts.completions, rollouts.rows)
        group = ps.get_model_parallel_group()
        if _world() == 1 or torch.distributed.get_world_size(group) == 1:
            return score_fn(*local)
        head = torch.distributed.get_process_group_ranks(group)[0]
        is_head = torch.distributed.get_rank() == head
        scores = torch.empty(len(rollouts))
        with self.strategy.fail_together():  # every rank must hear of a failure before the broadcast below
            if is_head:
                scores = score_fn(*local).float()
        torch.distributed.broadcast(scores, src=head, group=group)
        if not is_head:
            self.bytes_received += scores.numel() * scores.element_size()
        return scores


class SingleController(Controller):
    """Global rank 0 gathers all prompts, generates and scores them, and scatters the results."""

    def check_layout(self, tensor_model_parallel_size: int, pipeline_model_parallel_size: int) -> None:
        if tensor_model_parallel_size * pipeline_model_parallel_size != 1:
            raise ValueError(
                "`trainer.strategy.controller`: SingleController supports data parallelism only; set "
                "tensor_model_parallel_size and pipeline_model_parallel_size to 1, or use ParallelController."
            )

    def generate(self, prompts, rows, sampling, seeds, keep):
        if keep < len(prompts):
            raise ValueError("`model.long_tail`: over-provisioning is not supported with the SingleController.")
        gathered = self._gather((prompts, rows, seeds))
        if gathered is not None:
            all_prompts = [p for ps_, _, _ in gathered for p in ps_]
            all_seeds = [s for _, _, ss in gathered for s in ss]
            with self.strategy.rollout_context() as engine:
                groups = engine.generate(all_prompts, sampling, all_seeds)
            parts, start = [], 0
            for ps_, _, _ in gathered:
                parts.append(groups[start : start + len(ps_)])
                start += len(ps_)
        else:
            # The other ranks' engines idle; their weights still follow the policy for a fair comparison.
            with self.strategy.rollout_context():
                parts = None
        return self._scatter(parts)

    def score(self, rollouts, score_fn):
        # The driver scores everything: it needs every sample's completion and row.
        gathered = self._gather((rollouts.prompts, rollouts.completions, rollouts.rows))
        parts = None
        with self.strategy.fail_together():  # the other ranks wait in the scatter below: tell them first
            if gathered is not None:
                parts = [score_fn(*part) for part in gathered]
        return self._scatter(parts)

    def engine_batch_scale(self) -> int:
        return _world()

    # -- object collectives through rank 0, with byte counting
    def _gather(self, obj):
        if _world() == 1:
            return [obj]
        out = [None] * _world() if torch.distributed.get_rank() == 0 else None
        torch.distributed.gather_object(obj, out, dst=0)
        if out is not None:
            self.bytes_received += sum(len(pickle.dumps(o)) for i, o in enumerate(out) if i != 0)
            return out
        return None

    def _scatter(self, parts):
        if _world() == 1:
            return parts[0]
        received = [None]
        torch.distributed.scatter_object_list(received, parts, src=0)
        if torch.distributed.get_rank() != 0:
            self.bytes_received += len(pickle.dumps(received[0]))
        return received[0]


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


__all__ = ["Completion", "Controller", "ParallelController", "ScoreFn", "SingleController"]
