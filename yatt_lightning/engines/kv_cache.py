"""The size of a rollout engine's KV cache on CPU, where vLLM has no memory profiler to size it."""

from __future__ import annotations

import math
from pathlib import Path


def kv_cache_bytes_for(model_path: Path, max_num_seqs: int, max_model_len: int, tp: int) -> int:
    """KV cache bytes for ``max_num_seqs`` sequences of ``max_model_len`` tokens, +25%, rounded to MiB."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    cfg = getattr(cfg, "text_config", cfg)  # a vision-language model's cache is its language model's
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = max(1, (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // tp)
    dtype_bytes = 2 if str(getattr(cfg, "dtype", None) or "float32") in ("bfloat16", "float16", "torch.bfloat16") else 4
    block = 128  # round every sequence up to whole blocks (vLLM's CPU block size)
    tokens = max_num_seqs * math.ceil(max_model_len / block) * block
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    return max(4 << 20, math.ceil(tokens * per_token * 1.25 / (1 << 20)) << 20)
