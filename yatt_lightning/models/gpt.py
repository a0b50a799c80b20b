"""Build a Megatron-Core GPT from an architecture read off a Hugging Face config (:class:`HFArch`).

Which Hugging Face families map onto it, and how, is the business of the family unit
(:mod:`yatt_lightning.models.families`): each family reads its config into an :class:`HFArch` and names its
weights (:func:`~yatt_lightning.models.families.arch_of`). What the Megatron side needs is data in the arch: a Llama-style decoder block (RMSNorm, rotary
embeddings with optional scaling, grouped-query attention with optional QKV bias and per-head QK-norm,
optional sliding windows per layer, multimodal RoPE (M-RoPE), a SwiGLU MLP or a top-k mixture of SwiGLU experts), tied or untied
output embeddings. The model uses Megatron's local (non-Transformer-Engine) layer spec so the same code
runs on CPU and GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from yatt_lightning.models.families.arch import HFArch

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


def transformer_config(arch: HFArch, *, tp: int, pp: int, params_dtype: torch.dtype, ep: int = 1) -> TransformerConfig:
    from megatron.core.transformer import TransformerConfig  # noqa: F811 (imported for annotations above)

    extra = {}
    if arch.sliding_window is not None:  # (left, right): the token and the window - 1 before it
        extra["window_size"] = (arch.sliding_window - 1, 0)
        extra["window_attn_skip_freq"] = [int(w) for w in arch.window_layers] if arch.window_layers else None
    if arch.mrope_section is not None:
        extra["mrope_section"] = list(arch.mrope_section)
    if arch.moe is not None:
        moe = arch.moe
        extra.update(
            num_moe_experts=moe.num_experts,
            moe_router_topk=moe.top_k,
            moe_ffn_hidden_size=moe.expert_size,
            # topk of the logits then a softmax over them is the renormalised top-k of the softmax; without
            # renormalisation the softmax comes first
            moe_router_pre_softmax=not moe.normalize_top_k,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=moe.aux_loss_coef,
            moe_layer_freq=[int(m) for m in moe.moe_layers],
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
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
        qk_layernorm=arch.qk_norm,
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
        moe_token_dispatcher_type="alltoall",  # a dense model: only satisfies a check tied to variable_seq_lengths
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=False,
        **extra,
    )


def build_gpt(arch: HFArch, config, *, pre_process: bool, post_process: bool, tied: bool = True) -> torch.nn.Module:
    """The Megatron GPT model (one pipeline stage of it) for ``arch``; parameters uninitialised. ``tied``:
    share the embedding with the output layer when the checkpoint does (a critic has no output layer)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if arch.moe is not None:  # dense and mixture layers as moe_layer_freq says
        from yatt_lightning.models.cpu import moe_without_transformer_engine

        moe_without_transformer_engine()
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and tied,
        position_embedding_type="rope" if arch.mrope_section is None else "mrope",
        rotary_base=int(arch.rope_theta),
    )
    if arch.rope_inv_freq is not None:  # scaled RoPE: transformers' frequencies, exactly
        gpt.rotary_pos_emb.inv_freq = torch.tensor(arch.rope_inv_freq, dtype=torch.float32)
    return gpt
