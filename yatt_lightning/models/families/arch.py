"""The architecture facts a family reads from a Hugging Face config (:class:`HFArch`): plain, hashable values
that every part below takes (the Megatron builder, the weight table, the checks of the layout)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoEArch:
    """A mixture-of-experts MLP: ``num_experts`` SwiGLU experts of ``expert_size``, ``top_k`` of them per
    token by a linear router; ``normalize_top_k`` renormalises the chosen experts' softmax probabilities to
    sum to one (Qwen3-MoE's ``norm_topk_prob``); ``moe_layers[i]``: layer ``i`` is a mixture (the others are
    dense MLPs of the arch's ``intermediate_size``); ``aux_loss_coef``: the load-balancing loss's weight."""

    num_experts: int
    top_k: int
    expert_size: int
    normalize_top_k: bool
    moe_layers: tuple[bool, ...]
    aux_loss_coef: float


@dataclass(frozen=True)
class HFArch:
    """The architecture facts read from a Hugging Face config by its family, validated once."""

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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's query and key
    # Scaled RoPE (Llama 3.x `llama3`, `linear`): the inverse frequencies transformers computes for the config;
    # None: the default ones of `rope_theta`.
    rope_inv_freq: tuple[float, ...] | None = None
    # Sliding-window attention: a token sees itself and the `sliding_window - 1` before it, on the layers
    # marked in `window_layers` (all when empty).
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] = field(default=())
    moe: MoEArch | None = None
    # Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): the rotary channel pairs given to the temporal, height and width
    # positions, in that order (`rope_parameters.mrope_section`); None: one position per token.
    mrope_section: tuple[int, ...] | None = None

    def check_parallel(self, tp: int, pp: int, ep: int = 1) -> None:
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
        if ep > 1 and self.moe is None:
            raise ValueError(
                f"`trainer.strategy.expert_model_parallel_size`={ep}: the model ({self.model_type}) has no experts; set it to 1."
            )
        if self.moe is not None and self.moe.num_experts % ep:
            raise ValueError(
                f"`trainer.strategy.expert_model_parallel_size`={ep} does not divide the model's "
                f"{self.moe.num_experts} experts (num_experts in config.json)."
            )

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.moe_layers[layer]
