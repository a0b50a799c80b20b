"""The rollout service's parts called through its types, without a Trainer or an RLHFModule.

    python tests/scripts/service_calls.py MODE

MODE ``one``: one process, full colocation. ``dp2``: two data-parallel processes, both controllers.
``partial``: two processes under partial colocation with a judge. Each process builds a
``MegatronStrategy`` (its public ``setup_environment``, as Lightning calls it), hands its rollout
service a ``RolloutSetup`` and calls ``service.rollout`` / ``service.generate`` / ``service.score``,
``LongTailPolicy.plan`` / ``collect``, ``placement.generate`` and ``controller.generate`` / ``controller.score``
with ``RolloutRequest`` values; the checks are on the ``RolloutBatch`` / ``Generation`` / ``Scores``
that come back. Rank 0 prints one JSON line: every rank's results.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ALPHABET = "yatt_lightning.rewards.rules.alphabet_reward"


def _strategy(rank: int, world: int, port: int, **kwargs):
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    from yatt_lightning.engines.vllm_engine import VLLMEngine
    from yatt_lightning.strategy import MegatronStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    strategy = MegatronStrategy(
        engine=VLLMEngine(), accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")] * world,
        cluster_environment=LightningEnvironment(), process_group_backend="gloo", **kwargs,
    )  # fmt: skip
    strategy.setup_environment()
    return strategy


def _configure(strategy, rewards, long_tail, max_num_seqs: int = 64):
    import torch
    from transformers import AutoTokenizer

    from yatt_lightning.models.policy import MegatronPolicy
    from yatt_lightning.models.tiny import build_tiny_qwen2
    from yatt_lightning.rollout.service import EngineSpec, RolloutSetup

    path = build_tiny_qwen2()
    policy = MegatronPolicy(path, params_dtype=torch.float32, optimizer=None, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = EngineSpec(path, seed=0, max_num_seqs=max_num_seqs, max_model_len=32, dtype="float32")
    strategy.rollout.configure(RolloutSetup(policy, tokenizer, spec, rewards, long_tail, run_seed=0))
    from yatt_lightning.rollout.types import EngineStart

    strategy.placement.start_engines(strategy.rollout.setup, EngineStart(strategy.engine, 1))
    return tokenizer


def _shutdown(strategy) -> None:
    """What the strategy's teardown does once Lightning has started the engines: engines first, then the group."""
    import torch

    strategy.engine.shutdown()
    strategy.placement.shutdown(strategy.rollout.setup.reward_functions)
    torch.distributed.destroy_process_group()


def _request(tokenizer, rows, *, step: int = 0, n: int = 4, max_new_tokens: int = 6):
    from yatt_lightning.distributed.seeding import sampling_seed
    from yatt_lightning.engines.base import SamplingConfig
    from yatt_lightning.rollout.service import RolloutRequest

    return RolloutRequest(
        rows=rows, prompt_ids=[tokenizer(r["prompt"])["input_ids"] for r in rows],
        seeds=[sampling_seed(0, step, r, i) for i, r in enumerate(rows)],
        sampling=SamplingConfig(n=n, max_new_tokens=max_new_tokens), step=step, weights_version=0,
    )  # fmt: skip


def _rows(first: int, count: int) -> list[dict]:
    from yatt_lightning.datamodules.prompt import PromptDataModule

    return PromptDataModule().load_rows()[first : first + count]


def _layout(batch) -> dict:
    """What every controller promises of a batch: n samples per kept prompt, in prompt order, aligned."""
    return {
        "groups": batch.group_ids.tolist(),
        "ids": [r["_id"] for r in batch.rows],
        "aligned": all(len(lp) == len(c) for lp, c in zip(batch.rollout_logprobs, batch.completion_ids, strict=True))
        and batch.prompts == [r["prompt"] for r in batch.rows],
        "completions": [list(c) for c in batch.completion_ids],
    }


def mode_one(rank: int, port: int, queue) -> None:
    """Long-tail policies and full colocation through the service, on one process."""
    from yatt_lightning.rewards import RuleReward
    from yatt_lightning.rollout.longtail import OverProvision, PartialRollout, WaitForAll

    strategy = _strategy(rank, 1, port)
    rule = RuleReward(ALPHABET, name="alphabet")
    tokenizer = _configure(strategy, [rule], WaitForAll())
    service = strategy.rollout
    rows = _rows(0, 6)
    request = _request(tokenizer, rows)
    out = {}
    batch = service.rollout(request)
    out["wait"] = _layout(batch)
    out["wait_again"] = _layout(service.rollout(request))["completions"]
    out["wait_metrics"] = batch.metrics
    scores = service.score(batch)
    expected = rule(batch.prompts, batch.completions, batch.rows).scores
    out["scores"] = scores.total.tolist()
    out["scores_expected"] = expected
    out["score_metrics"] = scores.metrics
    with service.engine_ready(request.weights_version) as (engine, _, _pushed):
        generation = strategy.placement.generate(request, len(rows), engine)
        out["controller"] = [[list(c.token_ids) for c in g] for g in strategy.controller.generate(request, 6, engine)]
    out["full_generation"] = {"groups": [len(g) for g in generation.groups], "judged": sorted(generation.judged)}

    def run(policy, request):  # what the service does with a long-tail policy, step by step
        plan = policy.plan(request, 0)
        generation = service.generate(plan.request, plan.keep)[0] if plan.request is not None else None
        return policy.collect(plan, generation, tokenizer, strategy.controller.min_over_ranks)

    over = OverProvision(extra=1.0)  # 6 prompts launched, the first 3 groups to finish kept
    kept = run(over, request)
    out["over"] = _layout(kept)
    out["over_metrics"] = kept.metrics

    partial = PartialRollout(max_new_tokens_per_step=4)  # 6-token answers: none finishes in the first round
    rounds = []
    for step in range(3):
        b = run(partial, _request(tokenizer, _rows(10 * step, 2), step=step))
        partial.commit()
        rounds.append({"len": len(b), **b.metrics, "longest": max((len(c) for c in b.completion_ids), default=0)})
    out["partial"] = rounds
    _shutdown(strategy)
    queue.put((rank, out))


def mode_dp2(rank: int, port: int, queue) -> None:
    """The parallel and the single controller, each asked for the same request on two ranks."""
    from yatt_lightning.rewards import RuleReward
    from yatt_lightning.rollout.batch import RolloutBatch
    from yatt_lightning.rollout.controller import ParallelController, SingleController
    from yatt_lightning.rollout.longtail import WaitForAll
    from yatt_lightning.rollout.service import combine

    strategy = _strategy(rank, 2, port)
    single = SingleController()
    rule = RuleReward(ALPHABET, name="alphabet")
    tokenizer = _configure(strategy, [rule], WaitForAll(), max_num_seqs=64)
    service = strategy.rollout
    request = _request(tokenizer, _rows(4 * rank, 4))
    out = {}
    for name, controller in (("parallel", strategy.controller), ("single", single)):
        assert isinstance(controller, ParallelController if name == "parallel" else SingleController)
        with service.engine_ready(request.weights_version) as (engine, _, _pushed):
            groups = controller.generate(request, 4, engine)
        batch = RolloutBatch.from_groups(request.rows, request.prompt_ids, groups, tokenizer)
        scores = controller.score(batch, lambda part: combine([rule], part), False, tokenizer)
        out[name] = {**_layout(batch), "scores": scores.total.tolist()}
    _shutdown(strategy)
    queue.put((rank, out))


def mode_partial(rank: int, port: int, queue) -> None:
    """Partial colocation: rank 0 generates for both ranks, rank 1 judges while it does."""
    from yatt_lightning.placement import PartialColocation
    from yatt_lightning.rewards import GenerativeRewardModel, NumberParser, RuleReward
    from yatt_lightning.rollout.longtail import WaitForAll

    strategy = _strategy(rank, 2, port, placement=PartialColocation())
    rule = RuleReward(ALPHABET, name="alphabet")
    judge = GenerativeRewardModel(
        "builtin:tiny-qwen2", template="after {prompt} the answer {completion} scores",
        parser=NumberParser(low=0, high=9), choices=[str(d) for d in range(10)], max_new_tokens=2,
        max_judge_tokens=48, weight=0.1,
    )  # fmt: skip
    tokenizer = _configure(strategy, [rule, judge], WaitForAll())
    service = strategy.rollout
    request = _request(tokenizer, _rows(4 * rank, 4))
    batch = service.rollout(request)
    judged = batch.judged["judge"].scores  # what the placement judged while generating travels in the batch
    scores = service.score(batch)
    rule_scores = rule(batch.prompts, batch.completions, batch.rows).scores
    out = {
        **_layout(batch),
        "judged": sorted(batch.judged),
        "judged_count": len(judged),
        "total": scores.total.tolist(),
        "expected": [r + 0.1 * j for r, j in zip(rule_scores, judged, strict=True)],
        "idle_measured": "idle" in batch.rank_figures and "memory/rollout_rss_gb" in batch.rank_figures
        or "memory/reward_rss_gb" in batch.rank_figures,
    }
    _shutdown(strategy)
    queue.put((rank, out))


def main() -> None:
    from yatt_lightning.run.process_exit import collect_once_at_exit

    collect_once_at_exit()  # as `yatt` ends: without the interpreter's whole-heap collections at exit
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.helpers import spawn_gloo

    mode = sys.argv[1]
    target = {"one": mode_one, "dp2": mode_dp2, "partial": mode_partial}[mode]
    results = spawn_gloo(target, world=1 if mode == "one" else 2, timeout=500)
    print(json.dumps({str(rank): results[rank] for rank in sorted(results)}))


if __name__ == "__main__":
    main()
