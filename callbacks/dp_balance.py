"""DPLoadBalancer: even out the training time of data-parallel ranks before each update, where it pays.

Generation lengths are long-tailed: one data-parallel (DP) rank can draw several of the longest
responses and the others wait for it at the gradient all-reduce. Before the training phase this
callback gathers every DP rank's sequence lengths (one integer per sequence) and decides which rank
trains which sequence (:mod:`yatt_lightning.training.balance_plan`): it predicts each rank's training
time from a cost model (per padded token, per sequence squared for attention, per micro-batch, and the
bytes and latency of the exchange; :mod:`yatt_lightning.training.cost_model`) fitted from this run's own
measured steps, and moves sequences only where the predicted saving exceeds the move's cost by
``min_saving`` of the step. Every rank computes the decision from the same gathered figures, and DP rank
0's split (every sequence's new owner) is broadcast, so there is no coordinator and no rank can disagree. Moving sequences point to point
carries only what training needs (token ids, engine logprobs, advantages, and for image rows the images'
references, never their pixels); each owner keeps its own rollouts for rewards and logging, so nothing
has to come back. A sequence's length counts its image tokens (the prompt ids hold them expanded).

What the model learns from: after each update, each rank's compute seconds (the update's wall time less
the time it waited in the gradient synchronisation, ``MegatronPolicy.grad_sync_seconds``) plus the
exchange's seconds, against the work it trained; the figures travel with the next step's lengths.

Each step's ``balance/imbalance_before``, ``balance/imbalance_after`` (max over mean tokens per rank),
``balance/bytes_received``, ``balance/moved`` (sequences), ``balance/predicted_saving`` (seconds of the
slowest rank the split was predicted to save) and ``balance/model_error`` (the fit's rms error, seconds)
are logged with the step's metrics. With one DP rank it does nothing.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import astuple, dataclass

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from yatt_lightning.algorithms.advantage import Advantages
from yatt_lightning.distributed.collectives import exchange_tensors
from yatt_lightning.training.balance_plan import DECIDE_BY, Planner, choose_parts
from yatt_lightning.training.batch import TrainingBatch, TrainingSamples
from yatt_lightning.training.cost_model import TrainCostModel, Work


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
        splits a micro-batch where the padding saved exceeds it, and the cost model starts from it before
        it has measured a step. 256 is what one micro-batch of the tiny model costs on a CPU core
        (bench/RESULTS.md, dp_balance); large models on GPUs, where small micro-batches waste the
        device, want more.
    decide_by: ``cost`` (predicted time, learned from the run's steps) or ``tokens`` (the evenest split of
        token counts wherever it lowers the slowest rank's padded tokens: independent of timings, so a
        run is reproducible bit for bit, but it may make a step slower where micro-batches or the
        exchange dominate).
    min_saving: The share of the step a move must be predicted to save beyond its own cost.
    enabled: Rebalance at all (``False`` only measures, learns and logs the imbalance).
    """

    def __init__(
        self,
        max_tokens_per_micro_batch: int | None = None,
        micro_batch_overhead_tokens: int = 256,
        decide_by: str = "cost",
        min_saving: float = 0.02,
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
        if decide_by not in DECIDE_BY:
            raise ValueError(f"`DPLoadBalancer.decide_by` must be one of {', '.join(DECIDE_BY)}, got {decide_by!r}.")
        if not 0 <= min_saving < 1:
            raise ValueError(f"`DPLoadBalancer.min_saving` must be in [0, 1), got {min_saving}.")
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.micro_batch_overhead_tokens = micro_batch_overhead_tokens
        self.decide_by = decide_by
        self.min_saving = min_saving
        self.enabled = enabled
        self.model = TrainCostModel(micro_batch_overhead_tokens)
        self._last: tuple[Work, float, float] | None = None  # this rank's last step (work, compute s, exchange s)
        self._exchange: tuple[Work, float] = (Work(0.0, 0.0, 0.0), 0.0)  # this step's exchange and its seconds

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if getattr(trainer.strategy, "data_parallel_size", 1) > 1 or self.max_tokens_per_micro_batch:
            pl_module.balancer = self

    def measured(self, work: Work, compute_seconds: float) -> None:
        """This rank's trained work and compute seconds for the step just updated (the update reports it)."""
        exchange_work, exchange_s = self._exchange
        self._last = (work + exchange_work, compute_seconds, exchange_s)

    def rebalance(self, module, batch: TrainingBatch) -> Rebalanced:
        """This rank's share of the step's sequences after balancing (collective over the DP group). Only
        what the update needs travels: token ids, engine logprobs, advantages and rewards (before the update
        computes old or reference logprobs, so there are none to move)."""
        from megatron.core import parallel_state as ps

        self._exchange = (Work(0.0, 0.0, 0.0), 0.0)
        dp = module.trainer.strategy.data_parallel_size
        if dp == 1:
            return Rebalanced(batch, {})
        if batch.old_logprobs is not None or batch.ref_logprobs is not None:
            raise ValueError("DPLoadBalancer.rebalance runs before the update computes old or reference logprobs")
        samples = batch.samples
        group = ps.get_data_parallel_group()
        me = ps.get_data_parallel_rank()
        last = [*astuple(self._last[0]), *self._last[1:]] if self._last is not None else [0.0] * 7
        n = len(samples)
        mine = torch.tensor([*samples.sequence_lengths(), *self._bytes(batch), *last], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dp)]
        torch.distributed.all_gather(every, mine, group=group)  # equal counts per rank: same shapes
        for figures in every:  # every rank learns the same from the same figures
            *work, compute_s, exchange_s = figures[2 * n :].tolist()
            self.model.observe(Work(*work), compute_s, exchange_s)
        lengths = [int(x) for t in every for x in t[:n].tolist()]
        planner = Planner(self.max_tokens_per_micro_batch, self.micro_batch_overhead_tokens,
                          module.micro_batch_size, module.ppo_epochs, module.mini_batches)  # fmt: skip
        choice = choose_parts(lengths, dp, self.model, planner, [x for t in every for x in t[n : 2 * n].tolist()],
                              decide_by=self.decide_by, min_saving=self.min_saving)  # fmt: skip
        # Rank 0's split stands for all (a fit on another machine's floating point could differ in a tie).
        own = torch.arange(dp * n, dtype=torch.long) // n
        owners = own.clone()
        if choice.moves and self.enabled:
            for r, part in enumerate(choice.parts):
                owners[part] = r
        torch.distributed.broadcast(owners, group_src=0, group=group)
        parts = [torch.nonzero(owners == r).flatten().tolist() for r in range(dp)]
        moved = int((owners != own).sum())
        per_rank_before = [float(t[:n].sum()) for t in every]
        per_rank_after = [float(sum(lengths[i] for i in p)) for p in parts]
        metrics = {
            "balance/imbalance_before": max(per_rank_before) / (sum(per_rank_before) / dp),
            "balance/imbalance_after": max(per_rank_after) / (sum(per_rank_after) / dp),
            "balance/bytes_received": 0.0,
            "balance/moved": float(moved),
            "balance/predicted_saving": choice.predicted_unmoved - choice.predicted if moved else 0.0,
            "balance/model_error": self.model.rms_error if self.model.fitted else 0.0,
        }
        if not moved:
            return Rebalanced(batch, metrics)
        start = time.perf_counter()
        mine_ids = range(me * n, (me + 1) * n)
        outgoing = [self._pack(batch, [i - me * n for i in sorted(p) if i in mine_ids], me * n) for p in parts]
        received, nbytes = exchange_tensors(outgoing, group=group)
        metrics["balance/bytes_received"] = float(nbytes)
        self._exchange = (Work(0.0, 0.0, 0.0, float(nbytes), 1.0), time.perf_counter() - start)
        return Rebalanced(self._unpack(received), metrics)

    @staticmethod
    def _bytes(batch: TrainingBatch) -> list[float]:
        """What each sequence weighs on the wire (as :meth:`_pack` sends it): its ids (8 bytes a token), its
        engine logprobs and per-token advantage fields (4 bytes a completion token each), its scalars."""
        samples, advantages = batch.samples, batch.advantages
        fields = 1 + sum(getattr(advantages, key) is not None for key in _PER_TOKEN) + (samples.action_masks is not None)
        return [8.0 * (len(p) + len(c)) + 4.0 * fields * len(c) + 48.0
                for p, c in zip(samples.prompt_ids, samples.completion_ids, strict=True)]  # fmt: skip

    @staticmethod
    def _pack(batch: TrainingBatch, local: list[int], offset: int) -> dict[str, torch.Tensor]:
        """The training fields of samples ``local`` as flat tensors (global ids = ``offset`` + local); per-token
        advantages and a critic's returns and values travel flat, one value per completion token."""
        samples, advantages = batch.samples, batch.advantages
        ids = [samples.prompt_ids[i] + samples.completion_ids[i] for i in local]
        per_sample = advantages.values if advantages.values is not None else torch.zeros(len(samples))
        out = {
            "tokens": torch.tensor([t for seq in ids for t in seq], dtype=torch.long),
            "lengths": torch.tensor([[len(samples.prompt_ids[i]), len(samples.completion_ids[i])] for i in local],
                                    dtype=torch.long).reshape(-1, 2),
            "logprobs": _flat([samples.rollout_logprobs[i] for i in local]),
            "scalars": torch.tensor([[offset + i, float(per_sample[i])] for i in local],
                                    dtype=torch.float64).reshape(-1, 2),
            # Image rows: their references (paths and hashes, ~200 bytes an image), never the pixels; the
            # receiving rank reads the files it trains on.
            "images": torch.frombuffer(bytearray(pickle.dumps([samples.images[i] for i in local])), dtype=torch.uint8),
        }  # fmt: skip
        for key in _PER_TOKEN:
            values = getattr(advantages, key)
            if values is not None:
                out[f"advantages.{key}"] = _flat([values[i] for i in local])
        if samples.action_masks is not None:  # an agent's episodes: which completion tokens the model sampled
            out["action_masks"] = _flat([samples.action_masks[i] for i in local])
        return out

    @staticmethod
    def _unpack(received: list[dict[str, torch.Tensor]]) -> TrainingBatch:
        """One batch of the samples received from every rank, in global id order."""
        samples, per_token = [], [key for key in _PER_TOKEN if f"advantages.{key}" in received[0]]
        for part in received:
            tokens, logprobs = part["tokens"].tolist(), part["logprobs"]
            images = pickle.loads(part["images"].numpy().tobytes())
            at = lp_at = 0
            for k, ((p, c), (gid, adv)) in enumerate(
                zip(part["lengths"].tolist(), part["scalars"].tolist(), strict=True)
            ):
                extra = {key: part[f"advantages.{key}"][lp_at : lp_at + c] for key in per_token}
                if "action_masks" in part:
                    extra["action_masks"] = part["action_masks"][lp_at : lp_at + c]
                samples.append((int(gid), tokens[at : at + p], tokens[at + p : at + p + c], logprobs[lp_at : lp_at + c],
                                adv, images[k], extra))  # fmt: skip
                at, lp_at = at + p + c, lp_at + c
        samples.sort(key=lambda s: s[0])
        training = TrainingSamples(
            prompt_ids=[s[1] for s in samples],
            completion_ids=[s[2] for s in samples],
            rollout_logprobs=[s[3] for s in samples],
            images=[s[5] for s in samples],  # the references, for the training forward
            action_masks=[s[6]["action_masks"] for s in samples] if "action_masks" in received[0] else None,
        )
        fields = {key: [s[6][key] for s in samples] for key in per_token}
        if "tokens" not in fields:
            fields["values"] = torch.tensor([s[4] for s in samples], dtype=torch.float)
        return TrainingBatch(training, Advantages(**fields))


# Per-token fields of the advantages that travel with a sample (when the estimator produced them).
_PER_TOKEN = ("tokens", "returns", "old_values")


def _flat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.float() for v in values]) if values else torch.zeros(0)
