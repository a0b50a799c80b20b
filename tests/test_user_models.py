"""Tier 3: models as users have them (tests/user_models.py: plain ``save_pretrained``, chat templates) through
`yatt fit`, the engine-vs-policy logprob check and `yatt export`."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from tests.helpers import REPO, read_scalars, run, run_script, yatt

pytestmark = pytest.mark.slow


def test_users_text_models_learn_match_the_engine_and_export(tmp_path):
    """A user's Qwen3 (QK-norm, tied, ChatML), Llama 3.1-style folder (llama3 rope scaling) and Qwen3-MoE (8
    experts, top 2; one process, every expert on it: tests/test_moe.py runs one at EP=2) each learn the alphabet
    task through `yatt fit` (last 10 steps' mean reward at least 0.4 above the first 10's; the dense ones measured
    0.03 -> 0.51 at 60 steps); Qwen2, Llama with tied embeddings (and a system prompt) and Mistral with a window of
    8 tokens (shorter than its prompts) train 6 steps. On every step of every run the engine's logprobs of the
    sampled tokens equal the policy's (< 1e-3: a tied output layer the engine failed to reload would be 0.1-0.2
    off, a window one side ignored about as much), the prompt the engine sampled from is the tokenizer's own
    ``apply_chat_template`` ids, and the export loads in transformers with every tensor the trained one (a tied
    model stays tied)."""
    result = run_script("user_models_fit.py", str(tmp_path), "qwen3=60", "llama3=60", "qwen3-moe=60", "qwen2=6",
                        "llama-tied=6", "mistral-window=6", timeout=900)  # fmt: skip
    chatml, user = "<|im_start|>user\nafter ", "<|begin_of_text|>USER: after "
    marks = {"qwen3": chatml, "llama3": user, "qwen3-moe": chatml, "qwen2": chatml, "mistral-window": chatml,
             "llama-tied": "<|begin_of_text|>You are a helpful assistant.\nUSER: after "}  # fmt: skip
    for family, r in result.items():
        assert r["prompt_ids"] == r["tokenizer_ids"], family
        assert r["prompt_text"].startswith(marks[family]), (family, r["prompt_text"])
        assert max(r["logprob_diff_max"]) < 1e-3, (family, r["logprob_diff_max"])
        assert not r["export_missing"] and not r["export_unexpected"], family
        assert r["moved"] == r["tensors"], f"{family}: {r['moved']} of {r['tensors']} exported tensors were trained"
        assert {"chat_template.jinja", "tokenizer.json", "tokenizer_config.json"} <= set(r["export_files"]), family
    assert [f for f, r in result.items() if r["export_tied"]] == ["qwen3", "llama-tied"]
    for family in ("qwen3", "llama3", "qwen3-moe"):
        rewards = result[family]["rewards"]
        first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
        assert len(rewards) == 60 and last >= first + 0.4, (family, first, last)


def test_a_llava_whose_template_prints_content_as_a_string_trains_through_yatt_fit_as_it_is(tmp_path):
    """A LLaVA folder with a community-style template (``{{ message['content'] }}``) and the colour task's rows,
    ``<image>`` in their prompt text: `yatt fit` starts (preflight renders each row as text with its image token)
    and trains, the engine's logprobs equal the policy's on every step."""
    from tests.user_models import build

    folder = build("llava-string", tmp_path / "llava")
    assert "message['content'] }}" in (folder / "chat_template.jinja").read_text()
    run([sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", str(REPO / "configs" / "grpo_vlm_tiny.yaml"),
         "--model.policy.path", str(folder), "--trainer.max_steps", "4", "--trainer.default_root_dir", str(tmp_path / "run"),
         "--trainer.callbacks", "[]"], cwd=tmp_path, timeout=400)  # fmt: skip
    scalars = read_scalars(tmp_path / "run")
    assert len(scalars["reward/mean"]) == 4 and max(v for _, v in scalars["rollout/logprob_diff_max"]) < 1e-3


def test_a_users_llava_folder_trains_on_images_through_yatt_fit_and_exports(tmp_path):
    """A LLaVA written by transformers 5.19's ``save_pretrained`` (vision tower as ``vision_tower.*``, which
    vLLM's loader does not name), with its own processor and llava-hf's chat template, and the user's data, the
    colour task as a Parquet file in verl's layout (geometry3k's columns: chat prompts with an ``<image>`` mark,
    ``datasets``' Image bytes, ``reward_model.ground_truth``): `yatt fit --model.policy.path --data.path` starts
    the engine, trains (engine and policy agree on every step; the images are read from the table), and `yatt
    export` writes a folder transformers loads whole, its tower, projector and language
    model the trained ones. The reward is the user's own (a file in the working directory): the colour's
    first letter first, which a random policy hits often enough for 8 steps to have gradients (the exact
    colour word, in 2 tokens, it rarely samples)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from tests.user_models import build
    from yatt_lightning.models.vlm import published_name

    folder = build("llava", tmp_path / "llava")
    assert any(k.startswith("vision_tower.embeddings.") for k in load_file(folder / "model.safetensors"))
    scalars = _fit_on_colour_table(tmp_path, folder, 8)
    assert len(scalars["reward/mean"]) == 8 and max(v for _, v in scalars["reward/mean"]) > 0
    assert max(v for _, v in scalars["rollout/logprob_diff_max"]) < 1e-3
    out = tmp_path / "hf"
    yatt(["export", "--ckpt_dir", str(tmp_path / "ckpts"), "--out", str(out)], cwd=tmp_path)
    model, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert AutoProcessor.from_pretrained(out).chat_template == AutoProcessor.from_pretrained(folder).chat_template
    exported = load_file(out / "model.safetensors")
    initial = {published_name(k): v for k, v in load_file(folder / "model.safetensors").items()}
    assert exported.keys() == initial.keys()
    moved = {k for k in initial if not torch.equal(exported[k], initial[k])}
    for name in ("vision_tower.vision_model.embeddings.patch_embedding.weight", "multi_modal_projector.linear_1.weight",
                 "language_model.model.layers.0.self_attn.q_proj.weight"):  # fmt: skip
        assert name in moved, name


def test_a_users_qwen2_5_vl_folder_trains_on_images_through_yatt_fit_and_exports(tmp_path):
    """Issue 43: a Qwen2.5-VL written by transformers 5.19's ``save_pretrained`` (published names: ``visual.*``,
    ``model.layers.*``), with Qwen's vision-marked ChatML and transformers' PIL image processor, trains on the
    colour task as a verl-layout Parquet file: images at their own resolution (the processor's grid says each
    image's tokens), M-RoPE positions, the engine's vision tower fed every push (engine and policy agree on
    every step, at a learning rate that moves the tower), and `yatt export` writes a folder transformers loads
    whole, its vision tower, merger and language model the trained ones."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.user_models import build

    folder = build("qwen2.5-vl", tmp_path / "qwen2.5-vl")
    scalars = _fit_on_colour_table(tmp_path, folder, 6, "--model.optimizer.lr", "0.01")
    assert len(scalars["reward/mean"]) == 6 and max(v for _, v in scalars["reward/mean"]) > 0
    assert max(v for _, v in scalars["rollout/logprob_diff_max"]) < 1e-3, scalars["rollout/logprob_diff_max"]
    out = tmp_path / "hf"
    yatt(["export", "--ckpt_dir", str(tmp_path / "ckpts"), "--out", str(out)], cwd=tmp_path)
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    exported, initial = load_file(out / "model.safetensors"), load_file(folder / "model.safetensors")
    assert exported.keys() == initial.keys()
    moved = {k for k in initial if not torch.equal(exported[k], initial[k])}
    for name in ("visual.patch_embed.proj.weight", "visual.merger.mlp.0.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert name in moved, name


def _fit_on_colour_table(tmp_path, folder, steps: int, *extra: str) -> dict:
    """`yatt fit` of the vision-language ``folder`` on the colour task as a verl-layout Parquet file, with the
    user's own reward (a file in the working directory: the colour's first letter first, which a random policy
    hits often enough for a few steps to have gradients) and a checkpoint at the end; its TensorBoard figures."""
    from tests.helpers import colour_task_in_verls_layout

    (tmp_path / "first_letter.py").write_text(
        "def score(prompt, completion, answer, **row):\n    return float(completion.strip()[:1] == answer[0])\n"
    )
    saver = [{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
              "init_args": {"every_n_steps": 1000, "dirpath": str(tmp_path / "ckpts")}}]  # fmt: skip
    table = colour_task_in_verls_layout(tmp_path / "colours.parquet")
    run([sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", str(REPO / "configs" / "grpo_vlm_tiny.yaml"),
         "--model.policy.path", str(folder), "--data.path", str(table), "--data.task", "null",
         "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(tmp_path / "run"),
         "--model.reward_fn", "first_letter.score", "--trainer.callbacks", json.dumps(saver), *extra], cwd=tmp_path,
        timeout=400)  # fmt: skip
    return read_scalars(tmp_path / "run")
