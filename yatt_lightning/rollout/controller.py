"""Who moves rollout data, and where: the parallel controller and, for comparison, a single one.

:class:`ParallelController` (the default) follows WeChat-YATT: every data-parallel (DP) rank owns its
prompts, rollouts and rewards. The ranks of one model-parallel (MP) group share a DP rank, so they load
the same prompts; they drive one rollout engine together (vLLM tensor parallel across the group, the
same prompts and seeds on each rank), and only the group's head (its first rank) scores the samples and
broadcasts the scores inside the group. Nothing crosses DP ranks except scalars for logging, so the
cost on any one rank does not grow with the number of ranks.

:class:`SingleController` is the driver design users would otherwise pick (verl's single controller):
global rank 0 holds every rank's rows, generates all prompts on its own engine, scores every sample and
sends each rank what it trains on (completions, scores). The rows reach it once per step: gathered from
the ranks that loaded them, or loaded by the driver itself (``driver_loads_rows``, as a driver design
would; the other ranks then get only their prompts from it). It exists to measure what that costs
(``bench/controller_scaling.py``).

Their transfers are tagged ``"rollout"`` for :mod:`yatt_lightning.distributed.wire`, which counts bytes where they
cross the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from yatt_lightning.datamodules.images import images_of
from yatt_lightning.distributed import wire
from yatt_lightning.distributed.collectives import gather_objects, scatter_objects
from yatt_lightning.distributed.failures import fail_together
from yatt_lightning.distributed.layout import Layout
from yatt_lightning.engines.base import Completion
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.rollout.types import RolloutRequest, Scores

ScoreFn = Callable[[RolloutBatch], Scores]

# What a rank needs of a row the driver loaded: its prompt or chat messages (tokenized there), its id (the sampling seed),
# where it came from (error messages) and its images' references (the training forward reads the pixels on
# the rank). The other fields (answers) stay with the driver, which scores.
STUB_FIELDS = ("prompt", "messages", "_id", "_source", "images")


def first_to_finish(engine, request: RolloutRequest, keep: int) -> Iterator[tuple[int, list[Completion]]]:
    """``(prompt index, group)`` as groups finish (an agent's: as a prompt's episodes end); stops (aborting the
    rest) after ``keep`` groups."""
    if request.agent is not None:
        stream = request.agent.episodes(engine, request)
    else:
        stream = engine.generate_stream(
            request.prompt_ids, request.sampling, request.seeds, request.max_new_tokens, images_of(request.rows)
        )
    try:
        for count, item in enumerate(stream, start=1):
            yield item
            if count >= keep:
                return
    finally:
        stream.close()


class Controller:
    """Base class: who talks to engines and what crosses ranks. It holds nothing of the strategy's;
    ``group``: the ranks a step's collectives span (``None``: all; a disaggregated placement's role)."""

    group = None

    def check_layout(self, layout: Layout) -> None:
        """Raise a ValueError naming the key if this controller cannot serve the layout (in preflight)."""

    @property
    def loads_on_driver(self) -> bool:
        """True when global rank 0 loads every rank's rows (the datamodule then loads the global batch there
        and hands it to :meth:`distribute_rows`)."""
        return False

    def distribute_rows(self, shares: list[list[dict]] | None) -> list[dict]:
        """Collective, with :attr:`loads_on_driver`: rank 0 passes every DP rank's rows of the step
        (``shares[r]``), the others ``None``; returns the rows this rank's module works on."""
        raise NotImplementedError(f"{type(self).__name__} does not load rows on a driver.")

    def generate(self, request: RolloutRequest, keep: int, engine) -> list:
        """Completions (``sampling.n`` per prompt) for this rank's prompts on ``engine`` (awake, with the
        policy's weights); with ``keep`` < the number of prompts only the first groups to finish (the
        others ``None``)."""
        raise NotImplementedError

    def score(self, batch: RolloutBatch, score_fn: ScoreFn, token_rewards: bool, tokenizer) -> Scores:
        """This rank's rewards; ``score_fn(batch)`` computes a batch's :class:`Scores`; ``token_rewards``:
        a reward function gives per-token rewards, which reach every rank with the totals."""
        raise NotImplementedError

    def min_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's minimum over every rank (a collective)."""
        return self.all_reduce(torch.tensor(values, dtype=torch.float64), op=torch.distributed.ReduceOp.MIN).tolist()

    def engine_batch_scale(self) -> int:
        """How many ranks' prompts one engine may be asked to generate at once."""
        return 1

    def all_reduce(self, tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
        """Reduce logging scalars over all ranks (in place; nothing to do on one process)."""
        if _world() > 1:
            torch.distributed.all_reduce(tensor, op=op, group=self.group)
        return tensor


class ParallelController(Controller):
    """Every DP rank generates and scores its own prompts; the head of each MP group scores."""

    def generate(self, request, keep, engine) -> list:
        groups: list = [None] * len(request.prompt_ids)
        for index, group in first_to_finish(engine, request, keep):
            groups[index] = group
        return groups

    def score(self, batch, score_fn, token_rewards, tokenizer) -> Scores:
        from megatron.core import parallel_state as ps

        if _world() == 1 or not ps.model_parallel_is_initialized():  # one process; a rank that only generates
            return score_fn(batch)
        group = ps.get_model_parallel_group()
        if torch.distributed.get_world_size(group) == 1:
            return score_fn(batch)
        head = torch.distributed.get_process_group_ranks(group)[0]
        scores = Scores(torch.empty(len(batch)), {})  # the other ranks of the group get the totals only
        with fail_together():  # every rank must hear of a failure before the broadcast below
            if torch.distributed.get_rank() == head:
                scores = score_fn(batch)
        with wire.category("rollout"):
            torch.distributed.broadcast(scores.total, src=head, group=group)
            if token_rewards:
                tokens = [scores.token_rewards]
                torch.distributed.broadcast_object_list(tokens, src=head, group=group)
                scores = Scores(scores.total, scores.metrics, tokens[0])
        return scores


class SingleController(Controller):
    """Global rank 0 (the driver) holds every rank's rows, generates and scores everything, and sends each
    rank its completions and scores.

    Args:
        driver_loads_rows: Rank 0 loads every rank's rows itself (the global batch, through
            :class:`~yatt_lightning.datamodules.PromptDataModule`) and sends each rank only the fields its
            module needs before scoring (``prompt``, ``_id``, ``_source``): rows never travel to it. With
            ``False`` every rank loads its own rows and rank 0 gathers them, once per step.
    """

    def __init__(self, driver_loads_rows: bool = False) -> None:
        super().__init__()
        self.driver_loads_rows = driver_loads_rows
        self._loaded: list[list[dict]] | None = None  # on the driver: every rank's rows of the step, as loaded
        self._held: list[tuple[list[dict], list, list]] | None = None  # on the driver: rows, prompt ids, groups

    def check_layout(self, layout: Layout) -> None:
        if layout.model_parallel != 1:
            raise ValueError(
                "`trainer.strategy.controller`: SingleController supports data parallelism only; set "
                "tensor_model_parallel_size and pipeline_model_parallel_size to 1, or use ParallelController."
            )

    @property
    def loads_on_driver(self) -> bool:
        return self.driver_loads_rows

    def distribute_rows(self, shares) -> list[dict]:
        if shares is not None:  # the driver keeps the full rows for generate() and score()
            self._loaded = shares
            if _world() == 1:
                return shares[0]
            stubs = [None] + [[{k: row[k] for k in STUB_FIELDS if k in row} for row in part] for part in shares[1:]]
            with wire.category("rollout"):
                scatter_objects(stubs)
            return shares[0]
        with wire.category("rollout"):
            return scatter_objects(None)

    def generate(self, request, keep, engine) -> list:
        if keep < len(request.prompt_ids):
            raise ValueError("`model.long_tail`: over-provisioning is not supported with the SingleController.")
        if self.driver_loads_rows:
            with fail_together():  # before the gather below, where the other ranks would wait
                if _rank() == 0 and self._loaded is None:
                    raise ValueError(
                        "`trainer.strategy.controller.driver_loads_rows`: the datamodule did not hand the driver "
                        "the global batch; use PromptDataModule, or set driver_loads_rows to false."
                    )
        # The rows reach the driver here, once (not at all when it loaded them); it keeps them for score().
        mine = (request.prompt_ids, request.seeds) + (() if self.driver_loads_rows else (request.rows,))
        with wire.category("rollout"):
            gathered = gather_objects(mine)
        if gathered is not None:
            every_rows = self._loaded if self.driver_loads_rows else [part[2] for part in gathered]
            self._loaded = None
            all_prompts = [p for part in gathered for p in part[0]]
            all_seeds = [s for part in gathered for s in part[1]]
            images = images_of([row for rows in every_rows for row in rows])  # read by the driver, from refs
            groups = engine.generate(all_prompts, request.sampling, all_seeds, images=images)
            parts, start = [], 0
            for part in gathered:
                parts.append(groups[start : start + len(part[0])])
                start += len(part[0])
            self._held = [(r, part[0], g) for r, part, g in zip(every_rows, gathered, parts, strict=True)]
        else:  # the other ranks' engines idle; their weights still follow the policy for a fair comparison
            parts = None
        with wire.category("rollout"):
            return scatter_objects(parts)

    def score(self, batch, score_fn, token_rewards, tokenizer) -> Scores:
        if token_rewards:
            raise ValueError(
                "`model.rewards`: per-token rewards (a TokenRewardFunction) are not sent by the SingleController "
                "yet; use `trainer.strategy.controller: ParallelController`."
            )
        # The driver scores everything from what it has held since generate(): nothing travels to it here.
        parts, mine = None, None
        with fail_together():  # the other ranks wait in the scatter below: tell them first
            if self._held is not None:
                held, self._held = self._held, None
                mine = score_fn(batch)
                others = [score_fn(RolloutBatch.from_groups(*h, tokenizer)) for h in held[1:]]
                parts = [mine.total] + [o.total for o in others]
                for o in others:  # every sample's metrics are counted once, on the driver
                    for key, value in o.metrics.items():
                        mine.metrics[key] = mine.metrics.get(key, 0.0) + value
        with wire.category("rollout"):
            total = scatter_objects(parts)
        if len(total) != len(batch):
            raise RuntimeError(
                f"the driver scored {len(total)} samples for rank {_rank()}, which holds "
                f"{len(batch)}: the SingleController expects the rollout's layout (each kept group's "
                "samples in prompt order)."
            )
        return mine if mine is not None else Scores(total, {})

    def engine_batch_scale(self) -> int:
        return _world()


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


__all__ = ["Completion", "Controller", "ParallelController", "ScoreFn", "SingleController"]
