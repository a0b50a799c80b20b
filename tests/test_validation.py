"""Validation during RL: pass@k and the tally (pure), the held-out split, and a real run with and without it."""

import json
import math
import re
import sys

import pytest
import torch
from yatt_lightning.datamodules.prompt import PromptDataModule
from yatt_lightning.datamodules.tasks import AlphabetTask

from tests.helpers import REPO, read_scalars, run
from yatt_lightning.engines.base import SamplingConfig
from yatt_lightning.training.validation import Tally, Validation, pass_at_k


# ---------------------------------------------------------------------------------------------- pure
def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 1, 4) == 1.0  # every draw of 4 of 4 holds the correct one
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)
    # pass@1 is the share correct, whatever n
    assert all(pass_at_k(n, c, 1) == pytest.approx(c / n) for n in (1, 3, 8) for c in range(n + 1))


def test_the_tally_sums_ranks_and_sources_and_names_the_figures():
    v = Validation(n=4, correct_at=1.0)
    assert v.ks() == [1, 2, 4] and Validation(n=6).ks() == [1, 2, 4, 6] and Validation(n=1, temperature=0).ks() == [1]
    a, b = Tally(v.ks()), Tally(v.ks())
    a.add("gsm8k", [1.0, 0.0, 0.0, 0.0], [3, 5, 5, 7], 1.0)  # one of four correct
    b.add("gsm8k", [0.5, 0.5, 0.5, 0.5], [4, 4, 4, 4], 1.0)  # none correct
    b.add("math", [1.0, 1.0, 1.0, 1.0], [2, 2, 2, 2], 1.0)
    f = a.figures([a.sums, b.sums], 4)
    assert f["val/prompts"] == 3
    assert f["val/reward/mean"] == pytest.approx((1 + 2 + 4) / 12)
    assert f["val/mean@4"] == pytest.approx((0.25 + 0.5 + 1.0) / 3)
    assert f["val/pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert f["val/pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert f["val/response_length/mean"] == pytest.approx((20 + 16 + 8) / 12)
    assert f["val/reward/mean/gsm8k"] == pytest.approx(3 / 8) and f["val/reward/mean/math"] == 1.0
    assert f["val/pass@4/gsm8k"] == pytest.approx(0.5) and f["val/pass@4/math"] == 1.0
    one = Tally(v.ks())
    one.add("all", [0.0] * 4, [1] * 4, 1.0)
    assert not any("/all" in k for k in one.figures([one.sums], 4)), "one source: no per-source figures"
    assert a.figures([{}, {}], 4) == {}


def test_validation_settings_are_checked_naming_the_key_and_greedy_is_the_most_likely_token():
    for kwargs, key in ((dict(n=0), "n"), (dict(temperature=-1), "temperature"), (dict(temperature=0, n=4), "n"),
                        (dict(max_new_tokens=0), "max_new_tokens"), (dict(log_samples=-1), "log_samples")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"`model.validation.{key}`"):
            Validation(**kwargs)
    training = SamplingConfig(n=8, max_new_tokens=6, temperature=0.7)
    greedy = Validation(n=1, temperature=0).sampling(training)
    assert (greedy.n, greedy.top_k, greedy.max_new_tokens) == (1, 1, 6)
    sampled = Validation(n=4, temperature=1.0, max_new_tokens=9).sampling(training)
    assert (sampled.n, sampled.temperature, sampled.top_k, sampled.max_new_tokens) == (4, 1.0, -1, 9)
    seeds = Validation().seeds([{"_id": 0}, {"_id": 1}])
    assert seeds == Validation().seeds([{"_id": 0}, {"_id": 1}]) and seeds[0] != seeds[1]


def test_the_best_checkpoint_follows_its_figure_both_ways_and_resumes(tmp_path):
    from yatt_lightning.callbacks.best_checkpoint import BestCheckpoint

    best = BestCheckpoint("val/reward/mean", "max")
    assert [best.offer(v, s) for s, v in ((25, 0.3), (50, 0.5), (75, 0.4), (100, 0.5))] == [True, True, False, False]
    assert (best.step, best.value) == (50, 0.5)
    low = BestCheckpoint("val/response_length/mean", "min")
    assert [low.offer(v, s) for s, v in ((1, 9.0), (2, 4.0), (3, 6.0))] == [True, True, False] and low.step == 2
    folder = tmp_path / "step-00000050"
    best.saved(tmp_path / "step-00000025", 25)  # not the best: `best` is not written
    assert not (tmp_path / "best").exists()
    best.saved(folder, 50)
    assert (tmp_path / "best").read_text() == "step-00000050\n"
    again = BestCheckpoint("val/reward/mean", "max")
    again.load_state_dict(best.state_dict())
    assert not again.offer(0.45, 125) and again.offer(0.6, 150)
    for figure, mode, key in (("reward/mean", "max", "keep_best"), ("val/reward/mean", "up", "best_mode")):
        with pytest.raises(ValueError, match=f"`AsyncCheckpoint.{key}`"):
            BestCheckpoint(figure, mode)


def test_the_named_held_out_split_shares_no_prompt_with_training_and_is_refused_where_it_cannot_hold(tmp_path):
    data = PromptDataModule(val_task="alphabet_heldout")
    train = {r["prompt"] for r in data.load_rows()}
    held = data.load_rows(None, data.val_task)
    assert [r["prompt"] for r in held] == [f"after {c}" for c in "dhlptx"]  # each once
    assert len(train) == 20 and not train & {r["prompt"] for r in held}
    wider = PromptDataModule(task=AlphabetTask(context=4), val_task="alphabet_heldout")
    assert len(wider.load_rows(None, wider.val_task)) == 26
    assert not {r["prompt"] for r in wider.load_rows()} & {r["prompt"] for r in wider.load_rows(None, wider.val_task)}
    with pytest.raises(ValueError, match="`data.val_task`: unknown held-out set 'gsm8k'"):
        PromptDataModule(val_task="gsm8k")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "after d", "answer": "e f g h"}\n')
    with pytest.raises(ValueError, match="`data.val_task: alphabet_heldout`.*`data.path`"):
        PromptDataModule(path=str(rows), val_task="alphabet_heldout")


def test_validation_where_it_does_not_run_is_refused_before_start_naming_the_key(tmp_path):
    """In-process `yatt fit`, nothing starts: a held-out set with the disaggregated placement; a held-out row
    the reward cannot score (a field it requires is missing) is named before start as a training row is."""
    from tests.helpers import yatt_in_process

    base = ["fit", "--trainer.callbacks", "[]"]
    code, err = yatt_in_process([*base, "--config", str(REPO / "configs" / "grpo_async_tiny.yaml"),
                                 "--data.val_task", "alphabet_heldout"], cwd=tmp_path)  # fmt: skip
    assert code == 2 and "`data.val_task` with `trainer.strategy.placement: Disaggregated`" in err, err
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "after d"}\n')  # no answer, which the alphabet reward takes
    code, err = yatt_in_process([*base, "--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--data.val_path",
                                 str(held)], cwd=tmp_path)  # fmt: skip
    assert code == 2 and f"{held}:1" in err and "answer" in err, err


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_rl_validation_logs_before_and_during_training_rises_and_leaves_the_run_bitwise_as_it_was(tmp_path):
    """`configs/grpo_tiny.yaml` for 50 steps with `--data.val_task alphabet_heldout --trainer.val_check_interval
    25`: val/reward/mean, val/pass@4 and val/mean@4 at steps 0 (before training), 25 and 50; the held-out reward
    rises; no Lightning warning; the final weights equal those of the same run without validation, bit for bit;
    `yatt validate --ckpt_path` on the checkpoint of step 50 logs the figures the run logged at step 50; 2
    data-parallel ranks validate the untrained policy as one process does;
    AsyncCheckpoint's keep_best saves the best step's state, keeps it past keep_last and names it in `best`."""
    from safetensors.torch import load_file

    script = REPO / "tests" / "scripts" / "async_fit.py"
    common = ["--base", str(REPO / "configs" / "grpo_tiny.yaml"), "--trainer.max_steps=50",
              "--data.val_task=alphabet_heldout"]  # fmt: skip
    # keep_best with `min` (the lowest held-out reward: the one that is not the newest) saves step 25, which
    # keep_last 1 would delete at step 50's save
    saver = [{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
              "init_args": {"every_n_steps": 50, "keep_last": 1, "dirpath": str(tmp_path / "ckpts"),
                            "keep_best": "val/reward/mean", "best_mode": "min"}}]  # fmt: skip
    with_val = run([sys.executable, str(script), str(tmp_path / "val"), *common, "--trainer.val_check_interval=25",
                    "--trainer.callbacks", json.dumps(saver)], cwd=tmp_path, timeout=600)  # fmt: skip
    run([sys.executable, str(script), str(tmp_path / "plain"), *common, "--trainer.limit_val_batches=0"],
        cwd=tmp_path, timeout=600)  # fmt: skip
    # `yatt validate` on the checkpoint of step 50 gives the figures the run gave at step 50, at step 50
    run([sys.executable, "-m", "yatt_lightning.run.cli", "validate", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
         "--data.val_task", "alphabet_heldout", "--ckpt_path", str(tmp_path / "ckpts" / "step-00000050"),
         f"--trainer.logger.init_args.save_dir={tmp_path / 'validate'}"], cwd=tmp_path, timeout=600)  # fmt: skip
    terminal = with_val.stdout + with_val.stderr
    assert not re.search(r"(PossibleUserWarning|UserWarning).*(lightning|val_dataloader|validation)", terminal), terminal[-3000:]
    scalars = read_scalars(tmp_path / "val" / "tb")
    for key in ("val/reward/mean", "val/pass@4", "val/mean@4", "val/response_length/mean"):
        assert [s for s, _ in scalars[key]] == [0, 25, 50], (key, scalars[key])
    held = [v for _, v in scalars["val/reward/mean"]]
    assert held[-1] >= held[0] + 0.3, held  # measured 0.026 -> 0.521 (the answers' form, then some letters)
    assert "val/reward/mean" not in read_scalars(tmp_path / "plain" / "tb")
    assert (tmp_path / "ckpts" / "best").read_text() == "step-00000025\n"
    assert {p.name for p in (tmp_path / "ckpts").glob("step-*")} == {"step-00000025", "step-00000050"}
    # 2 data-parallel ranks (3 held-out prompts each) validate the untrained policy as one process does
    run([sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
         "--data.val_task", "alphabet_heldout", "--trainer.devices", "2", "--trainer.max_steps", "1",
         "--trainer.callbacks", "[]", f"--trainer.logger.init_args.save_dir={tmp_path / 'dp2'}"], cwd=tmp_path,
        timeout=600)  # fmt: skip
    dp2 = read_scalars(tmp_path / "dp2")
    assert [dp2[k][0] for k in ("val/reward/mean", "val/prompts")] == [scalars[k][0] for k in ("val/reward/mean", "val/prompts")]
    again = read_scalars(tmp_path / "validate")
    for key in ("val/reward/mean", "val/pass@4", "val/mean@4", "val/prompts"):
        assert again[key] == [scalars[key][-1]], (key, again[key], scalars[key])
    a, b = load_file(tmp_path / "val" / "weights.safetensors"), load_file(tmp_path / "plain" / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "validation changed the training"
