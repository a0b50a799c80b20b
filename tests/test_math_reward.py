"""yatt_lightning.rewards.math (tier 1, pure): math-verify's equivalence through the reward's extraction, the
format reward, the rows' fields checked before start, and the calls on the reward deadline's worker thread
(where math-verify's own signal-based timeouts would raise)."""

from __future__ import annotations

import pytest

from yatt_lightning.rewards.math import BoxedFormatReward, MathReward, boxed_contents, final_answer


@pytest.mark.parametrize("completion", [r"so \boxed{1/2}", r"\boxed{0.5}", r"the answer: \boxed{\frac{1}{2}}", r"\boxed{\dfrac12}"])
@pytest.mark.parametrize("answer", ["1/2", "0.5", r"\frac{1}{2}"])
def test_one_answer_in_different_forms_scores_one(completion, answer):
    assert MathReward().score_one("", completion, answer) == 1.0


@pytest.mark.parametrize(("completion", "answer"), [
    (r"\boxed{1/3}", "0.5"), (r"\boxed{3}", "4"), (r"\boxed{-2}", "2"), (r"\boxed{}", "0"),
    (r"\boxed{x+1}", "x+2"), ("no answer here", "7"), (r"\boxed{2} then \boxed{3}", "2"),
])  # fmt: skip
def test_wrong_missing_or_superseded_answers_score_zero(completion, answer):
    assert MathReward().score_one("", completion, answer) == 0.0


def test_extraction_boxed_needs_a_box_and_last_number_falls_back_to_the_last_number():
    assert MathReward(extract="boxed").score_one("", "3 + 4 = 7", "7") == 0.0
    assert MathReward(extract="last_number").score_one("", "3 + 4 = 7", "7") == 1.0
    assert MathReward(extract="last_number").score_one("", "it is 1,000 apples", "1000") == 1.0
    assert MathReward(extract="last_number").score_one("", r"7, so \boxed{8}", "7") == 0.0  # a box still wins
    assert boxed_contents(r"\boxed{\frac{1}{2}} and \boxed{3}") == [r"\frac{1}{2}", "3"]  # braces balanced
    assert final_answer("nothing", "last_number") is None
    with pytest.raises(ValueError, match="`MathReward.extract`: 'first' is not one of boxed, last_number"):
        MathReward(extract="first")


def test_the_format_reward_wants_exactly_one_non_empty_box():
    fmt = BoxedFormatReward()
    assert [fmt.score_one("", c) for c in (r"\boxed{5}", r"\boxed{ }", r"\boxed{1}\boxed{2}", "5")] == [1.0, 0.0, 0.0, 0.0]


def test_rows_without_an_answer_are_named_before_start_and_calls_run_on_the_deadline_thread():
    reward = MathReward()
    problem = reward.row_problem(frozenset({"solution"}))
    assert problem is not None and "answer" in problem
    assert reward.row_problem(frozenset({"answer", "level"})) is None
    assert BoxedFormatReward().row_problem(frozenset({"solution"})) is None
    out = reward(["p"] * 3, [r"\boxed{2}", r"\boxed{0.25}", "x"], [{"answer": "2"}, {"answer": "1/4"}, {"answer": "2"}])
    assert out.scores == [1.0, 1.0, 0.0] and reward._caller is not None  # scored on its worker thread
