"""Tier 1: packing rollouts into micro-batches (alignment of logits, targets and masks)."""

import dataclasses

import pytest
import torch

from yatt_lightning.algorithms import Advantages
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.training.batch import MicroBatch, TrainingBatch, TrainingSamples


def _rollouts():
    return RolloutBatch(
        prompts=["a", "b"],
        prompt_ids=[[10, 11, 12], [20]],
        completion_ids=[[13, 14], [21, 22, 23]],
        completions=["", ""],
        rows=[{}, {}],
        group_ids=torch.tensor([0, 1]),
        rollout_logprobs=[torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0, -5.0])],
        finish_reasons=["length", "stop"],
    )


def _batch():
    return TrainingBatch(
        TrainingSamples.of(_rollouts()),
        Advantages(torch.tensor([0.5, -0.5])),
        old_logprobs=[torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0, -5.0])],
    )


def test_a_rollout_batch_is_a_value_scoring_makes_a_new_one():
    rollouts = _rollouts()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollouts.rewards = torch.zeros(2)
    scored = rollouts.scored(torch.tensor([1.0, 0.0]))
    assert rollouts.rewards is None and scored.rewards.tolist() == [1.0, 0.0]
    assert scored.completion_ids is rollouts.completion_ids  # nothing copied but the new field
    with pytest.raises(ValueError, match="2 samples got rewards of shape"):
        rollouts.scored(torch.zeros(3))
    with pytest.raises(ValueError, match="returned 3 advantages for 2 samples"):
        Advantages.of(torch.zeros(3), 2)
    assert Advantages.of(torch.tensor([1, 2]), 2).values.dtype == torch.float


def test_microbatch_masks_mark_positions_predicting_completion_tokens():
    (mb,) = _batch().microbatches([0, 1], micro_batch_size=2, pad_id=0, pad_to_multiple=1)
    assert mb["input_ids"].tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 0]]
    # position t predicts token t+1: sample 0's completion tokens 13, 14 are predicted at positions 2, 3
    assert mb["loss_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    targets = mb["input_ids"][:, 1:][mb["loss_mask"].bool()]
    assert targets.tolist() == [13, 14, 21, 22, 23]
    assert mb["old_logprobs"][mb["loss_mask"].bool()].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert mb["advantages"].tolist() == [0.5, -0.5]


def test_microbatches_split_and_pad_to_multiple():
    mbs = _batch().microbatches([1, 0], micro_batch_size=1, pad_id=0, pad_to_multiple=8)
    assert [mb["input_ids"].shape for mb in mbs] == [(1, 8), (1, 8)]
    assert [mb["sample_index"].tolist() for mb in mbs] == [[1], [0]]
    values = torch.zeros(1, 7)
    values[0, 0:3] = torch.tensor([7.0, 8.0, 9.0])
    assert TrainingBatch.unpack_per_token(mbs[0], values)[0].tolist() == [7.0, 8.0, 9.0]


def test_mini_batches_split_any_sample_count_evenly():
    from yatt_lightning.module import mini_batch_slices

    sizes = lambda n, parts: [s.stop - s.start for s in mini_batch_slices(n, parts)]  # noqa: E731
    assert sizes(8, 2) == [4, 4]
    assert sizes(10, 3) == [3, 3, 4]  # dynamic sampling may train 5 groups of 2 with 3 mini-batches
    assert sizes(2, 4) == [1, 1]  # fewer samples than mini-batches: one optimizer step per sample
    covered = [i for s in mini_batch_slices(10, 3) for i in range(10)[s]]
    assert covered == list(range(10))


def test_per_token_advantages_and_critic_targets_reach_the_microbatch():
    rollouts = _rollouts()
    adv = Advantages(tokens=[torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])],
                     returns=[torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.4, 0.5])],
                     old_values=[torch.zeros(2), torch.ones(3)])  # fmt: skip
    (mb,) = TrainingBatch.of(rollouts, adv).microbatches([0, 1], micro_batch_size=2, pad_id=0, pad_to_multiple=1)
    mask = mb["loss_mask"].bool()
    assert mb["advantages"].shape == mb["loss_mask"].shape
    assert mb["advantages"][mask].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    torch.testing.assert_close(mb["returns"][mask], torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]))
    assert mb["old_values"][mask].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_the_balancer_moves_per_token_advantages_with_their_samples():
    """What DPLoadBalancer sends (its flat tensors) rebuilds the same samples, per-token fields included."""
    from yatt_lightning.callbacks.dp_balance import DPLoadBalancer

    rollouts = _rollouts().scored(torch.tensor([1.0, 0.0]))
    adv = Advantages(tokens=[torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])],
                     returns=[torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.4, 0.5])],
                     old_values=[torch.zeros(2), torch.ones(3)])  # fmt: skip
    batch = TrainingBatch.of(rollouts, adv)
    sent = [DPLoadBalancer._pack(batch, [1], 0), DPLoadBalancer._pack(batch, [0], 0)]  # two "ranks", out of order
    got = DPLoadBalancer._unpack(sent)
    assert got.samples.completion_ids == rollouts.completion_ids and got.samples.prompt_ids == rollouts.prompt_ids
    assert got.samples.images == [None, None]  # what training needs, nothing fabricated
    for field in ("tokens", "returns", "old_values"):
        for a, b in zip(getattr(got.advantages, field), getattr(adv, field), strict=True):
            torch.testing.assert_close(a, b)
    scalar = DPLoadBalancer._unpack(
        [DPLoadBalancer._pack(TrainingBatch.of(rollouts, Advantages(torch.tensor([0.5, -0.5]))), [0, 1], 0)]
    )
    assert scalar.advantages.values.tolist() == [0.5, -0.5] and scalar.advantages.tokens is None


def test_a_micro_batch_is_typed_and_reads_as_a_mapping_for_dict_style_hooks():
    (mb,) = _batch().microbatches([0, 1], micro_batch_size=2, pad_id=0)
    assert isinstance(mb, MicroBatch) and mb.ref_logprobs is None and mb.pixel_values is None
    assert "old_logprobs" in mb and "ref_logprobs" not in mb and "nonsense" not in mb
    assert torch.equal(mb["advantages"], mb.advantages)
    with pytest.raises(KeyError):
        mb["ref_logprobs"]
    on_policy = mb.replace(old_logprobs=torch.zeros_like(mb.loss_mask))
    assert on_policy.old_logprobs.abs().sum() == 0 and mb.old_logprobs.abs().sum() > 0  # a new value
