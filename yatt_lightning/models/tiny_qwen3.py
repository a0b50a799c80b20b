"""The built-in tiny Qwen3 models: a dense one (QK-norm, tied embeddings, as Qwen3's small models) and a
mixture of experts (8 experts of 64, top 2 renormalised, as Qwen3-30B-A3B routes), random-initialised, with
the tiny Qwen2's locally trained tokenizer (Qwen3 keeps Qwen2's tokenizer). Written as ordinary Hugging Face
folders, loaded like a user's. Head size 32 (vLLM on CPU), 4 query and 2 key/value heads, 2 layers: TP=2,
PP=2 and EP=2 (4 experts a rank) all divide them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from yatt_lightning.models.build_cache import build_once, cache_dir
from yatt_lightning.models.tiny import ALPHABET_CORPUS, SPECIAL_TOKENS, TINY_QWEN2_SHAPE, write_tiny

TINY_QWEN3 = "builtin:tiny-qwen3"
TINY_QWEN3_MOE = "builtin:tiny-qwen3-moe"
TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001}  # fmt: skip
# bench/moe.py's model (about 13M parameters, 12M of them experts): hidden 256, 4 layers, 8 experts of 512.
SMALL_QWEN3_MOE = "builtin:small-qwen3-moe"
SMALL_SHAPE = {**TINY_QWEN2_SHAPE, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
SMALL_MOE = {**TINY_MOE, "moe_intermediate_size": 512}
QWEN3_MODELS = (TINY_QWEN3, TINY_QWEN3_MOE, SMALL_QWEN3_MOE)


def build_tiny_qwen3(name: str = TINY_QWEN3, seed: int = 1234) -> Path:
    """Build (once) and return the folder of the built-in model ``name``; safe under concurrent ranks."""
    moe = {TINY_QWEN3_MOE: TINY_MOE, SMALL_QWEN3_MOE: SMALL_MOE}.get(name)
    shape = SMALL_SHAPE if name == SMALL_QWEN3_MOE else TINY_QWEN2_SHAPE
    corpus = list(ALPHABET_CORPUS)
    key = hashlib.sha256(json.dumps([shape, moe, SPECIAL_TOKENS, seed, corpus]).encode())
    out = cache_dir() / f"{name.removeprefix('builtin:')}-{key.hexdigest()[:12]}"
    return build_once(out, lambda tmp: _write(tmp, seed, corpus, shape, moe))


def _write(folder: Path, seed: int, corpus, shape: dict, moe: dict | None) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if moe is None:
        write_tiny(folder, seed, corpus, shape, Qwen3Config, Qwen3ForCausalLM, tie_word_embeddings=True)
    else:
        write_tiny(folder, seed, corpus, shape, Qwen3MoeConfig, Qwen3MoeForCausalLM, **moe)
