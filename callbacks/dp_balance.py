"""DPLoadBalancer: even out the training work of data-parallel ranks before each update.

Generation lengths are long-tailed: one data-parallel (DP) rank can draw several of the longest
responses and the others wait for it at the gradient all-reduce. Before the training phase this
callback gathers every DP rank's sequence lengths (one integer per sequence), splits all sequences into
DP parts with equal counts and even token sums (Karmarkar-Karp, refined, never worse than the greedy
split; :mod:`yatt_lightning.training.partition`), and moves each sequence to its part's rank point to point.
Every rank computes the same split from the same lengths, so there is no coordinator. Only what
training needs travels (token ids, engine logprobs, advantages, and for image rows the images'
references, never their pixels); each owner keeps its own rollouts for rewards and logging, so nothing has
to come back. A sequence's length counts its image tokens (the prompt ids hold them expanded). Optionally it also caps micro-batches by tokens,
packing each rank's sequences with the least padding (:mod:`yatt_lightning.training.packing`); then the split is
kept only if it lowers the slowest rank's planned cost (padded tokens plus a fixed cost per micro-batch)
below the unbalanced one's, so the exchange is skipped where it would not pay.

Each step's ``balance/imbalance_before``, ``balance/imbalance_after`` (max over mean tokens per rank)
and ``balance/bytes_received`` are logged with the step's metrics. With one DP rank it does nothing.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from yatt_lightning.algorithms.advantage import Advantages
from yatt_lightning.distributed.collectives import exchange_tensors
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.training.batch import TrainingBatch
from yatt_lightning.training.packing import pack_by_tokens, packed_cost
from yatt_lightning.training.partition import balanced_partition


@dataclass(frozen=True)
class Rebalanced:
    """This rank's share of the step's training batch after balancing, and the step's balance figures."""

    batch: TrainingBatch
    metrics: dict[str, float]


class DPLoadBalancer(Callback):
    """Args:
    max_tokens_per_micro_batch: Cap on a micro-batch's padded tokens (samples x longest sequence);
        ``None`` keeps ``model.micro_batch_size`` samples per micro-batch.
    micro_batch_overhead_tokens: The fixed cost of one more micro-batch, in tokens of compute: the packer
        splits a micro-batch where the padding saved exceeds it. 256 is what one micro-batch of the tiny
        model costs on a CPU core (bench/RESULTS.md, dp_balance); large models on GPUs, where small
        micro-batches waste the device, want more.
    enabled: Rebalance at all (``False`` only measures and logs the imbalance).
    """

    def __init__(
        self,
        max_tokens_per_micro_batch: int | None = None,
        micro_batch_overhead_tokens: int = 256,
        enabled: bool = True,
    ) -> None:
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"`DPLoadBalancer.max_tokens_per_micro_batch` must be >= 1, got {max_tokens_per_micro_batch}."
            )
        if micro_batch_overhead_tokens < 0:
            raise ValueError(
                f"`DPLoadBalancer.micro_batch_overhead_tokens` must be >= 0, got {micro_batch_overhead_tokens}."
            )
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.micro_batch_overhead_tokens = micro_batch_overhead_tokens
        self.enabled = enabled

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if getattr(trainer.strategy, "data_parallel_size", 1) > 1 or self.max_tokens_per_micro_batch:
            pl_module.balancer = self

    def rebalance(self, module, batch: TrainingBatch) -> Rebalanced:
        """This rank's share of the step's sequences after balancing (collective over the DP group). Only
        what the update needs travels: token ids, engine logprobs, advantages and rewards (before the update
        computes old or reference logprobs, so there are none to move)."""
        from megatron.core import parallel_state as ps

        dp = module.trainer.strategy.data_parallel_size
        if dp == 1:
            return Rebalanced(batch, {})
        if batch.old_logprobs is not None or batch.ref_logprobs is not None:
            raise ValueError("DPLoadBalancer.rebalance runs before the update computes old or reference logprobs")
        rollouts = batch.rollouts
        group = ps.get_data_parallel_group()
        me = ps.get_data_parallel_rank()
        mine = torch.tensor(rollouts.sequence_lengths(), dtype=torch.long)
        every = [torch.empty_like(mine) for _ in range(dp)]
        torch.distributed.all_gather(every, mine, group=group)  # equal counts per rank: same shapes
        weights = torch.cat(every).tolist()
        n = len(mine)
        per_rank_before = [float(t.sum()) for t in every]
        unmoved = [list(range(r * n, (r + 1) * n)) for r in range(dp)]
        parts = balanced_partition(weights, dp) if self.enabled else unmoved
        if self.enabled and self._planned_cost(weights, unmoved) <= self._planned_cost(weights, parts):
            parts = unmoved  # the split would not shorten the slowest rank's plan: keep the rows, skip the exchange
        per_rank_after = [float(sum(weights[i] for i in p)) for p in parts]
        metrics = {
            "balance/imbalance_before": max(per_rank_before) / (sum(per_rank_before) / dp),
            "balance/imbalance_after": max(per_rank_after) / (sum(per_rank_after) / dp),
            "balance/bytes_received": 0.0,
        }
        if parts is unmoved:
            return Rebalanced(batch, metrics)
        mine_ids = range(me * n, (me + 1) * n)
        outgoing = [self._pack(batch, [i - me * n for i in sorted(p) if i in mine_ids], me * n) for p in parts]
        received, nbytes = exchange_tensors(outgoing, group=group)
        metrics["balance/bytes_received"] = float(nbytes)
        return Rebalanced(self._unpack(received), metrics)

    def _planned_cost(self, weights: list[int], parts: list[list[int]]) -> tuple[float, float]:
        """The slowest rank's packed cost under ``parts`` (0 when micro-batches are not capped by tokens),
        then its token sum (the tie-breaker)."""
        tokens = max(sum(weights[i] for i in p) for p in parts)
        if not self.max_tokens_per_micro_batch:
            return (0.0, tokens)
        overhead = self.micro_batch_overhead_tokens
        costs = []
        for p in parts:
            lengths = [weights[i] for i in p]
            plan = pack_by_tokens(lengths, self.max_tokens_per_micro_batch, overhead)
            costs.append(packed_cost(lengths, plan, overhead))
        return (max(costs), tokens)

    @staticmethod
    def _pack(batch: TrainingBatch, local: list[int], offset: int) -> dict[str, torch.Tensor]:
        """The training fields of samples ``local`` as flat tensors (global ids = ``offset`` + local); per-token
        advantages and a critic's returns and values travel flat, one value per completion token."""
        rollouts, advantages = batch.rollouts, batch.advantages
        ids = [rollouts.prompt_ids[i] + rollouts.completion_ids[i] for i in local]
        per_sample = advantages.values if advantages.values is not None else torch.zeros(len(rollouts))
        out = {
            "tokens": torch.tensor([t for seq in ids for t in seq], dtype=torch.long),
            "lengths": torch.tensor([[len(rollouts.prompt_ids[i]), len(rollouts.completion_ids[i])] for i in local],
                                    dtype=torch.long).reshape(-1, 2),
            "logprobs": _flat([rollouts.rollout_logprobs[i] for i in local]),
            "scalars": torch.tensor([[offset + i, float(per_sample[i]), float(rollouts.rewards[i])]
                                     for i in local], dtype=torch.float64).reshape(-1, 3),
            # Image rows: their references (paths and hashes, ~200 bytes an image), never the pixels; the
            # receiving rank reads the files it trains on.
            "images": torch.frombuffer(bytearray(pickle.dumps(
                [rollouts.rows[i]["images"] if "images" in rollouts.rows[i] else None for i in local])), dtype=torch.uint8),
        }  # fmt: skip
        for key in _PER_TOKEN:
            values = getattr(advantages, key)
            if values is not None:
                out[f"advantages.{key}"] = _flat([values[i] for i in local])
        return out

    @staticmethod
    def _unpack(received: list[dict[str, torch.Tensor]]) -> TrainingBatch:
        """One batch of the samples received from every rank, in global id order."""
        samples, per_token = [], [key for key in _PER_TOKEN if f"advantages.{key}" in received[0]]
        for part in received:
            tokens, logprobs = part["tokens"].tolist(), part["logprobs"]
            images = pickle.loads(part["images"].numpy().tobytes())
            at = lp_at = 0
            for k, ((p, c), (gid, adv, reward)) in enumerate(
                zip(part["lengths"].tolist(), part["scalars"].tolist(), strict=True)
            ):
                row = {} if images[k] is None else {"images": images[k]}
                extra = {key: part[f"advantages.{key}"][lp_at : lp_at + c] for key in per_token}
                samples.append((int(gid), tokens[at : at + p], tokens[at + p : at + p + c], logprobs[lp_at : lp_at + c],
                                adv, reward, row, extra))  # fmt: skip
                at, lp_at = at + p + c, lp_at + c
        samples.sort(key=lambda s: s[0])
        k = len(samples)
        rollouts = RolloutBatch(
            prompts=[""] * k,
            prompt_ids=[s[1] for s in samples],
            completion_ids=[s[2] for s in samples],
            completions=[""] * k,
            rows=[s[6] for s in samples],  # the images' references, for the training forward
            group_ids=torch.tensor([s[0] for s in samples], dtype=torch.long),
            rollout_logprobs=[s[3] for s in samples],
            finish_reasons=[""] * k,  # not needed by the update; the owner keeps the real ones for logging
            rewards=torch.tensor([s[5] for s in samples], dtype=torch.float),
        )
        fields = {key: [s[7][key] for s in samples] for key in per_token}
        if "tokens" not in fields:
            fields["values"] = torch.tensor([s[4] for s in samples], dtype=torch.float)
        return TrainingBatch(rollouts, Advantages(**fields))


# Per-token fields of the advantages that travel with a sample (when the estimator produced them).
_PER_TOKEN = ("tokens", "returns", "old_values")


def _flat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.float() for v in values]) if values else torch.zeros(0)
