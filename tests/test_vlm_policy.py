"""Tier 2 (one process, gloo): the LLaVA policy (HF vision tower + projector, Megatron GPT) against transformers."""

import pytest
import torch

from tests.test_policy import _logits_of, megatron_world  # noqa: F401 (a fixture)
from yatt_lightning.models.logprobs import token_logprobs
from yatt_lightning.models.vlm import published_name


@pytest.fixture(scope="module")
def llava_path():
    from yatt_lightning.models.tiny_llava import build_tiny_llava

    return build_tiny_llava()


def _inputs(path, colours):
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    images = [Image.new("RGB", (56, 56), c) for c in colours]
    enc = processor(text=["<image>\ncolour: red"] * len(images), images=images, return_tensors="pt")
    return enc["input_ids"], enc["pixel_values"]


def _policy(path):
    from yatt_lightning.models.optim import OptimizerSettings
    from yatt_lightning.models.policy import MegatronPolicy

    return MegatronPolicy(path, optimizer=OptimizerSettings(lr=1e-2, clip_grad=0.0))


def test_llava_logits_match_transformers_and_depend_on_the_image(megatron_world, llava_path):  # noqa: F811
    from transformers import LlavaForConditionalGeneration

    ids, pixels = _inputs(llava_path, [(220, 30, 30), (40, 60, 230)])
    hf = LlavaForConditionalGeneration.from_pretrained(llava_path, dtype=torch.float32).eval()
    assert (ids == hf.config.image_token_index).sum() == 2 * 16  # the processor wrote 16 placeholders per image
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels).logits
    policy = _policy(llava_path)
    ours = _logits_of_images(policy, ids, pixels)
    torch.testing.assert_close(ours, expected, atol=5e-5, rtol=1e-5)
    assert (ours[0, -1] - ours[1, -1]).abs().max() > 1e-3, "a red and a blue image must change the logits"


def _logits_of_images(policy, ids, pixels):
    out = []

    def keep(mb, logits):
        out.append(logits.detach())
        return torch.zeros(()), torch.tensor(1), {}

    policy.forward_backward([{"input_ids": ids, "pixel_values": pixels}], keep, forward_only=True)
    return out[0]


def test_llava_export_round_trips_and_training_moves_the_vision_tower(megatron_world, llava_path):  # noqa: F811
    from safetensors.torch import load_file

    policy = _policy(llava_path)
    exported = dict(policy.export_hf())
    # The built folder is as transformers 5.19 writes it (vision_tower.*); the export has vLLM's and the
    # published checkpoints' names: vision_tower.vision_model.*, language_model.*.
    original = {published_name(k): v for k, v in load_file(str(llava_path / "model.safetensors")).items()}
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    ids, pixels = _inputs(llava_path, [(220, 30, 30)])

    def loss_fn(mb, logits):
        lp = token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:])
        return -lp.sum(), torch.tensor(lp.numel(), dtype=torch.int), {}

    policy.zero_grad_buffers()
    policy.forward_backward([{"input_ids": ids, "pixel_values": pixels}], loss_fn, forward_only=False)
    applied, grad_norm = policy.optimizer_step(0)
    after = dict(policy.export_hf())
    assert applied and grad_norm > 0
    moved = {k for k in original if not torch.equal(original[k], after[k])}
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in moved
    assert "multi_modal_projector.linear_1.weight" in moved
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in moved
    unused = {k for k in original if "post_layernorm" in k}  # CLIP's pooled-output norm: LLaVA never reads it
    assert moved == set(original) - unused


def test_llava_loads_from_every_layout_transformers_writes(megatron_world, llava_path, tmp_path):  # noqa: F811
    """The same weights named as transformers 5.19's save_pretrained, transformers 4 (published), 4.52+ and
    5's modules name them: the policy holds the same tensors from each, and exports them under the
    published names."""
    from tests.user_models import LLAVA_LAYOUTS, relayout

    exports = [dict(_policy(relayout(llava_path, layout, tmp_path / str(i))).export_hf()) for i, layout in
               enumerate(LLAVA_LAYOUTS)]  # fmt: skip
    assert all(e.keys() == exports[0].keys() for e in exports)
    assert all(torch.equal(e[k], exports[0][k]) for e in exports for k in e)
    assert any(k.startswith("vision_tower.vision_model.") for k in exports[0])
