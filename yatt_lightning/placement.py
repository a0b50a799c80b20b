"""Placement: which ranks run the rollout engine and the generative reward model (GenRM), and in what order.

:class:`FullColocation` runs the stages in series on every rank: rollout (policy engine awake), reward
(the judge's engine awake), training (engines asleep, training state back on the device). On GPU each
stage releases what the previous one held (engine sleep / wake, training state offload / onload); on
CPU nothing can be released, so it measures and logs what each stage holds (``memory/*``).

:class:`PartialColocation` puts the policy engine on the *rollout ranks* and the judge on the *judge
ranks* (on 2 processes: one each), at the same time. The judge ranks send their prompts to the rollout
ranks; as each prompt's samples finish, the rollout rank streams them to a judge rank, which scores
whatever has arrived while generation continues; scores go back to the rank that owns the prompt. Then
every rank trains (data parallel over all of them). Its engines run inside the trainers' processes, like
full colocation's (each rank starts its first engine at the same point: vLLM's process groups hang off the
trainer's).

Both log, per step, each rank's idle time in the rollout + reward phase (the "bubble": waiting for
another rank or for work) as ``idle/rank<r>`` and ``idle_fraction/rank<r>``.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections.abc import Iterator

import psutil
import torch

from yatt_lightning import wire
from yatt_lightning.longtail import PartialRollout
from yatt_lightning.rewards.base import RewardError, RewardOutput
from yatt_lightning.rewards.genrm import GenerativeRewardModel
from yatt_lightning.rollout.base import Completion

log = logging.getLogger(__name__)


class Placement:
    """Base class; the strategy owns one."""

    idle = 0.0
    memory: dict[str, float] = {}

    def check(self, strategy) -> None:
        """Raise a ValueError naming the key if this placement cannot serve the layout."""

    def start_engines(self, strategy, module) -> None:
        raise NotImplementedError

    def generate(self, strategy, module, prompts, rows, sampling, seeds, keep):
        """(groups of completions for this rank's prompts, ``None`` for those not kept; {reward name:
        RewardOutput} already computed while generating)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def scoring(self, module) -> Iterator[None]:
        """Around the reward stage of a step (after generation, before training)."""
        yield

    def shutdown(self, strategy, module) -> None:
        for genrm in self.judges(module):
            genrm.shutdown()

    @staticmethod
    def judges(module) -> list[GenerativeRewardModel]:
        return [fn for fn in module.reward_functions if isinstance(fn, GenerativeRewardModel)]

    # -- bookkeeping shared by the placements
    def reset_step(self) -> None:
        self.idle = 0.0
        self.memory: dict[str, float] = {}

    def record_memory(self, stage: str) -> None:
        self.memory[f"memory/{stage}_rss_gb"] = psutil.Process().memory_info().rss / 2**30


class FullColocation(Placement):
    """Rollout, GenRM and training in series, each on every rank."""

    def start_engines(self, strategy, module) -> None:
        strategy.start_policy_engine()
        spec = module.rollout_engine_spec()
        for genrm in self.judges(module):
            if strategy.tensor_model_parallel_size * strategy.pipeline_model_parallel_size != 1:
                raise ValueError(
                    "a GenerativeRewardModel runs with data parallelism only for now; set "
                    "`trainer.strategy.tensor_model_parallel_size` and `pipeline_model_parallel_size` to 1."
                )
            genrm.start(seed=spec["seed"], max_num_seqs=spec["max_num_seqs"], dtype=spec["dtype"])
            genrm.engine.sleep()

    def generate(self, strategy, module, prompts, rows, sampling, seeds, keep):
        self.reset_step()
        groups = strategy.controller.generate(prompts, rows, sampling, seeds, keep)
        self.record_memory("rollout")
        return groups, {}

    @contextlib.contextmanager
    def scoring(self, module) -> Iterator[None]:
        """The judges' engines are awake for the reward stage only: on a GPU they hold memory that the
        policy's engine (asleep by now) and training need at the other stages."""
        judges = self.judges(module)
        for genrm in judges:
            genrm.engine.wake_up()
        try:
            yield
        finally:
            for genrm in judges:
                genrm.engine.sleep()


class PartialColocation(Placement):
    """Rollout ranks generate while judge ranks score, streaming each finished group.

    Args:
        rollout_ranks: Global ranks that host the policy engine (default: the first half); the others
            host the judge's engine. Each judge rank is paired with rollout rank ``index % len(rollout)``.
        min_judge_batch: While the judge's engine is idle, arriving samples are held until this many are
            waiting (or the stream ends), then judged as one batch; samples arriving meanwhile form the
            next. An engine step has a fixed cost, so judging each sample the moment it arrives spends
            the judge's time on tiny batches, while waiting for a large batch delays the overlap. ``None``
            (default): a quarter of the samples the judge rank receives per step.
    """

    def __init__(self, rollout_ranks: list[int] | None = None, min_judge_batch: int | None = None) -> None:
        if min_judge_batch is not None and min_judge_batch < 1:
            raise ValueError(f"`placement.min_judge_batch` must be >= 1, got {min_judge_batch}.")
        self.rollout_ranks = rollout_ranks
        self.min_judge_batch = min_judge_batch
        self._group = None

    def check(self, strategy) -> None:
        world = strategy.world_size
        if world < 2:
            raise ValueError(
                "`trainer.strategy.placement`: PartialColocation needs at least 2 processes (`trainer.devices`)."
            )
        if strategy.tensor_model_parallel_size * strategy.pipeline_model_parallel_size != 1:
            raise ValueError(
                "`trainer.strategy.placement`: PartialColocation supports data parallelism only; set "
                "tensor_model_parallel_size and pipeline_model_parallel_size to 1."
            )
        rollout = self.rollout_ranks or list(range(world // 2))
        if not rollout or len(rollout) >= world or any(r < 0 or r >= world for r in rollout):
            raise ValueError(f"`placement.rollout_ranks` {rollout} must name some, not all, of the {world} ranks.")
        if 2 * len(set(rollout)) > world:
            raise ValueError(
                f"`placement.rollout_ranks` {rollout}: each rollout rank needs a judge rank of its own; name at most "
                f"half of the {world} ranks."
            )
        self.rollout = sorted(rollout)
        self.judge = [r for r in range(world) if r not in self.rollout]

    # -- roles
    def partner_rollout(self, rank: int) -> int:
        return self.rollout[self.judge.index(rank) % len(self.rollout)]

    def partner_judges(self, rank: int) -> list[int]:
        return [j for j in self.judge if self.partner_rollout(j) == rank]

    def judge_for(self, owner: int, own_turns: Iterator[int]) -> int:
        """The judge rank a finished group goes to: its owner when that is a judge rank (its scores and
        samples are then where it trains), else the next of the rollout rank's judges in turn."""
        return owner if owner in self.judge else next(own_turns)

    def start_engines(self, strategy, module) -> None:
        self.check(strategy)
        if isinstance(module.long_tail, PartialRollout):
            raise ValueError("`model.long_tail`: PartialRollout works with FullColocation; use OverProvision here.")
        if not self.judges(module):
            raise ValueError(
                "PartialColocation overlaps generation with a GenerativeRewardModel; add one to `model.rewards`."
            )
        # A separate group carries the stream, so it never interleaves with the trainer's collectives.
        self._group = torch.distributed.new_group(backend="gloo")
        spec = module.rollout_engine_spec()
        rank = strategy.global_rank
        n_judge_ranks = len(self.partner_judges(rank)) + 1
        # In-process engines join the trainer's process group: vLLM's groups are created by whichever engine
        # starts first on each rank, so every rank starts one here, at the same point.
        if rank in self.rollout:
            strategy.start_policy_engine(batch_scale=n_judge_ranks)
        else:
            for genrm in self.judges(module):
                genrm.start(seed=spec["seed"], max_num_seqs=spec["max_num_seqs"] * 2, dtype=spec["dtype"])

    def generate(self, strategy, module, prompts, rows, sampling, seeds, keep):
        from yatt_lightning.collectives import exchange_objects

        self.reset_step()
        rank, world = strategy.global_rank, strategy.world_size
        # 1. Judge ranks hand their prompts to their rollout rank.
        outgoing = [None] * world
        if rank in self.judge:
            outgoing[self.partner_rollout(rank)] = (prompts, rows, seeds, keep)
        with wire.category("rollout"):
            received, _ = exchange_objects(outgoing)
        if rank in self.rollout:
            return self._rollout_side(strategy, module, prompts, rows, seeds, keep, sampling, received)
        return self._judge_side(strategy, module, len(prompts), sampling)

    def judge_batch(self, rank: int, n_prompts: int, n_samples: int) -> int:
        """Samples the judge on ``rank`` holds before judging while idle (see ``min_judge_batch``)."""
        if self.min_judge_batch is not None:
            return self.min_judge_batch
        source = self.partner_rollout(rank)
        judges = len(self.partner_judges(source))
        expected = n_prompts * n_samples * (judges + 1) / judges  # its own groups and a share of the source's
        return max(1, int(expected) // 4)

    # -- rollout ranks
    def _rollout_side(self, strategy, module, prompts, rows, seeds, keep, sampling, received):
        rank = strategy.global_rank
        judges = self.partner_judges(rank)
        owners = [rank] * len(prompts)
        wanted = {rank: keep}  # groups each owner keeps (over-provisioning keeps the first to finish)
        work_prompts, work_rows, work_seeds = list(prompts), list(rows), list(seeds)
        for src, item in enumerate(received):
            if item is not None:
                p, r, s, k = item
                owners += [src] * len(p)
                wanted[src] = k
                work_prompts += p
                work_rows += r
                work_seeds += s
        local_index = _local_indices(owners)
        mine: dict[int, list[Completion]] = {}
        sends = []
        try:
            with strategy.rollout_context() as engine:
                stream = _round_robin(judges)
                groups = module.generate_groups(engine, work_prompts, sampling, work_seeds, len(work_prompts))
                for index, group in groups:
                    if wanted[owners[index]] == 0:
                        continue  # this owner has its groups; the others run until every owner has
                    wanted[owners[index]] -= 1
                    texts = module.tokenizer.batch_decode([c.token_ids for c in group], skip_special_tokens=True)
                    if owners[index] == rank:
                        mine[local_index[index]] = group
                    message = {
                        "owner": owners[index], "index": local_index[index], "prompt": work_rows[index]["prompt"],
                        "texts": texts, "row": work_rows[index], "group": group if owners[index] != rank else None,
                    }  # fmt: skip
                    sends += _isend(message, self.judge_for(owners[index], stream), self._group)
                    if not any(wanted.values()):
                        groups.close()  # aborts what is still generating
                        break
        except Exception as err:  # the judges wait for the stream's end: tell them, then fail here too
            for judge in judges:
                _send_error(f"{type(err).__name__}: {err}", judge, self._group)
            raise
        for judge in judges:
            sends += _isend(None, judge, self._group)  # end of stream
        self.record_memory("rollout")
        # 2. Scores of this rank's groups come back from its judges. A judge answers after it received the
        # whole stream, so the sends are complete by then; one that failed answers with its error instead.
        t0 = time.perf_counter()
        scores: dict[str, dict[int, list[float]]] = {}
        metrics: dict[str, dict] = {}
        for judge in judges:
            answer = _recv(judge, self._group)
            _raise_remote(answer)
            for name, per_index, m in answer:
                scores.setdefault(name, {}).update(per_index)
                metrics.setdefault(name, {}).update(m)
        for req in sends:
            req.wait()
        self.idle += time.perf_counter() - t0
        kept = [i for i in range(len(prompts)) if i in mine]
        precomputed = {
            name: RewardOutput([s for i in kept for s in per[i]], metrics.get(name, {})) for name, per in scores.items()
        }
        return [mine.get(i) for i in range(len(prompts))], precomputed

    # -- judge ranks
    @staticmethod
    def _held_samples(messages: list[dict], held: list[int]) -> int:
        return sum(len(messages[m]["texts"]) for m in held)

    def _judge_side(self, strategy, module, n_prompts, sampling):
        """Receive groups as they finish and keep the judge's engine busy with all of them at once
        (continuous batching): new judgments join the running batch between engine steps."""
        rank = strategy.global_rank
        source = self.partner_rollout(rank)
        judges = self.judges(module)
        batch = self.judge_batch(rank, n_prompts, sampling.n)
        for genrm in judges:
            genrm.engine.wake_up()
        messages: list[dict] = []
        texts: list[list[list[str | None]]] = []  # [message][judge][sample] -> judgment text
        outstanding: list[dict[str, tuple[int, int]]] = [{} for _ in judges]  # request id -> (message, sample)
        held: list[int] = []  # messages received, not yet submitted to the judge
        failed: dict[tuple[int, int], RewardOutput] = {}  # (message, judge) -> the error policy's output
        done = False
        request = _PendingRecv(source, self._group)
        try:
            while not done or held or any(outstanding):
                busy = any(outstanding)
                # Receive what has arrived; while the judge is idle, wait for a batch worth judging.
                while not done and (request.ready() or (not busy and self._held_samples(messages, held) < batch)):
                    t0 = time.perf_counter()
                    message = request.take()
                    self.idle += time.perf_counter() - t0
                    if message is None:
                        done = True
                        break
                    _raise_remote(message)
                    held.append(len(messages))
                    messages.append(message)
                    texts.append([[None] * len(message["texts"]) for _ in judges])
                    request = _PendingRecv(source, self._group)
                if not busy and held:
                    for m in held:
                        message, n = messages[m], len(messages[m]["texts"])
                        for j, genrm in enumerate(judges):
                            try:
                                ids = genrm.submit([message["prompt"]] * n, message["texts"], [message["row"]] * n)
                            except Exception as err:  # a template field the row lacks, say: the error policy
                                failed[m, j] = genrm.failed(err, n)  # raises with `on_error: raise`
                                continue
                            outstanding[j].update({rid: (m, k) for k, rid in enumerate(ids)})
                    held = []
                for j, genrm in enumerate(judges):
                    if outstanding[j]:
                        for rid, text in genrm.engine.poll().items():
                            m, k = outstanding[j].pop(rid)
                            texts[m][j][k] = text
            outputs = {}
            for m, message in enumerate(messages):
                n = len(message["texts"])
                for j, genrm in enumerate(judges):
                    outputs[m, j] = failed.get((m, j)) or genrm.checked(
                        genrm.read(texts[m][j]), [message["prompt"]] * n, message["texts"], [message["row"]] * n
                    )
        except StreamError:
            raise  # the rollout rank failed and told us; it waits for nothing more
        except Exception as err:  # tell the rollout rank, which waits for scores, then fail here too
            error = (
                err
                if isinstance(err, RewardError)
                else RewardError(f"reward function {judges[0].name} raised {type(err).__name__}: {err}")
            )
            _send_error(str(error), source, self._group)
            raise error from err
        mine: dict[int, list[Completion]] = {}
        back: dict[str, dict[int, list[float]]] = {g.name: {} for g in judges}
        totals: dict[str, dict[str, float]] = {g.name: {} for g in judges}
        for j, genrm in enumerate(judges):
            for m, message in enumerate(messages):
                out = outputs[m, j]
                for key, value in out.metrics.items():
                    totals[genrm.name][key] = totals[genrm.name].get(key, 0.0) + value
                if message["owner"] == rank:
                    back[genrm.name][message["index"]] = out.scores
                    mine[message["index"]] = message["group"]
                elif message["owner"] != source:  # its scores would reach no one: a routing bug, not bad input
                    raise RuntimeError(f"rank {rank} received rank {message['owner']}'s group from rank {source}")
                else:
                    back.setdefault(f"{genrm.name}@{message['owner']}", {})[message["index"]] = out.scores
        for genrm in judges:
            genrm.engine.sleep()
        self.record_memory("reward")
        # Scores of the rollout rank's own groups go back to it; this rank keeps its own.
        payload = [(g.name, back.get(f"{g.name}@{source}", {}), {}) for g in judges]
        for req in _isend(payload, source, self._group):
            req.wait()
        kept = [i for i in range(n_prompts) if i in mine]
        precomputed = {g.name: RewardOutput([s for i in kept for s in back[g.name][i]], totals[g.name]) for g in judges}
        return [mine.get(i) for i in range(n_prompts)], precomputed


# ---------------------------------------------------------------------------------------------- stream helpers
def _local_indices(owners: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    out = []
    for owner in owners:
        out.append(seen.get(owner, 0))
        seen[owner] = out[-1] + 1
    return out


def _round_robin(items: list[int]) -> Iterator[int]:
    while True:
        yield from items


@wire.category("rollout")
def _isend(obj, dst: int, group) -> list:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.long)
    return [torch.distributed.isend(size, dst, group=group), torch.distributed.isend(payload, dst, group=group)]


@wire.category("rollout")
def _recv(src: int, group):
    size = torch.empty(1, dtype=torch.long)
    torch.distributed.recv(size, src, group=group)
    payload = torch.empty(int(size), dtype=torch.uint8)
    torch.distributed.recv(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())


class _PendingRecv:
    """A message being received: its size first (posted now), then the payload."""

    @wire.category("rollout")
    def __init__(self, src: int, group) -> None:
        self.src, self.group = src, group
        self.size = torch.empty(1, dtype=torch.long)
        self.request = torch.distributed.irecv(self.size, src, group=group)

    def ready(self) -> bool:
        return self.request.is_completed()

    @wire.category("rollout")
    def take(self):
        self.request.wait()
        payload = torch.empty(int(self.size), dtype=torch.uint8)
        torch.distributed.recv(payload, self.src, group=self.group)
        return pickle.loads(payload.numpy().tobytes())


class StreamError(RuntimeError):
    """The rank on the other end of a rollout/judge stream failed."""


def _send_error(text: str, dst: int, group) -> None:
    """Tell the other side of the stream that this side failed (:func:`_raise_remote` raises it there)."""
    for req in _isend(("__error__", text), dst, group):
        req.wait()


def _raise_remote(message) -> None:
    if isinstance(message, tuple) and len(message) == 2 and message[0] == "__error__":
        raise StreamError(f"the other side of the rollout/judge stream failed: {message[1]}")


__all__ = ["FullColocation", "PartialColocation", "Placement"]
