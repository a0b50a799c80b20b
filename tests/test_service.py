"""Tier 2: the rollout service's parts through its types (real vLLM engines, no Trainer, no RLHFModule).

Long-tail policies, placements and controllers are called with a ``RolloutRequest`` and checked on the
``RolloutBatch`` / ``Generation`` / ``Scores`` they return (``tests/scripts/service_calls.py``).
"""

import pytest

from tests.helpers import run_script

pytestmark = pytest.mark.slow

N = 4  # samples per prompt in the script's requests


def _prompt_order(layout: dict, prompts: int) -> None:
    assert layout["groups"] == [g for g in range(prompts) for _ in range(N)]
    assert layout["aligned"], "prompts, rows, completions and engine logprobs must stay aligned"


def test_long_tail_policies_full_colocation_and_scores_through_the_service():
    out = run_script("service_calls.py", "one", timeout=400)["0"]
    wait = out["wait"]
    _prompt_order(wait, 6)
    assert wait["ids"] == [i for i in range(6) for _ in range(N)]
    assert out["wait_again"] == wait["completions"], "the same seeds must give the same samples"
    assert out["wait_metrics"] == {}  # waiting for all reports nothing of its own
    assert out["scores"] == pytest.approx(out["scores_expected"])  # one rule function of weight 1
    assert out["score_metrics"]["reward/alphabet/sum"] == pytest.approx(sum(out["scores_expected"]))
    assert out["full_generation"] == {"groups": [N] * 6, "judged": []}  # no judge: nothing judged while generating
    assert [c for g in out["controller"] for c in g] == wait["completions"]

    over = out["over"]  # 6 launched, the first 3 groups to finish kept, in prompt order
    assert out["over_metrics"] == {"long_tail/kept_groups": 3.0}
    kept_ids = sorted(set(over["ids"]))
    assert len(kept_ids) == 3 and set(kept_ids) <= set(range(6)) and over["aligned"]
    assert over["groups"] == over["ids"] == [i for i in kept_ids for _ in range(N)]  # group = prompt index
    by_id = {}
    for i, c in zip(wait["ids"], wait["completions"], strict=True):
        by_id.setdefault(i, []).append(c)
    for i in kept_ids:  # a kept group is what its seed gives, whatever else was launched with it
        assert [c for j, c in zip(over["ids"], over["completions"], strict=True) if j == i] == by_id[i]

    first, *later = out["partial"]  # 6-token answers, 4 tokens a round: nothing finishes in round one
    assert first == {"len": 0, "long_tail/carried_groups": 2.0, "long_tail/finished_groups": 0.0, "longest": 0}
    assert all(r["long_tail/finished_groups"] >= 1 and r["len"] == N * r["long_tail/finished_groups"] for r in later)
    assert all(r["longest"] <= 6 for r in later)


@pytest.mark.distributed
def test_parallel_and_single_controller_return_the_same_batch_and_scores():
    out = run_script("service_calls.py", "dp2", timeout=500)
    for rank in ("0", "1"):
        parallel, single = out[rank]["parallel"], out[rank]["single"]
        _prompt_order(parallel, 4)
        assert parallel["ids"] == [4 * int(rank) + i for i in range(4) for _ in range(N)]
        assert single == parallel, f"rank {rank}: the driver's batch or scores differ from the rank's own"
    assert out["0"]["parallel"]["completions"] != out["1"]["parallel"]["completions"]


@pytest.mark.distributed
def test_partial_colocation_judges_every_sample_while_generating():
    out = run_script("service_calls.py", "partial", timeout=500)
    for rank in ("0", "1"):
        r = out[rank]
        _prompt_order(r, 4)
        assert r["judged"] == ["judge"] and r["judged_count"] == 4 * N
        assert r["total"] == pytest.approx(r["expected"], abs=1e-6), "score() must use what was judged"
        assert r["idle_measured"], "the placement's figures come back in the batch"
