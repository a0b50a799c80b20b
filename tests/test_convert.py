"""Tier 1: Hugging Face <-> Megatron weight layouts (fused QKV, gated MLP, TP shards)."""

import pytest
import torch

from yatt_lightning.models import convert
from yatt_lightning.models.families.arch import HFArch

ARCH = HFArch(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, qkv_bias=True, tie_word_embeddings=False,
    max_position_embeddings=64,
)  # fmt: skip


def test_qkv_layout_groups_queries_with_their_kv_head():
    """2 KV groups of 2 query heads each, head_dim 8: Megatron's rows are
    [q0 q1 k0 v0 | q2 q3 k1 v1], so group 0 holds query heads 0-1 and KV head 0."""
    hd = ARCH.head_dim
    q = torch.arange(4 * hd).float()[:, None].expand(-1, 3)
    k = 100 + torch.arange(2 * hd).float()[:, None].expand(-1, 3)
    v = 200 + torch.arange(2 * hd).float()[:, None].expand(-1, 3)
    fused = convert.merge_qkv(q, k, v, ARCH)
    assert fused[0:16, 0].tolist() == list(range(16))  # q heads 0,1
    assert fused[16:24, 0].tolist() == [100 + i for i in range(8)]  # k head 0
    assert fused[24:32, 0].tolist() == [200 + i for i in range(8)]  # v head 0
    assert fused[32:48, 0].tolist() == list(range(16, 32))  # q heads 2,3
    q2, k2, v2 = convert.split_qkv(fused, ARCH)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.1.self_attention.linear_qkv.bias",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
    ],
)
def test_shard_unshard_roundtrip(name, tp):
    full = torch.randn(96, 32) if "weight" in name and "norm" not in name else torch.randn(96)
    shards = [convert.shard(name, full, r, tp) for r in range(tp)]
    torch.testing.assert_close(convert.unshard(name, shards), full)


def test_gated_fc1_shards_split_gate_and_up_separately():
    gate, up = torch.zeros(4, 2), torch.ones(4, 2)
    full = torch.cat([gate, up])
    s0 = convert.shard("decoder.layers.0.mlp.linear_fc1.weight", full, 0, 2)
    assert s0[:2].eq(0).all() and s0[2:].eq(1).all()  # [gate_0; up_0], not [gate]


def test_hf_megatron_names_roundtrip():
    hf = {}
    for i in range(ARCH.num_layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = torch.randn(32)
        hf[p + "post_attention_layernorm.weight"] = torch.randn(32)
        for n, rows in (("q", 32), ("k", 16), ("v", 16)):
            hf[p + f"self_attn.{n}_proj.weight"] = torch.randn(rows, 32)
            hf[p + f"self_attn.{n}_proj.bias"] = torch.randn(rows)
        hf[p + "self_attn.o_proj.weight"] = torch.randn(32, 32)
        hf[p + "mlp.gate_proj.weight"] = torch.randn(48, 32)
        hf[p + "mlp.up_proj.weight"] = torch.randn(48, 32)
        hf[p + "mlp.down_proj.weight"] = torch.randn(32, 48)
    hf["model.embed_tokens.weight"] = torch.randn(64, 32)
    hf["model.norm.weight"] = torch.randn(32)
    hf["lm_head.weight"] = torch.randn(64, 32)
    meg_names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(ARCH.num_layers):
        meg_names += [
            f"decoder.layers.{i}.{s}"
            for s in (
                "input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
                "mlp.linear_fc2.weight",
            )
        ]  # fmt: skip
    back = {}
    for name in meg_names:
        full = convert.hf_to_megatron(name, hf.__getitem__, ARCH)
        back.update(dict(convert.megatron_to_hf(name, full, ARCH)))
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_pipeline_stage_layer_offset():
    got = convert.megatron_to_hf("decoder.layers.0.input_layernorm.weight", torch.ones(1), ARCH, layer_offset=1)
    assert got[0][0] == "model.layers.1.input_layernorm.weight"


def test_tied_embeddings_export_no_lm_head():
    tied = HFArch(**{**ARCH.__dict__, "tie_word_embeddings": True})
    assert convert.megatron_to_hf("output_layer.weight", torch.ones(2, 2), tied) == []


def test_arch_rejects_layouts_that_do_not_divide():
    with pytest.raises(ValueError, match="tensor_model_parallel_size`=3 does not divide the model's 4 attention heads"):
        ARCH.check_parallel(3, 1)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size`=4 does not divide the model's 2 layers"):
        ARCH.check_parallel(1, 4)
