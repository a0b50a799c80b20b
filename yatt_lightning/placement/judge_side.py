"""Partial colocation, judge side: judge groups as they arrive, keeping the judge's engine busy."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from yatt_lightning.distributed.failures import RankFailure
from yatt_lightning.placement import stream
from yatt_lightning.placement.base import memory, rank
from yatt_lightning.placement.pairing import Pairing
from yatt_lightning.rewards.base import RewardError, RewardOutput
from yatt_lightning.rewards.genrm import GenerativeRewardModel
from yatt_lightning.rollout.types import Generation, RolloutRequest


@dataclass
class _Judging:
    """What the judge rank holds during a step: the groups received, and each judge's answers to them."""

    judges: list[GenerativeRewardModel]
    groups: list[stream.FinishedGroup] = field(default_factory=list)
    texts: list[list[list[str | None]]] = field(default_factory=list)  # [group][judge][sample] -> judgment
    outstanding: list[dict[str, tuple[int, int]]] = field(default_factory=list)  # request id -> (group, sample)
    held: list[int] = field(default_factory=list)  # groups received, not yet submitted
    failed: dict[tuple[int, int], RewardOutput] = field(default_factory=dict)  # (group, judge) -> error policy's

    def __post_init__(self) -> None:
        self.outstanding = [{} for _ in self.judges]

    def add(self, group: stream.FinishedGroup) -> None:
        self.held.append(len(self.groups))
        self.groups.append(group)
        self.texts.append([[None] * len(group.texts) for _ in self.judges])

    def held_samples(self) -> int:
        return sum(len(self.groups[g].texts) for g in self.held)

    def busy(self) -> bool:
        return any(self.outstanding)

    def submit_held(self) -> None:
        for g in self.held:
            group, n = self.groups[g], len(self.groups[g].texts)
            for j, genrm in enumerate(self.judges):
                try:
                    ids = genrm.submit([group.prompt] * n, group.texts, [group.row] * n)
                except Exception as err:  # a template field the row lacks, say: the error policy
                    self.failed[g, j] = genrm.failed(err, n)  # raises with `on_error: raise`
                    continue
                self.outstanding[j].update({rid: (g, k) for k, rid in enumerate(ids)})
        self.held = []

    def poll(self) -> None:
        for j, genrm in enumerate(self.judges):
            if self.outstanding[j]:
                for rid, text in genrm.engine.poll().items():
                    g, k = self.outstanding[j].pop(rid)
                    self.texts[g][j][k] = text

    def outputs(self) -> dict[tuple[int, int], RewardOutput]:
        out = {}
        for g, group in enumerate(self.groups):
            n = len(group.texts)
            for j, genrm in enumerate(self.judges):
                out[g, j] = self.failed.get((g, j)) or genrm.checked(
                    genrm.read(self.texts[g][j]), [group.prompt] * n, group.texts, [group.row] * n
                )
        return out


def judge_side(pairing: Pairing, judges: list[GenerativeRewardModel], request: RolloutRequest) -> Generation:
    """Receive groups as they finish and keep the judge's engine busy with all of them at once (continuous
    batching: new judgments join the running batch between engine steps). Returns this rank's own groups
    with their scores; the rollout rank's scores go back to it."""

    me, group = rank(), pairing.group
    source = pairing.partner_rollout(me)
    batch = pairing.judge_batch(me, len(request.prompt_ids), request.sampling.n)
    idle = 0.0
    for genrm in judges:
        genrm.engine.wake_up()
    state = _Judging(judges)
    done = False
    incoming = stream.Incoming(source, group)
    try:
        while not done or state.held or state.busy():
            busy = state.busy()
            # Receive what has arrived; while the judge is idle, wait for a batch worth judging.
            while not done and (incoming.ready() or (not busy and state.held_samples() < batch)):
                t0 = time.perf_counter()
                message = incoming.take()
                idle += time.perf_counter() - t0
                if isinstance(message, stream.EndOfStream):
                    done = True
                    break
                state.add(message)
                incoming = stream.Incoming(source, group)
            if not busy and state.held:
                state.submit_held()
            state.poll()
        outputs = state.outputs()
    except RankFailure:
        raise  # the rollout rank failed and told us; it waits for nothing more
    except Exception as err:  # tell the rollout rank, which waits for scores, then fail here too
        error = (
            err
            if isinstance(err, RewardError)
            else RewardError(f"reward function {judges[0].name} raised {type(err).__name__}: {err}")
        )
        stream.tell_failure(error, me, source, group)
        raise error from err
    for genrm in judges:
        genrm.engine.sleep()
    generation = _route(pairing, me, source, judges, state.groups, outputs, len(request.prompt_ids))
    return Generation(generation.groups, generation.judged, {"idle": idle, **memory("reward")})


def _route(pairing: Pairing, rank, source, judges, groups, outputs, n_prompts) -> Generation:
    """Keep this rank's own groups and scores; send the rollout rank the scores of its groups."""

    mine, own, theirs = {}, {g.name: {} for g in judges}, {g.name: {} for g in judges}
    totals: dict[str, dict[str, float]] = {g.name: {} for g in judges}
    for j, genrm in enumerate(judges):
        for g, finished in enumerate(groups):
            out = outputs[g, j]
            for key, value in out.metrics.items():
                totals[genrm.name][key] = totals[genrm.name].get(key, 0.0) + value
            if finished.owner == rank:
                own[genrm.name][finished.index] = out.scores
                mine[finished.index] = finished.group
            elif finished.owner == source:
                theirs[genrm.name][finished.index] = out.scores
            else:  # its scores would reach no one: a routing bug, not bad input
                raise RuntimeError(f"rank {rank} received rank {finished.owner}'s group from rank {source}")
    for req in stream.send(stream.JudgedScores(theirs), source, pairing.group):
        req.wait()
    kept = [i for i in range(n_prompts) if i in mine]
    judged = {g.name: RewardOutput([s for i in kept for s in own[g.name][i]], totals[g.name]) for g in judges}
    return Generation([mine.get(i) for i in range(n_prompts)], judged)
