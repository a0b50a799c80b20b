"""Build a Megatron-Core GPT model from a Hugging Face Qwen2 / Llama configuration.

The mapping covers the dense decoder family that shares Llama's block: RMSNorm, rotary embeddings,
grouped-query attention (optional QKV bias, as in Qwen2), a SwiGLU MLP without biases, and tied or
untied output embeddings. The model uses Megatron's local (non-Transformer-Engine) layer spec so the
same code runs on CPU and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")
SUPPORTED_VISION_LANGUAGE_TYPES = ("llava",)


@dataclass(frozen=True)
class HFArch:
    """The architecture facts read from a Hugging Face config, validated once."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg) -> HFArch:
        """The language model's facts; for a vision-language model (LLaVA), those of its ``text_config``."""
        if hasattr(cfg, "vision_config"):
            if cfg.model_type not in SUPPORTED_VISION_LANGUAGE_TYPES:
                raise ValueError(
                    f"`model.policy.path`: vision-language model type {cfg.model_type!r} is not supported; "
                    f"supported: {', '.join(SUPPORTED_VISION_LANGUAGE_TYPES)} (a CLIP tower in front of a dense decoder)."
                )
            cfg = cfg.text_config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"`model.policy.path`: model type {cfg.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (Llama-style dense decoders)."
            )
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"`model.policy.path`: hidden_act {cfg.hidden_act!r} is not supported (only silu/SwiGLU).")
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type")
        if rope_type not in (None, "default"):
            raise ValueError(
                f"`model.policy.path`: rope scaling {rope_type!r} is not supported yet (only default RoPE)."
            )
        theta = rope["rope_theta"] if "rope_theta" in rope else getattr(cfg, "rope_theta", 10000.0)
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise a ValueError naming the strategy argument when the layout cannot split this model."""
        key = "trainer.strategy.tensor_model_parallel_size"
        if self.num_heads % tp:
            raise ValueError(f"`{key}`={tp} does not divide the model's {self.num_heads} attention heads.")
        if self.num_kv_heads % tp:
            raise ValueError(f"`{key}`={tp} does not divide the model's {self.num_kv_heads} key/value heads.")
        if self.vocab_size % tp:
            raise ValueError(f"`{key}`={tp} does not divide the vocabulary size {self.vocab_size}.")
        if self.intermediate_size % tp:
            raise ValueError(f"`{key}`={tp} does not divide the MLP size {self.intermediate_size}.")
        if self.num_layers % pp:
            raise ValueError(
                f"`trainer.strategy.pipeline_model_parallel_size`={pp} does not divide the model's {self.num_layers} layers."
            )


def transformer_config(arch: HFArch, *, tp: int, pp: int, params_dtype: torch.dtype) -> TransformerConfig:
    from megatron.core.transformer import TransformerConfig  # noqa: F811 (imported for annotations above)

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights come from the Hugging Face checkpoint
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # dense model; only satisfies a check tied to variable_seq_lengths
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=False,
    )


def build_gpt(arch: HFArch, config, *, pre_process: bool, post_process: bool, tied: bool = True) -> torch.nn.Module:
    """The Megatron GPT model (one pipeline stage of it) for ``arch``; parameters uninitialised. ``tied``:
    share the embedding with the output layer when the checkpoint does (a critic has no output layer)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and tied,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
