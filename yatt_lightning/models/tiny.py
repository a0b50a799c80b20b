"""The built-in tiny model: a random-initialised Qwen2-style model and a locally trained tokenizer.

Nothing is downloaded. The model is written as an ordinary Hugging Face folder (``config.json``,
``model.safetensors``, ``tokenizer.json``) and from then on is loaded exactly like a user's
checkpoint, so the default config exercises the real loading path.

Sizes respect what the stack needs: vLLM on CPU supports head sizes 32, 64, 80, ...; tensor
parallelism needs the number of query and key/value heads divisible by the TP size; pipeline
parallelism needs the layers divisible by the PP size. The defaults (4 heads, 2 KV heads of 32, 2
layers) allow TP=2 and PP=2.
"""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path
from typing import Any

from yatt_lightning.models.build_cache import build_once, cache_dir, save_pretrained

# The text the built-in models' tokenizers learn: the built-in tasks' words (datamodules/tasks.py), each one
# token (tests/test_data.py checks that every task word is here).
ALPHABET_CORPUS = ("after comes", " ".join(string.ascii_lowercase * 2), " ".join(string.digits), ". , : ? ! - + =")
COLOUR_CORPUS = ("colour: blue green red yellow", *ALPHABET_CORPUS)  # the tiny VLM's (the colour task)

TINY_QWEN2 = "builtin:tiny-qwen2"

# One place for the tiny model's shape; changing it changes the cache key.
TINY_QWEN2_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 320,
}
# A larger sibling (about 18M parameters) for benchmarks where the model's size matters (checkpoint I/O).
SMALL_QWEN2 = "builtin:small-qwen2"
SMALL_QWEN2_SHAPE = {
    **TINY_QWEN2_SHAPE,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
# The model of configs/grpo_small.yaml and bench/step_efficiency.py (about 13M parameters): big enough
# that generation and training compute, not the framework's fixed costs, should fill a step.
SMALL4_QWEN2 = "builtin:small4-qwen2"
SMALL4_QWEN2_SHAPE = {**SMALL_QWEN2_SHAPE, "num_hidden_layers": 4}
BUILTIN_SHAPES = {TINY_QWEN2: TINY_QWEN2_SHAPE, SMALL_QWEN2: SMALL_QWEN2_SHAPE, SMALL4_QWEN2: SMALL4_QWEN2_SHAPE}
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]


def build_tiny_qwen2(seed: int = 1234, shape: dict | None = None) -> Path:
    """Build (once) and return the folder of a random-initialised Qwen2-style model of ``shape`` (default:
    the tiny one) with the locally trained tokenizer; safe under concurrent ranks."""
    shape = TINY_QWEN2_SHAPE if shape is None else shape
    key = hashlib.sha256(json.dumps([shape, SPECIAL_TOKENS, seed, list(ALPHABET_CORPUS)]).encode())
    out = cache_dir() / f"{'tiny-' if shape == TINY_QWEN2_SHAPE else ''}qwen2-{key.hexdigest()[:12]}"
    return build_once(out, lambda tmp: _write_tiny_qwen2(tmp, seed, ALPHABET_CORPUS, shape))


def train_tokenizer(corpus, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` with Qwen2's pre-tokenizer, normalizer and decoder.

    transformers loads every ``qwen2`` model's tokenizer as ``Qwen2Tokenizer``, which rebuilds that
    pipeline around the saved vocabulary and merges; training the same pipeline keeps the two identical.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size={vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def _write_tiny_qwen2(folder: Path, seed: int, corpus, shape: dict) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    write_tiny(folder, seed, corpus, shape, Qwen2Config, Qwen2ForCausalLM)


def write_tiny(folder: Path, seed: int, corpus, shape: dict, config_class, model_class, **extra) -> None:
    """A random-initialised ``model_class`` of ``shape`` (``extra``: config arguments added or replaced) and the tokenizer
    trained on ``corpus``, written into ``folder`` as ``save_pretrained`` writes them."""
    import torch

    shape = dict(shape)
    tokenizer = train_tokenizer(corpus, shape["vocab_size"])
    rope_theta = shape.pop("rope_theta")
    config = config_class(
        **{**shape, **extra},
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_class(config)
    save_pretrained(model, folder)
    tokenizer.save_pretrained(folder)
