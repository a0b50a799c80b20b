"""Stages other than RL on the same strategy, policy, checkpoints and CLI: SFT, DPO, on-policy distillation.

Tier 1: the preference losses' arithmetic, how rows become token ids and loss masks, bad rows and teachers.
Tier 2: SFT and DPO under TP=2, PP=2 and DP=2 reach one process's losses and weights. Tier 3: a killed SFT
run resumes bitwise and its export gives the policy's logits in transformers. SFT -> GRPO, DPO's held-out
accuracy and distillation's learning: bench/stages.py (its smoke size in tests/test_benches.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, SCRIPTS, read_scalars, yatt, yatt_in_process
from tests.user_models import build
from yatt_lightning.stages import DPOModule, IPOLoss, SFTModule, SigmoidLoss
from yatt_lightning.stages.preference import PairLogprobs


# ------------------------------------------------------------------------------------------------ tier 1
def test_preference_losses_follow_their_formulas():
    lp = PairLogprobs(
        chosen=torch.tensor([-4.0, -6.0]), rejected=torch.tensor([-5.0, -5.0]),
        ref_chosen=torch.tensor([-4.5, -5.0]), ref_rejected=torch.tensor([-4.0, -5.5]),
        chosen_tokens=torch.tensor([2.0, 4.0]), rejected_tokens=torch.tensor([1.0, 5.0]),
    )  # fmt: skip
    beta = 0.5
    loss, chosen, rejected = SigmoidLoss(beta=beta)(lp)
    # pair 0: chosen log-ratio +0.5, rejected -1.0 -> margin beta * 1.5; pair 1: -1.0 and +0.5 -> beta * -1.5
    assert chosen.tolist() == pytest.approx([0.25, -0.5]) and rejected.tolist() == pytest.approx([-0.5, 0.25])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert loss.tolist() == pytest.approx([-math.log(sig(0.75)), -math.log(sig(-0.75))])
    smoothed, _, _ = SigmoidLoss(beta=beta, label_smoothing=0.1)(lp)
    assert smoothed[0].item() == pytest.approx(-0.9 * math.log(sig(0.75)) - 0.1 * math.log(sig(-0.75)))
    ipo, _, _ = IPOLoss(beta=beta)(lp)
    # per-token log-ratios: pair 0: 0.5 / 2 - (-1.0) / 1 = 1.25; pair 1: -1.0 / 4 - 0.5 / 5 = -0.35; target 1/(2 beta) = 1
    assert ipo.tolist() == pytest.approx([(1.25 - 1.0) ** 2, (-0.35 - 1.0) ** 2])
    with pytest.raises(ValueError, match=r"beta` must be > 0"):
        SigmoidLoss(beta=0.0)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    return build("qwen2", tmp_path_factory.mktemp("chat") / "qwen2")  # a ChatML template


def _stage(cls, folder: Path, **kwargs):
    stage = cls(**kwargs)
    stage.configure_tokens(folder)
    return stage


def test_chat_rows_learn_the_assistant_turns_only(chat_folder):
    sft = _stage(SFTModule, chat_folder, max_seq_tokens=200)
    messages = [
        {"role": "user", "content": "after c"}, {"role": "assistant", "content": "d e"},
        {"role": "user", "content": "and then"}, {"role": "assistant", "content": "f g"},
    ]  # fmt: skip
    (seq,) = sft.sequences([{"messages": messages, "_source": "chat.jsonl:1"}])
    tok = sft.tokenizer
    assert tok.decode(seq.prompt_ids) == "<|im_start|>user\nafter c<|im_end|>\n<|im_start|>assistant\n"
    learnt = [t for t, m in zip(seq.completion_ids, seq.mask, strict=True) if m]
    skipped = [t for t, m in zip(seq.completion_ids, seq.mask, strict=True) if not m]
    assert tok.decode(learnt) == "d e<|im_end|>\nf g<|im_end|>\n"
    assert tok.decode(skipped) == "<|im_start|>user\nand then<|im_end|>\n<|im_start|>assistant\n"
    # A prompt-completion row: the completion, then the template's end of the assistant turn.
    (plain,) = sft.sequences([{"prompt": "after c", "completion": "d e"}])
    assert tok.decode(plain.completion_ids) == "d e<|im_end|>\n" and plain.mask is None


def test_bad_rows_are_refused_naming_the_row(chat_folder, tiny_model_path):
    sft = _stage(SFTModule, chat_folder, max_seq_tokens=200)
    with pytest.raises(ValueError, match=r"chat.jsonl:3: the chat row has no assistant turn after a prompt"):
        sft.sequences([{"messages": [{"role": "user", "content": "hi"}], "_source": "chat.jsonl:3"}])
    plain = _stage(SFTModule, tiny_model_path, target="answer", max_seq_tokens=200)
    with pytest.raises(ValueError, match=r"p.jsonl:2: a chat row without a completion field needs a chat template"):
        plain.sequences([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                          "_source": "p.jsonl:2"}])  # fmt: skip
    with pytest.raises(ValueError, match=r"p.jsonl:4: it has neither the field 'answer' nor chat `messages`"):
        plain.sequences([{"prompt": "after a", "_source": "p.jsonl:4"}])
    dpo = _stage(DPOModule, tiny_model_path, max_seq_tokens=200)
    with pytest.raises(
        ValueError, match=r"pairs.jsonl:7: a preference row needs `chosen` and `rejected` .*\['chosen', 'prompt'\]"
    ):
        dpo.sequences([{"prompt": "after a", "chosen": "b", "_source": "pairs.jsonl:7"}])
    long = {"prompt": "after a", "answer": "b c d e f g h i j k l m", "_source": "p.jsonl:9"}
    refuse = _stage(SFTModule, tiny_model_path, target="answer", max_seq_tokens=8, on_overlong="refuse")
    with pytest.raises(
        ValueError, match=r"p.jsonl:9: \d+ tokens, more than `model.max_seq_tokens`=8; .*on_overlong: cut"
    ):
        refuse.sequences([long])
    cut = _stage(SFTModule, tiny_model_path, target="answer", max_seq_tokens=8)
    (seq,) = cut.sequences([long])
    assert len(seq.prompt_ids) + len(seq.completion_ids) == 8 and cut.cut == 1


def test_a_teacher_of_another_vocabulary_is_refused_before_start(tmp_path, chat_folder, tiny_model_path):
    """`yatt fit` of a distillation config whose teacher has another tokenizer stops before any engine starts,
    naming both vocabularies' sizes."""
    from yatt_lightning.rewards.teacher import TeacherKL

    with pytest.raises(ValueError, match=r"different vocabularies \(320 and \d+ entries\)"):
        TeacherKL(teacher=str(chat_folder)).check_student(tiny_model_path)
    config = (
        (REPO / "configs" / "distill_tiny.yaml")
        .read_text()
        .replace("teacher: builtin:tiny-qwen2-sft\n", f"teacher: {chat_folder}\n")
    )
    (tmp_path / "distill.yaml").write_text(config)
    code, err = yatt_in_process(["fit", "--config", "distill.yaml"], cwd=tmp_path)
    assert code == 2 and "different vocabularies" in err and len(err.strip().splitlines()) <= 10, err


# ------------------------------------------------------------------------------------------------ tier 2
CONFIGS = {"sft": REPO / "configs" / "sft_tiny.yaml", "dpo": REPO / "configs" / "dpo_tiny.yaml"}
LAYOUTS = {
    "tp2": ["--trainer.strategy.tensor_model_parallel_size", "2"],
    "pp2": ["--trainer.strategy.pipeline_model_parallel_size", "2"],
    "dp2": ["--data.init_args.batch_size", "16"],  # 32 rows per step in every layout
}


def _stage_run(out: Path, stage: str, *args: str, expect_kill: bool = False) -> str:
    """tests/scripts/stage_run.py in its own process group (it may SIGKILL the group)."""
    cmd = [sys.executable, str(SCRIPTS / "stage_run.py"), str(out), str(CONFIGS[stage]), *args]
    proc = subprocess.run(cmd, cwd=out.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                          text=True, timeout=300, start_new_session=True)  # fmt: skip
    killed = proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
    assert killed == expect_kill and (killed or proc.returncode == 0), f"exit {proc.returncode}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final.safetensors"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("stage, layouts", [("sft", ["dp2", "pp2"]), ("dpo", ["dp2", "tp2"])])
def test_stage_layouts_reach_one_process_losses_and_weights(stage, layouts, tmp_path):
    """3 steps of configs/sft_tiny.yaml and configs/dpo_tiny.yaml (their held-out figures before training
    included) under DP=2 and PP=2 (SFT) or TP=2 (DPO) give one process's losses and, to Adam's float noise, its
    weights: the loss is averaged per token (SFT) or per pair (DPO) over the whole global batch. (The stages
    share their micro-batches and figures' reduction, so each layout runs under one of them; the policy under
    every layout: tests/test_parallel.py.)"""
    common = ["--trainer.max_steps", "3", "--trainer.callbacks", "[]"]
    _stage_run(tmp_path / "one", stage, *common)
    base_w, base_s = _weights(tmp_path / "one"), read_scalars(tmp_path / "one" / "tb")
    tags = ["sft/loss", "sft/grad_norm", "sft/val_loss"] if stage == "sft" else [
        "dpo/loss", "dpo/accuracy", "dpo/reward_margin", "dpo/chosen_logprob", "dpo/grad_norm", "dpo/val_loss"]  # fmt: skip
    for name in layouts:
        layout = LAYOUTS[name]
        _stage_run(tmp_path / name, stage, *common, "--trainer.devices", "2", *layout)
        w, s = _weights(tmp_path / name), read_scalars(tmp_path / name / "tb")
        assert w.keys() == base_w.keys()
        worst = max((w[k] - base_w[k]).abs().max().item() for k in w)
        assert worst < 1e-4, f"{stage} {name}: weights differ from one process by {worst}"
        for tag in tags:
            ours, ref = [v for _, v in s[tag]], [v for _, v in base_s[tag]]
            assert len(ours) == len(ref) >= 1
            assert ours == pytest.approx(ref, rel=1e-5, abs=1e-5), (stage, name, tag, ours, ref)


# ------------------------------------------------------------------------------------------------ tier 3
@pytest.mark.slow
def test_a_killed_sft_run_resumes_bitwise_and_its_export_gives_the_policy_logits(tmp_path):
    """SFT saved every 2 steps and SIGKILLed after step 5 resumes from its last checkpoint to the weights of a
    run never interrupted, bit for bit; `yatt export` of that run gives the Megatron policy's logits in
    transformers (vLLM loading an SFT export: bench/stages.py, whose GRPO starts from one)."""

    def args(out: Path) -> list[str]:
        init = {"every_n_steps": 2, "dirpath": str(out / "ckpts")}
        saver = json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint", "init_args": init}])
        return ["--trainer.max_steps", "6", "--data.init_args.val_task", "null", "--trainer.callbacks", saver]

    full, killed = tmp_path / "full", tmp_path / "killed"
    _stage_run(full, "sft", *args(full))
    log = _stage_run(killed, "sft", "--kill-after", "5", *args(killed), expect_kill=True)
    assert "FAULT: SIGKILL after step 5" in log
    log = _stage_run(killed, "sft", *args(killed), "--ckpt_path", "last")
    assert "resuming from" in log, log[-2000:]
    a, b = _weights(full), _weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    yatt(["export", "--ckpt_dir", str(full / "ckpts"), "--out", str(tmp_path / "hf")], cwd=tmp_path)
    from transformers import AutoModelForCausalLM

    probe = torch.load(full / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        logits = model(probe["ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_sft_on_image_rows_learns_what_only_the_image_tells(tmp_path):
    """configs/sft_vlm_tiny.yaml (the tiny LLaVA-layout model, the colour task's image rows): the answer's loss
    falls below what a model blind to the image can reach (ln 4 on the colour token, 0 on the end token: a
    mean of 0.69 per token), so the pixels reach the policy through the stage's micro-batches."""
    yatt(["fit", "--config", str(REPO / "configs" / "sft_vlm_tiny.yaml"), "--trainer.callbacks", "[]",
          "--trainer.default_root_dir", str(tmp_path)], cwd=tmp_path)  # fmt: skip
    loss = [v for _, v in read_scalars(tmp_path)["sft/loss"]]
    assert len(loss) == 40 and loss[0] > 3 and max(loss[-5:]) < math.log(4) / 2 / 2, loss


def test_the_teacher_scores_each_token_with_minus_the_reverse_kl(tiny_model_path):
    """TeacherKL's teacher logprobs (batched, right-padded) equal one sequence at a time through transformers;
    the per-token reward is -coef * (student - teacher); REINFORCE++ with gamma 0 keeps each token's own."""
    from transformers import AutoModelForCausalLM

    from yatt_lightning.algorithms import ReinforcePlusPlus
    from yatt_lightning.algorithms.advantage import AdvantageInputs
    from yatt_lightning.rewards.teacher import TeacherKL
    from yatt_lightning.rollout.batch import RolloutBatch

    teacher = TeacherKL(teacher=str(tiny_model_path), coef=2.0, batch_size=2)
    prompts, completions = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21], [22, 23, 24, 25], [26]]
    got = teacher.teacher_logprobs(prompts, completions)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for p, c, lp in zip(prompts, completions, got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0]
        want = torch.log_softmax(logits[len(p) - 1 : -1], -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)
    batch = RolloutBatch(
        prompts=["a"] * 3, prompt_ids=prompts, completion_ids=completions, completions=["x"] * 3, rows=[{}] * 3,
        group_ids=torch.tensor([0, 0, 1]), rollout_logprobs=[lp + 0.5 for lp in got], finish_reasons=["stop"] * 3,
    )  # fmt: skip
    out = teacher.rollout_scores(batch)
    assert out.scores == [0.0] * 3 and out.metrics["reward/teacher_kl/kl/sum"] == pytest.approx(1.5)
    assert [r for rs in out.token_rewards for r in rs] == pytest.approx([-1.0] * 7)
    tokens = [torch.tensor([1.0, -2.0]), torch.tensor([3.0])]
    adv = ReinforcePlusPlus(gamma=0.0)(AdvantageInputs(torch.zeros(2), torch.tensor([0, 1]), [2, 1], tokens))
    flat = torch.cat(adv.tokens)  # whitened over the three tokens, each from its own reward only
    assert torch.allclose(
        flat, (torch.tensor([1.0, -2.0, 3.0]) - 2 / 3) / torch.tensor([1.0, -2.0, 3.0]).std(unbiased=False), atol=1e-5
    )


def test_micro_batches_by_token_budget_hold_whole_sequences_within_it(tiny_model_path):
    sft = _stage(
        SFTModule, tiny_model_path, target="answer", target_prefix=" ", micro_batch_tokens=64, max_seq_tokens=32
    )
    rows = [{"prompt": "after a", "answer": " ".join("bcdefghijklmnop"[: 1 + k % 12])} for k in range(24)]
    mbs = sft.batch_microbatches(rows)  # what a training step runs
    assert sorted(i for mb in mbs for i in mb.sample_index.tolist()) == list(range(24))
    assert all(mb.input_ids.numel() <= 64 for mb in mbs) and len(mbs) > 1


def test_a_preference_file_row_without_rejected_stops_the_cli_before_start(tmp_path):
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "after a", "chosen": "b", "rejected": "c"}\n'
                                          '{"prompt": "after b", "chosen": "c"}\n' * 40)  # fmt: skip
    code, err = yatt_in_process(["fit", "--config", str(CONFIGS["dpo"]), "--data.init_args.task", "null",
                                 "--data.init_args.path", "pairs.jsonl"], cwd=tmp_path)  # fmt: skip
    assert code == 2 and "pairs.jsonl:2: a preference row needs `chosen` and `rejected`" in err, err
    assert len(err.strip().splitlines()) <= 10, err
