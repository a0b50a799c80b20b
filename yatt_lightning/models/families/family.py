"""What a model family is: how a Hugging Face config of one ``model_type`` becomes an
:class:`~yatt_lightning.models.families.arch.HFArch` (every refusal naming the config key) and the weight table that
names its tensors both ways. The Megatron config, the layer spec and the engine's needs follow from the arch
(:mod:`yatt_lightning.models.gpt`); a family that needs more overrides :meth:`DecoderFamily.arch`.

Adding a family is one file in this folder: a subclass of :class:`DecoderFamily` with its ``model_type``,
what its config says differently (a QKV bias, a QK-norm, experts, sliding windows) and its extra weight rows,
registered with :func:`~yatt_lightning.models.families.registry.register`, plus a small built-in or
``tests/user_models.py`` folder and its tests (see ``docs/architecture.md``).
"""

from __future__ import annotations

from yatt_lightning.models.families.arch import HFArch, MoEArch
from yatt_lightning.models.families.weights import WeightTable, dense_rows

KEY = "model.policy.path"
# Rotary scalings whose only effect is on the inverse frequencies (transformers' own values are used).
FREQUENCY_ONLY_ROPE = ("linear", "llama3")


class DecoderFamily:
    """A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP)."""

    model_type: str = ""
    qk_norm: bool = False

    def arch(self, cfg) -> HFArch:
        where = f"`{KEY}` ({self.model_type} config.json)"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported (only silu, SwiGLU).")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = rope["rope_theta"] if "rope_theta" in rope else getattr(cfg, "rope_theta", 10000.0)
        window, window_layers = self.sliding_window(cfg)
        return HFArch(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            qkv_bias=self.qkv_bias(cfg),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
            qk_norm=self.qk_norm,
            rope_inv_freq=self.rope_inv_freq(cfg, rope, where),
            sliding_window=window,
            window_layers=window_layers,
            moe=self.moe(cfg, where),
        )

    # ------------------------------------------------------------------ what families say differently
    def qkv_bias(self, cfg) -> bool:
        return bool(getattr(cfg, "attention_bias", False))

    def rope_inv_freq(self, cfg, rope: dict, where: str) -> tuple[float, ...] | None:
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            return None
        if rope_type not in FREQUENCY_ONLY_ROPE:
            raise ValueError(
                f"{where}: rope_parameters.rope_type {rope_type!r} is not supported yet; supported: default, "
                f"{', '.join(FREQUENCY_ONLY_ROPE)} (yarn, dynamic and longrope scale attention or change with the "
                "sequence length)."
            )
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
        if attention_factor != 1.0:
            raise ValueError(f"{where}: rope_parameters {rope} scale attention by {attention_factor}; not supported yet.")
        return tuple(float(f) for f in inv_freq)

    def sliding_window(self, cfg) -> tuple[int | None, tuple[bool, ...]]:
        """(window, the layers it applies to; empty: all): from ``layer_types`` where the config has them
        (Qwen2, Qwen3), else a ``sliding_window`` applies to every layer (Mistral)."""
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if types is not None:
            layers = tuple(t == "sliding_attention" for t in types)
            return (window, layers) if any(layers) and window is not None else (None, ())
        return window, ()

    def moe(self, cfg, where: str) -> MoEArch | None:
        return None

    def rows(self, arch: HFArch) -> list:
        return dense_rows(arch.qkv_bias)

    def weight_table(self, arch: HFArch) -> WeightTable:
        return WeightTable(self.rows(arch))
