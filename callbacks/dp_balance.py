"""DPLoadBalancer: even out the training work of data-parallel ranks before each update.

Generation lengths are long-tailed: one data-parallel (DP) rank can draw several of the longest
responses and the others wait for it at the gradient all-reduce. Before the training phase this
callback gathers every DP rank's sequence lengths (one integer per sequence), splits all sequences into
DP parts with equal counts and even token sums (Karmarkar-Karp, refined, never worse than the greedy
split; :mod:`yatt_lightning.partition`), and moves each sequence to its part's rank point to point.
Every rank computes the same split from the same lengths, so there is no coordinator. Only what
training needs travels (token ids, engine logprobs, advantages); each owner keeps its own rollouts for
rewards and logging, so nothing has to come back. Optionally it also caps micro-batches by tokens.

It logs ``balance/imbalance_before`` and ``balance/imbalance_after`` (max over mean tokens per rank)
each step. With one DP rank it does nothing.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from yatt_lightning.batch import RolloutBatch
from yatt_lightning.collectives import exchange_objects
from yatt_lightning.partition import balanced_partition

_MOVED = ("prompt_ids", "completion_ids", "rollout_logprobs", "finish_reasons")


class DPLoadBalancer(Callback):
    """Args:
    max_tokens_per_micro_batch: Cap on a micro-batch's padded tokens (samples x longest sequence);
        ``None`` keeps ``model.micro_batch_size`` samples per micro-batch.
    enabled: Rebalance at all (``False`` only measures and logs the imbalance).
    """

    def __init__(self, max_tokens_per_micro_batch: int | None = None, enabled: bool = True) -> None:
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"`DPLoadBalancer.max_tokens_per_micro_batch` must be >= 1, got {max_tokens_per_micro_batch}."
            )
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.enabled = enabled
        self.last: dict[str, float] = {}

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if getattr(trainer.strategy, "data_parallel_size", 1) > 1 or self.max_tokens_per_micro_batch:
            pl_module.balancer = self

    def rebalance(self, module, rollouts: RolloutBatch) -> RolloutBatch:
        """This rank's share of the step's sequences after balancing (collective over the DP group)."""
        from megatron.core import parallel_state as ps

        dp = module.trainer.strategy.data_parallel_size
        if dp == 1:
            return rollouts
        group = ps.get_data_parallel_group()
        me = ps.get_data_parallel_rank()
        mine = torch.tensor(rollouts.sequence_lengths(), dtype=torch.long)
        every = [torch.empty_like(mine) for _ in range(dp)]
        torch.distributed.all_gather(every, mine, group=group)  # equal counts per rank: same shapes
        weights = torch.cat(every).tolist()
        n = len(mine)
        per_rank_before = [float(t.sum()) for t in every]
        parts = (
            balanced_partition(weights, dp) if self.enabled else [list(range(r * n, (r + 1) * n)) for r in range(dp)]
        )
        per_rank_after = [float(sum(weights[i] for i in p)) for p in parts]
        self.last = {
            "balance/imbalance_before": max(per_rank_before) / (sum(per_rank_before) / dp),
            "balance/imbalance_after": max(per_rank_after) / (sum(per_rank_after) / dp),
        }
        module.log_dict(self.last, on_step=True, on_epoch=False, rank_zero_only=True)
        if not self.enabled:
            return rollouts
        outgoing = [
            [self._sample(rollouts, i - me * n, i) for i in sorted(p) if me * n <= i < (me + 1) * n] for p in parts
        ]
        received, nbytes = exchange_objects(outgoing, group=group)
        self.last["balance/bytes_received"] = nbytes
        samples = sorted((s for chunk in received for s in chunk), key=lambda s: s["id"])
        return self._batch(samples)

    @staticmethod
    def _sample(rollouts: RolloutBatch, local: int, global_id: int) -> dict:
        sample = {key: getattr(rollouts, key)[local] for key in _MOVED}
        sample["id"] = global_id
        sample["advantage"] = float(rollouts.advantages[local])
        sample["reward"] = float(rollouts.rewards[local])
        return sample

    @staticmethod
    def _batch(samples: list[dict]) -> RolloutBatch:
        return RolloutBatch(
            prompts=[""] * len(samples),
            prompt_ids=[s["prompt_ids"] for s in samples],
            completion_ids=[s["completion_ids"] for s in samples],
            completions=[""] * len(samples),
            rows=[{} for _ in samples],
            group_ids=torch.tensor([s["id"] for s in samples]),
            rollout_logprobs=[s["rollout_logprobs"] for s in samples],
            finish_reasons=[s["finish_reasons"] for s in samples],
            rewards=torch.tensor([s["reward"] for s in samples]),
            advantages=torch.tensor([s["advantage"] for s in samples]),
        )
