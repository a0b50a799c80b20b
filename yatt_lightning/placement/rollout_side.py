"""Partial colocation, rollout side: generate every owner's prompts, stream each finished group to a judge."""

from __future__ import annotations

import itertools
import time

from yatt_lightning.datamodules.images import images_of
from yatt_lightning.engines.base import Completion
from yatt_lightning.placement import stream
from yatt_lightning.placement.base import memory, rank
from yatt_lightning.placement.pairing import Pairing
from yatt_lightning.rewards.base import RewardOutput
from yatt_lightning.rollout.types import Generation, RolloutRequest


def rollout_side(
    pairing: Pairing,
    engine,
    tokenizer,
    request: RolloutRequest,
    keep: int,
    work: list[tuple[int, stream.JudgeWork]],
) -> Generation:
    """Generate this rank's prompts and its judge ranks' (``work``: (source rank, its prompts)) on ``engine``;
    each group goes to a judge as it finishes. Returns this rank's kept groups and the scores its judges
    sent back."""
    me, group = rank(), pairing.group
    judges = pairing.partner_judges(me)
    owners = [me] * len(request.prompt_ids)
    wanted = {me: keep}  # groups each owner keeps (over-provisioning keeps the first to finish)
    prompts, rows, seeds = list(request.prompt_ids), list(request.rows), list(request.seeds)
    cap = request.sampling.max_new_tokens
    budgets = list(request.max_new_tokens or [cap] * len(prompts))
    for src, item in work:
        owners += [src] * len(item.prompt_ids)
        wanted[src] = item.keep
        prompts += item.prompt_ids
        rows += item.rows
        seeds += item.seeds
        budgets += item.max_new_tokens or [cap] * len(item.prompt_ids)
    local_index = _local_indices(owners)
    mine: dict[int, list[Completion]] = {}
    sends = []
    try:
        # the engine is awake with the policy's weights (the service readied it)
        turns = itertools.cycle(judges)
        groups = engine.generate_stream(prompts, request.sampling, seeds, budgets, images_of(rows))
        for index, finished in groups:
            owner = owners[index]
            if wanted[owner] == 0:
                continue  # this owner has its groups; the others run until every owner has
            wanted[owner] -= 1
            texts = tokenizer.batch_decode([c.token_ids for c in finished], skip_special_tokens=True)
            if owner == me:
                mine[local_index[index]] = finished
            message = stream.FinishedGroup(
                owner=owner, index=local_index[index], prompt=rows[index]["prompt"], texts=texts, row=rows[index],
                group=finished if owner != me else None,
            )  # fmt: skip
            sends += stream.send(message, pairing.judge_for(owner, turns), group)
            if not any(wanted.values()):
                groups.close()  # aborts what is still generating
                break
    except Exception as err:  # the judges wait for the stream's end: tell them, then fail here too
        for judge in judges:
            stream.tell_failure(err, me, judge, group)
        raise
    for judge in judges:
        sends += stream.send(stream.EndOfStream(), judge, group)
    figures = memory("rollout")
    # 2. Scores of this rank's groups come back from its judges. A judge answers after it received the
    # whole stream, so the sends are complete by then; one that failed answers with its failure instead.
    t0 = time.perf_counter()
    scores: dict[str, dict[int, list[float]]] = {}
    for judge in judges:
        answer: stream.JudgedScores = stream.receive(judge, group)
        for name, per_index in answer.scores.items():
            scores.setdefault(name, {}).update(per_index)
    for req in sends:
        req.wait()
    figures["idle"] = time.perf_counter() - t0
    kept = [i for i in range(len(request.prompt_ids)) if i in mine]
    judged = {name: RewardOutput([s for i in kept for s in per[i]]) for name, per in scores.items()}
    return Generation([mine.get(i) for i in range(len(request.prompt_ids))], judged, figures)


def _local_indices(owners: list[int]) -> list[int]:
    """Each prompt's index among its owner's prompts."""
    seen: dict[int, int] = {}
    out = []
    for owner in owners:
        out.append(seen.get(owner, 0))
        seen[owner] = out[-1] + 1
    return out
