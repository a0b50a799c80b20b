"""Tier 1: the load balancer's cost model and its decision (which rank trains which sequence)."""

import random

import pytest
import torch

from yatt_lightning.training.balance_plan import Planner, choose_parts
from yatt_lightning.training.cost_model import TrainCostModel, Work, microbatch_work, plan_work
from yatt_lightning.training.partition import swap_path

# Seconds per term as measured on 2 CPU cores for the tiny model (bench/RESULTS.md, dp_balance): a
# micro-batch costs what ~250 tokens cost, an exchange a few milliseconds.
CPU = {"tokens": 70e-6, "attention": 2e-6, "micro_batches": 0.017, "moved_bytes": 2e-9, "exchanges": 0.004}
# A GPU-like machine: micro-batches and the exchange cheap, tokens and long attention dear.
GPU = {"tokens": 70e-6, "attention": 3e-5, "micro_batches": 0.0005, "moved_bytes": 1e-10, "exchanges": 0.0005}


def _seconds(truth: dict, work: Work, rng: random.Random, noise: float = 0.05) -> tuple[float, float]:
    compute = truth["tokens"] * work.tokens + truth["attention"] * work.attention
    compute += truth["micro_batches"] * work.micro_batches
    exchange = truth["moved_bytes"] * work.moved_bytes + truth["exchanges"] * work.exchanges
    return compute * rng.uniform(1 - noise, 1 + noise), exchange * rng.uniform(1 - noise, 1 + noise)


def _lengths(rng: random.Random, median: float, longest: int, prompts: int = 16, samples: int = 8) -> list[int]:
    """Group-correlated lognormal lengths (what the bench draws), prompts x samples, 2 ranks' blocks."""
    out = []
    for _ in range(prompts):
        scale = median * rng.lognormvariate(0, 1)
        out += [16 + int(min(longest, max(2, scale * rng.lognormvariate(0, 0.3)))) for _ in range(samples)]
    return out


def _learn(truth: dict, planner: Planner, median: float, longest: int, steps: int = 24, seed: int = 0):
    """A model that has watched ``steps`` steps of a 2-rank run on ``truth``'s machine, deciding as it goes."""
    rng, model = random.Random(seed), TrainCostModel(256)
    for _ in range(steps):
        lengths = _lengths(rng, median, longest)
        choice = choose_parts(lengths, 2, model, planner, [12.0 * x for x in lengths])
        for work in choice.work:
            model.observe(work, *_seconds(truth, work, rng))
    return model, rng


def test_the_fit_recovers_each_term_it_has_seen_vary():
    model, _ = _learn(CPU, Planner(2048, 256, 64), 16, 200)
    fitted = model.coefficients
    assert fitted["tokens"] == pytest.approx(CPU["tokens"], rel=0.1)
    assert fitted["micro_batches"] == pytest.approx(CPU["micro_batches"], rel=0.15)
    assert fitted["exchanges"] == pytest.approx(CPU["exchanges"], rel=0.2)  # from the exchanges' own times
    assert model.rms_error < 0.05 * 0.3  # seconds, against ~0.3 s steps


def test_before_any_measurement_the_prior_decides_in_tokens():
    model = TrainCostModel(micro_batch_overhead_tokens=100)
    assert not model.fitted
    assert model.predict(Work(1000, 0, 2)) == pytest.approx(1200)
    assert model.predict(Work(0, 0, 0, moved_bytes=640, exchanges=1)) == pytest.approx(110)


def test_where_tokens_dominate_it_moves_and_evens_the_ranks():
    planner = Planner(4096, 256, 64)
    model, rng = _learn(GPU, planner, 128, 1008)
    evened = 0
    for _ in range(10):
        lengths = _lengths(rng, 128, 1008)
        choice = choose_parts(lengths, 2, model, planner, [12.0 * x for x in lengths])
        truth = [sum(_seconds(GPU, w, rng, noise=0)) for w in choice.work]
        unmoved = [sum(_seconds(GPU, planner.work(lengths[r * 128 : (r + 1) * 128]), rng, noise=0)) for r in range(2)]
        assert max(truth) <= max(unmoved) * 1.001  # never slower (by the true costs)
        if choice.moves:
            evened += max(truth) / (sum(truth) / 2) <= 1.05
    assert evened >= 7


def test_where_micro_batches_and_the_exchange_dominate_it_moves_only_when_it_pays():
    """On a CPU-like machine with an exchange as dear as 10 micro-batches, a split that saves a little
    padding is not worth moving; every split it keeps must save more than it costs by the true costs."""
    truth = {**CPU, "exchanges": 0.17}
    planner = Planner(2048, 256, 64)
    model, rng = _learn(truth, planner, 16, 200, steps=40)
    kept = 0
    for _ in range(30):
        lengths = _lengths(rng, 16, 200)
        choice = choose_parts(lengths, 2, model, planner, [12.0 * x for x in lengths])
        true_after = max(sum(_seconds(truth, w, rng, noise=0)) for w in choice.work)
        true_before = max(sum(_seconds(truth, planner.work(lengths[r * 128 : (r + 1) * 128]), rng, noise=0))
                          for r in range(2))  # fmt: skip
        assert true_after <= true_before * 1.001
        kept += not choice.moves
    assert kept >= 20


def test_a_saving_below_min_saving_keeps_the_rows():
    """Before any measurement (the prior, in tokens: an exchange costs 256), with one sample per micro-batch."""
    model = TrainCostModel(256)
    planner = Planner(None, 256, 1)
    slight = [1000, 1000, 1000, 960]  # rank 1 is 40 tokens lighter: a swap saves less than the exchange costs
    assert not choose_parts(slight, 2, model, planner, [0.0] * 4).moves
    heavy = [1000, 1000, 8, 8]  # 2512 against 1528 + 256 for the exchange
    choice = choose_parts(heavy, 2, model, planner, [0.0] * 4)
    assert choice.moves and choice.moved == 2 and choice.predicted == pytest.approx(1008 + 512 + 256)
    assert not choose_parts(heavy, 2, model, planner, [0.0] * 4, min_saving=0.5).moves


def test_decide_by_tokens_ignores_the_model():
    lengths = [200, 190, 10, 10, 180, 5, 5, 5]
    expensive = TrainCostModel(256)
    expensive.exchange = expensive.exchange * 1e6  # moving costs "forever" by the model
    choice = choose_parts(lengths, 2, expensive, Planner(None, 256, 1), [1.0] * 8, decide_by="tokens")
    assert choice.moves
    with pytest.raises(ValueError, match="decide_by"):
        choose_parts(lengths, 2, expensive, Planner(None, 256, 1), [1.0] * 8, decide_by="time")


def test_the_swap_path_keeps_each_part_on_its_rank_and_sizes_equal():
    weights = [9.0, 8.0, 7.0, 1.0, 1.0, 1.0]
    start = [[0, 1, 2], [3, 4, 5]]
    path = list(swap_path(weights, start))
    assert path and len(path[0][0]) == len(path[0][1]) == 3
    first = path[0]
    assert len(set(first[0]) - set(start[0])) == 1  # one swap moves one sequence each way
    sums = [sum(weights[i] for i in p) for p in path[-1]]
    assert max(sums) < 24


def test_work_of_a_plan_equals_the_work_of_its_micro_batches():
    from yatt_lightning.training.batch import TrainingBatch, TrainingSamples

    prompts, completions = [[1] * 3, [1] * 7, [1] * 10, [1] * 4], [[2] * 2, [2] * 10, [2] * 20, [2] * 5]
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]  # 5, 17, 30, 9
    samples = TrainingSamples(prompts, completions, [torch.zeros(len(c)) for c in completions], [None] * 4)
    plan = [[2, 1], [0, 3]]
    built = TrainingBatch(samples).microbatches([0, 1, 2, 3], micro_batch_size=2, pad_id=0, plan=plan)
    assert plan_work(lengths, plan) == microbatch_work(built) == Work(96.0, (2 * 32 * 32 + 2 * 16 * 16) / 1000, 2.0)


def test_the_balancer_validates_its_keys():
    from yatt_lightning.callbacks import DPLoadBalancer

    with pytest.raises(ValueError, match="`DPLoadBalancer.decide_by`"):
        DPLoadBalancer(decide_by="time")
    with pytest.raises(ValueError, match="`DPLoadBalancer.min_saving`"):
        DPLoadBalancer(min_saving=1.5)


def test_the_wire_estimate_matches_what_is_sent():
    from yatt_lightning.callbacks.dp_balance import DPLoadBalancer

    from yatt_lightning.algorithms import Advantages
    from yatt_lightning.rollout.batch import RolloutBatch
    from yatt_lightning.training.batch import TrainingBatch

    rollouts = RolloutBatch(
        prompts=["a", "b"], prompt_ids=[[1] * 16, [2] * 16], completion_ids=[[3] * 40, [4] * 300],
        completions=["", ""], rows=[{}, {}], group_ids=torch.tensor([0, 1]),
        rollout_logprobs=[torch.zeros(40), torch.zeros(300)], finish_reasons=["", ""],
    ).scored(torch.tensor([1.0, 0.0]))  # fmt: skip
    batch = TrainingBatch.of(rollouts, Advantages(torch.tensor([0.5, -0.5])))
    for i in range(2):
        sent = DPLoadBalancer._pack(batch, [i], 0)
        real = sum(t.numel() * t.element_size() for t in sent.values())
        assert DPLoadBalancer._bytes(batch)[i] == pytest.approx(real, rel=0.05)
