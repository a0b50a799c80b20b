"""The built-in tiny vision-language model: a random-initialised LLaVA (CLIP ViT -> projector -> Qwen2).

Written as an ordinary Hugging Face LLaVA folder (config, safetensors, tokenizer with an ``<image>``
token, CLIP image processor), so it loads like a user's checkpoint, in transformers and in vLLM. Shape
from ../shared/CPU-STACK.md: 56 px images in 14 px patches (16 image tokens after dropping the class
token), a ViT of hidden 64 with 2 heads of 32, a 2-layer GELU projector, the tiny Qwen2 language model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from yatt_lightning.models.build_cache import build_once, cache_dir, save_pretrained
from yatt_lightning.models.tiny import COLOUR_CORPUS, SPECIAL_TOKENS, TINY_QWEN2_SHAPE, train_tokenizer

TINY_LLAVA = "builtin:tiny-llava"
IMAGE_TOKEN = "<image>"
TINY_LLAVA_VISION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 56,
    "patch_size": 14,
    "projection_dim": 64,
}
IMAGE_TOKENS = (TINY_LLAVA_VISION["image_size"] // TINY_LLAVA_VISION["patch_size"]) ** 2  # 16


def build_tiny_llava(seed: int = 1234) -> Path:
    """Build (once) and return the folder of the tiny LLaVA; safe under concurrent ranks."""
    corpus = list(COLOUR_CORPUS)
    key = hashlib.sha256(json.dumps([TINY_QWEN2_SHAPE, TINY_LLAVA_VISION, SPECIAL_TOKENS, seed, corpus]).encode())
    out = cache_dir() / f"tiny-llava-{key.hexdigest()[:12]}"
    return build_once(out, lambda tmp: _write(tmp, seed, corpus))


def _write(folder: Path, seed: int, corpus: list[str]) -> None:
    import torch
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava.processing_llava import LlavaProcessor

    shape = dict(TINY_QWEN2_SHAPE)
    tokenizer = train_tokenizer(corpus, shape["vocab_size"] - 1)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    rope_theta = shape.pop("rope_theta")
    text = Qwen2Config(
        **shape, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    vision = CLIPVisionConfig(**TINY_LLAVA_VISION, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id, image_seq_length=IMAGE_TOKENS,
        projector_hidden_act="gelu", vision_feature_select_strategy="default", vision_feature_layer=-1,
        tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    save_pretrained(model, folder)
    size = TINY_LLAVA_VISION["image_size"]
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=tokenizer, patch_size=TINY_LLAVA_VISION["patch_size"], vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
    )  # fmt: skip
    processor.save_pretrained(folder)
