"""Tier 1: rule rewards and user reward functions loaded by import path."""

import re
import threading
import time

import pytest

from yatt_lightning.rewards.base import RewardError, RewardFunction, RuleReward, load_callable
from yatt_lightning.rewards.rules import alphabet_reward


def test_alphabet_reward_partial_credit():
    assert alphabet_reward("after f comes", "g h i j", answer="g h i j") == 1.0
    # all four are letters (format 0.5), two of four correct (0.25)
    assert alphabet_reward("after f comes", "g h x y", answer="g h i j") == pytest.approx(0.75)
    # no letters at all
    assert alphabet_reward("after f comes", "1 2 + =", answer="g h i j") == 0.0
    # too short: missing positions score 0; extra words ignored
    assert alphabet_reward("p", "g", answer="g h i j") == pytest.approx(0.25)
    assert alphabet_reward("p", "g h i j k l", answer="g h i j") == 1.0


def test_function_reward_passes_row_fields(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def exact(prompt, completion, answer, **row):\n    return float(completion.strip() == answer)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = RuleReward("my_rewards.exact")
    rows = [{"prompt": "q", "answer": "42", "_source": "data.jsonl:1"}, {"prompt": "q", "answer": "7"}]
    assert fn(["q", "q"], ["42", "8"], rows).scores == [1.0, 0.0]


def test_reward_that_raises_names_the_sample(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text("def boom(prompt, completion, **row):\n    raise KeyError('answer')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = RuleReward("bad_rewards.boom")
    with pytest.raises(RewardError, match=r"bad_rewards.boom raised KeyError.*data.jsonl:3.*'what is 2\+2'.*'four'"):
        fn(["what is 2+2"], ["four"], [{"prompt": "what is 2+2", "_source": "data.jsonl:3"}])


BAD_REWARDS = {
    "raises": ("return 1 / 0", r"reward function rw_bad\.score raised ZeroDivisionError: division by zero on sample"),
    "returns NaN": ("return float('nan')", r"reward function rw_bad\.score returned nan \(not a finite number\)"),
    "returns a string": ("return 'good'", r"reward function rw_bad\.score returned 'good' \(not a finite number\)"),
    "returns None": ("return None", r"reward function rw_bad\.score returned None \(not a finite number\)"),
}


@pytest.mark.parametrize("name", BAD_REWARDS)
def test_a_reward_that_fails_names_the_function_the_value_and_the_sample(name, tmp_path, monkeypatch):
    """What the user reads when their reward fails at run time (tests/test_bad_input.py runs one through
    ``yatt fit``: the same error reaches one screen)."""
    import sys

    body, match = BAD_REWARDS[name]
    (tmp_path / "rw_bad.py").write_text(f"def score(prompt, completion, **row):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rw_bad", raising=False)
    with pytest.raises(RewardError, match=match) as err:
        RuleReward("rw_bad.score")(["after f comes"], ["g h"], [{"prompt": "after f comes", "_source": "d.jsonl:2"}])
    assert "'after f comes'" in str(err.value) and "d.jsonl:2" in str(err.value)


def test_reward_returning_nan_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "nan_rewards.py").write_text("def nan(prompt, completion, **row):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="returned nan"):
        RuleReward("nan_rewards.nan")(["p"], ["c"], [{"prompt": "p"}])

    (tmp_path / "zero_rewards.py").write_text("def bad(prompt, completion, **row):\n    return 1 / 0\n")
    out = RuleReward("zero_rewards.bad", on_error="zero")(["p", "q"], ["c", "d"], [{}, {}])
    assert out.scores == [0.0, 0.0] and out.metrics == {"reward/zero_rewards.bad/errors": 2.0}


def test_a_reward_past_its_deadline_fails_naming_the_function_the_sample_and_the_key(tmp_path, monkeypatch):
    (tmp_path / "slow_rewards.py").write_text(
        "import time\n"
        "def slow(prompt, completion, **row):\n"
        "    if completion == 'stuck':\n"
        "        time.sleep(60)\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": "p", "_source": "data.jsonl:1"}, {"prompt": "p", "_source": "data.jsonl:2"}]
    fn = RuleReward("slow_rewards.slow")
    fn.set_default_timeout(0.3, "model.reward_timeout_s")
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"slow_rewards.slow did not return within 0.3 s \(`model.reward_timeout_s`\) on "
                                          r"sample \(data.jsonl:2\) .*'stuck'"):  # fmt: skip
        fn(["p", "p"], ["fine", "stuck"], rows)
    assert time.monotonic() - t0 < 2.0

    # on_error: zero scores the late sample 0, counts it, and the next call gets a worker of its own
    fn = RuleReward("slow_rewards.slow", on_error="zero", timeout_s=0.3)
    fn.set_default_timeout(300, "model.reward_timeout_s")  # its own deadline wins
    out = fn(["p", "p", "p"], ["stuck", "fine", "stuck"], [{}, {}, {}])
    assert out.scores == [0.0, 1.0, 0.0]
    assert out.metrics == {"reward/slow_rewards.slow/errors": 2.0, "reward/slow_rewards.slow/timeouts": 2.0}
    assert fn(["p"], ["fine"], [{}]).scores == [1.0]
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("reward:"))  # never hold up the exit


def test_a_batch_scorer_past_its_deadline_is_a_failure_of_the_batch():
    class Judge(RewardFunction):
        def score(self, prompts, completions, rows):
            time.sleep(60)

    with pytest.raises(RewardError, match=r"Judge did not return within 0.2 s \(`timeout_s`\) on a batch of 2"):
        Judge(timeout_s=0.2)(["p", "q"], ["c", "d"], [{}, {}])
    out = Judge(timeout_s=0.2, on_error="zero")(["p", "q"], ["c", "d"], [{}, {}])
    assert out.scores == [0.0, 0.0] and out.metrics["reward/Judge/timeouts"] == 2.0
    with pytest.raises(ValueError, match="`timeout_s` of reward function Judge must be > 0"):
        Judge(timeout_s=0)


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("nodots", "not a dotted import path"),
        ("no_such_module_xyz.fn", "cannot import module 'no_such_module_xyz'"),
        ("math.no_such_function", "has no function 'no_such_function'"),
    ],
)
def test_load_callable_errors_name_the_key(path, match):
    with pytest.raises(ValueError, match=match) as err:
        load_callable(path)
    assert "model.reward_fn" in str(err.value)


def test_math_answer_reward():
    from yatt_lightning.rewards.rules import math_answer_reward

    assert math_answer_reward("q", "so the total is \\boxed{1,000}.", answer="1000") == 1.0
    assert math_answer_reward("q", "3 + 4 = 7. The answer is 7", answer="7") == 1.0
    assert math_answer_reward("q", "I think 8, no wait, 9", answer="8") == 0.0
    assert math_answer_reward("q", "no idea", answer="8") == 0.0
    assert math_answer_reward("q", "\\boxed{x+1}", answer="x+1") == 1.0


def test_judge_and_reward_model_settings_are_checked_at_construction():
    from yatt_lightning.rewards import GenerativeRewardModel, RegexParser, RewardModel

    with pytest.raises(ValueError, match=r"field \{\"score\"\} is not a row field's name; write literal braces"):
        GenerativeRewardModel("builtin:tiny-qwen2", template='{completion} as {"score": 7}')
    with pytest.raises(ValueError, match="not a valid format string"):
        GenerativeRewardModel("builtin:tiny-qwen2", template="{completion} {")
    judge = GenerativeRewardModel("builtin:tiny-qwen2", template="{completion} vs {answer}")
    with pytest.raises(ValueError, match=r"field \{answer\} is not in the row \(d.jsonl:4\)"):
        judge.judge_prompts(["p"], ["c"], [{"_source": "d.jsonl:4"}])
    with pytest.raises(ValueError, match="`group` 2 does not exist"):
        RegexParser(r"score: (\d)", group=2)
    with pytest.raises(ValueError, match="`batch_size` must be >= 1"):
        RewardModel("builtin:tiny-qwen2", batch_size=0)


def test_export_names_a_wrong_dtype():
    from yatt_lightning.checkpoint.export import export

    with pytest.raises(ValueError, match="`--dtype` must be one of float32, bfloat16, float16, got 'int8'"):
        export("nowhere", "out", dtype="int8")


def test_per_token_rewards_are_weighted_and_checked():
    """A TokenRewardFunction's per-token rewards, times its weight, reach the Scores and the rollout batch;
    one value too few names the function and the sample."""
    import torch

    from yatt_lightning.rewards.base import TokenRewardFunction
    from yatt_lightning.rollout.batch import RolloutBatch
    from yatt_lightning.rollout.service import combine

    class PerToken(TokenRewardFunction):
        def score_tokens(self, prompts, completions, completion_ids, rows):
            return [[float(t) for t in ids] for ids in completion_ids]

    class Short(TokenRewardFunction):
        def score_tokens(self, prompts, completions, completion_ids, rows):
            return [ids[:-1] for ids in completion_ids]

    batch = RolloutBatch(prompts=["p", "q"], prompt_ids=[[1], [2]], completion_ids=[[3, 4], [5]], completions=["a", "b"],
                         rows=[{"answer": "b"}, {"answer": "c"}], group_ids=torch.tensor([0, 0]), rollout_logprobs=[torch.zeros(2), torch.zeros(1)],
                         finish_reasons=["stop", "stop"])  # fmt: skip
    scores = combine([PerToken(weight=0.5), RuleReward("yatt_lightning.rewards.rules.alphabet_reward")], batch)
    assert [t.tolist() for t in scores.token_rewards] == [[1.5, 2.0], [2.5]]
    scored = batch.scored(scores.total, scores.token_rewards)
    assert [t.tolist() for t in scored.select_groups([0]).token_rewards] == [[1.5, 2.0], [2.5]]
    with pytest.raises(
        RewardError, match=r"reward function Short returned 1 per-token rewards .* for 2 completion tokens"
    ):
        combine([Short()], batch)


def _needs_answer(prompt, completion, answer):
    return 0.0


def _two_fields(prompt, completion):
    return 0.0


def _with_default(prompt, completion, answer, hint=None):
    return 0.0


def _any_field(prompt, completion, answer, **row):
    return 0.0


def _keyword_only(prompt, completion, *, answer, level=1):
    return 0.0


def _positional_only(prompt, completion, /, answer):
    return 0.0


class _Scorer:
    def __call__(self, prompt, completion, answer):
        return 0.0


FIELD_CASES = [  # (function, the row's fields, missing, unexpected, repeated); all empty: it binds
    (_needs_answer, {"answer"}, (), (), ()),
    (_needs_answer, set(), ("answer",), (), ()),  # a required parameter no field fills
    (_needs_answer, {"answer", "level"}, (), ("level",), ()),  # a field no parameter takes
    (_two_fields, {"answer"}, (), ("answer",), ()),
    (_two_fields, set(), (), (), ()),
    (_with_default, {"answer"}, (), (), ()),  # a parameter with a default is optional
    (_with_default, {"answer", "hint"}, (), (), ()),
    (_any_field, {"answer", "level", "images"}, (), (), ()),  # **row takes any field
    (_any_field, {"level"}, ("answer",), (), ()),
    (_keyword_only, {"answer"}, (), (), ()),
    (_keyword_only, {"level"}, ("answer",), (), ()),
    (_positional_only, {"completion", "answer"}, (), ("completion",), ()),  # positional-only: the name is free
    (_needs_answer, {"answer", "completion"}, (), (), ("completion",)),  # given by position and by keyword
    (_Scorer(), {"answer"}, (), (), ()),  # an object's __call__, without self
    (_Scorer(), {"answer", "x"}, (), ("x",), ()),
    (lambda *args, **row: 0.0, {"anything"}, (), (), ()),
]


@pytest.mark.parametrize(("fn", "fields", "missing", "unexpected", "repeated"), FIELD_CASES)
def test_field_mismatch_is_how_python_binds_the_call(fn, fields, missing, unexpected, repeated):
    """The check, from the signature alone, agrees with the call the run makes: ``fn(prompt, completion,
    **fields)`` raises a TypeError exactly when a mismatch is found, and the mismatch names the fields."""
    from yatt_lightning.rewards.fields import FieldMismatch, field_mismatch

    found = field_mismatch(fn, fields)
    expected = FieldMismatch(missing, unexpected, repeated) if missing or unexpected or repeated else None
    assert found == expected
    try:
        fn("p", "c", **dict.fromkeys(fields, "x"))
        binds = True
    except TypeError:
        binds = False
    assert binds == (found is None)


def test_rule_reward_and_judge_name_the_field_and_the_fix(tmp_path, monkeypatch):
    from yatt_lightning.rewards import GenerativeRewardModel
    from yatt_lightning.rewards.base import drawn_fields

    (tmp_path / "field_rewards.py").write_text("def score(prompt, completion, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rule = RuleReward("field_rewards.score")
    assert rule.row_problem(frozenset({"answer"})) is None
    assert re.search(r"^reward function field_rewards\.score\(prompt, completion, answer\) needs the row field "
                     r"'answer', which this row lacks \(its fields: text\); add 'answer' to every row, or give the "
                     r"parameter a default \(answer=None\)\.$", rule.row_problem(frozenset({"text"})))  # fmt: skip
    named = RuleReward("field_rewards.score", name="exact")
    assert re.search(r"^reward function exact = field_rewards\.score\(.*\) does not take the row field 'level'; .*"
                     r"add \*\*row to its parameters", named.row_problem(frozenset({"answer", "level"})))  # fmt: skip
    judge = GenerativeRewardModel("builtin:tiny-qwen2", template="{prompt}: {completion} vs {answer}")
    assert judge.row_problem(frozenset({"answer"})) is None
    assert re.search(r"`template` of judge judge names \{answer\}, which this row lacks .*take \{answer\} out",
                     judge.row_problem(frozenset()))  # fmt: skip
    # an error shows the parameters' names (what a field must match), without annotations
    from yatt_lightning.rewards.fields import signature_of

    assert signature_of(alphabet_reward) == "yatt_lightning.rewards.rules.alphabet_reward(prompt, completion, answer, **row)"
    assert signature_of(_Scorer()) == "tests.test_rewards._Scorer(prompt, completion, answer)"
    # what reaches a function: public fields, not the prompt, and a row of images' decoded images
    assert drawn_fields({"prompt": "p", "messages": [], "answer": "a", "_source": "f:1", "_images": [None]}) == {
        "messages", "answer", "images"}  # fmt: skip
