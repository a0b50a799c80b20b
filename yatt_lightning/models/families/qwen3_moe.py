"""Qwen3-MoE: Qwen3's attention (QK-norm) and a top-k mixture of SwiGLU experts: a linear router
(``mlp.gate``), a softmax over the experts, the top ``num_experts_per_tok`` renormalised when
``norm_topk_prob``; the load-balancing loss at ``router_aux_loss_coef``. Layers listed in ``mlp_only_layers``
(or off the ``decoder_sparse_step``) are dense MLPs of ``intermediate_size``."""

from yatt_lightning.models.families.arch import MoEArch
from yatt_lightning.models.families.family import DecoderFamily
from yatt_lightning.models.families.registry import register
from yatt_lightning.models.families.weights import MOE_ROWS, QK_NORM_ROWS


@register
class Qwen3MoE(DecoderFamily):
    model_type = "qwen3_moe"
    qk_norm = True

    def moe(self, cfg, where: str) -> MoEArch:
        experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
        if not 0 < top_k <= experts:
            raise ValueError(f"{where}: num_experts_per_tok {top_k} must be between 1 and num_experts ({experts}).")
        step, dense = getattr(cfg, "decoder_sparse_step", 1) or 1, set(getattr(cfg, "mlp_only_layers", []) or [])
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers))
        return MoEArch(
            num_experts=experts, top_k=top_k, expert_size=cfg.moe_intermediate_size,
            normalize_top_k=bool(cfg.norm_topk_prob), moe_layers=layers,
            aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
        )  # fmt: skip

    def rows(self, arch) -> list:
        return super().rows(arch) + QK_NORM_ROWS + MOE_ROWS
