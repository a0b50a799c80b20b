"""Tier 3: the tiny VLM trained end to end on two data-parallel processes (real vLLM, Megatron, images)."""

import re
import sys

import pytest

from tests.helpers import REPO, run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_the_tiny_vlm_learns_to_look_on_two_processes_and_exports(tmp_path):
    """60 steps of the colour task at lr 2e-3 (faster than the config's 3e-4, which a 300-step run needs
    to end near 1.0): the reward rises from 0, and on held-out rows the trained policy does better with
    each row's own image than with the images shuffled among the rows (chance is 0.25 at most).

    Then `yatt export` of the run's last checkpoint: transformers loads every tensor of the folder (none
    missing, none left over), the vision tower and projector are the trained ones (not the initial
    weights), and the folder holds what vLLM needs: the built model's tensor names and files."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import LlavaForConditionalGeneration

    from tests.helpers import yatt
    from yatt_lightning.models.tiny_llava import build_tiny_llava
    from yatt_lightning.models.vlm import published_name

    saver = [{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
              "init_args": {"every_n_steps": 1000, "dirpath": str(tmp_path / "ckpts")}}]  # saves at the end
    proc = run(
        [sys.executable, str(REPO / "bench" / "vlm_learning.py"), "--steps", "60", "--rows", "64",
         "--trainer.devices", "2", "--model.optimizer.lr", "0.002", "--trainer.callbacks", json.dumps(saver)],
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(
        r"vlm_reward_first\d+=(\S+) vlm_reward_last\d+=(\S+) real_images=(\S+) shuffled_images=(\S+)", last
    )
    assert m, proc.stdout[-2000:]
    first, final, real, shuffled = map(float, m.groups())
    assert final > first + 0.2, last
    assert real > shuffled + 0.1, last

    out = tmp_path / "hf"
    yatt(["export", "--ckpt_dir", str(tmp_path / "ckpts"), "--out", str(out)], cwd=tmp_path)
    model, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    exported = load_file(out / "model.safetensors")
    initial = {published_name(k): v for k, v in load_file(build_tiny_llava() / "model.safetensors").items()}
    assert exported.keys() == initial.keys()  # the published (vLLM's) names; the built folder has 5.19's
    moved = {k for k in initial if not torch.equal(exported[k], initial[k])}
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in moved
    assert "multi_modal_projector.linear_2.weight" in moved and "language_model.lm_head.weight" in moved
    # The built model's files (its processor's too), which vLLM loads (tests/test_engine.py).
    assert {p.name for p in out.iterdir()} == {p.name for p in build_tiny_llava().iterdir() if p.name[0] != "."}
