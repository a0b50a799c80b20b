"""Tier 1: the model-family unit: the registry, each family's reading of a Hugging Face config (refusals
naming the key), the weight table both ways (experts included), the expert-parallel layout checks."""

from __future__ import annotations

import pytest
import torch

from yatt_lightning.models import families
from yatt_lightning.models.families import arch_of, registered, weight_table
from yatt_lightning.models.families.family import DecoderFamily

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=128, max_position_embeddings=128)  # fmt: skip


def _config(model_type: str, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**SHAPE, **kw})


def test_every_family_is_registered_once_and_a_second_registration_is_refused():
    assert {"qwen2", "llama", "mistral", "qwen3", "qwen3_moe", "llava", "qwen2_5_vl"} <= set(registered())

    class Again(DecoderFamily):
        model_type = "qwen3"

    with pytest.raises(ValueError, match="model type 'qwen3' is registered twice: Qwen3 and Again"):
        families.register(Again)
    with pytest.raises(ValueError, match="model type 'gemma3' is not supported; supported: .*qwen3_moe"):
        arch_of(type("Config", (), {"model_type": "gemma3"})())


def test_each_family_reads_what_its_config_says():
    qwen2, qwen3, llama = arch_of(_config("qwen2")), arch_of(_config("qwen3")), arch_of(_config("llama"))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.sliding_window is None
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.moe is None
    assert not llama.qkv_bias and llama.rope_inv_freq is None
    # Qwen2 with sliding windows from layer 1 on (max_window_layers); Mistral's on every layer
    windowed = arch_of(_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1))
    assert windowed.sliding_window == 16 and windowed.window_layers == (False, True)
    mistral = arch_of(_config("mistral", sliding_window=8))
    assert mistral.sliding_window == 8 and mistral.window_layers == ()
    moe = arch_of(_config("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          norm_topk_prob=True, mlp_only_layers=[0]))  # fmt: skip
    assert moe.moe.num_experts == 8 and moe.moe.top_k == 2 and moe.moe.normalize_top_k
    assert moe.moe.moe_layers == (False, True) and moe.moe.aux_loss_coef == 0.001


def test_qwen2_5_vl_reads_its_text_model_with_mrope_and_refuses_sections_that_do_not_fit_the_head():
    from transformers import Qwen2_5_VLConfig

    def config(section):
        text = dict(SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section})
        vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision)

    arch = arch_of(config([2, 3, 3]))  # head 16: 8 rotary pairs for (time, height, width)
    assert arch.model_type == "qwen2_5_vl" and arch.mrope_section == (2, 3, 3)
    assert arch.qkv_bias and arch.head_dim == 16 and arch.rope_theta == 1e6 and not arch.tie_word_embeddings
    assert arch_of(_config("qwen2")).mrope_section is None
    refused = r"text_config.rope_parameters.mrope_section \[4, 4, 4\] must be three numbers"
    with pytest.raises(ValueError, match=refused):
        arch_of(config([4, 4, 4]))


def test_llama3_rope_takes_transformers_frequencies_and_other_scalings_are_refused_naming_the_key():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    config = _config("llama", rope_parameters=rope)
    arch = arch_of(config)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert torch.equal(torch.tensor(arch.rope_inv_freq), expected)
    assert not torch.equal(expected, default)  # the scaling changes some frequencies: the check has teeth
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match=r"`model.policy.path` \(qwen3 config.json\): rope_parameters.rope_type 'yarn'"):
        arch_of(_config("qwen3", rope_parameters=yarn))
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        arch_of(_config("llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be between 1 and num_experts"):
        arch_of(_config("qwen3_moe", num_experts=8, num_experts_per_tok=9))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe", "llama"])
def test_the_weight_table_maps_every_tensor_there_and_back(model_type, tmp_path):
    """Every tensor of a folder written by ``save_pretrained`` (experts one by one, as checkpoints hold them) is
    produced from Megatron's tensors and read back into them, through the same rows."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if model_type == "qwen3_moe" else {}
    config = _config(model_type, **moe)
    arch = arch_of(config)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    table = weight_table(arch)
    megatron_names = {row.megatron for row in table.rows}
    names = set()
    for template in megatron_names:
        layers = range(arch.num_layers) if "{L}" in template else [None]
        experts = range(arch.moe.num_experts) if "{E}" in template else [None]
        for layer in layers:
            if layer is not None and ("mlp.router" in template or "mlp.experts" in template) != arch.is_moe_layer(layer):
                if "mlp." in template:
                    continue  # a dense MLP on a mixture layer, or experts on a dense one
            for expert in experts:
                names.add(template.replace("{L}", str(layer)).replace("{E}", str(expert)))
    back = {}
    for name in sorted(names):
        if ".bias" in name and not arch.qkv_bias:
            continue
        full = table.from_hf(name, hf.__getitem__, arch)
        back.update(dict(table.to_hf(name, full, arch)))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_expert_parallel_layouts_are_checked_naming_the_key():
    from yatt_lightning.distributed.layout import Layout
    from yatt_lightning.strategy import MegatronStrategy

    moe = arch_of(_config("qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32))
    with pytest.raises(ValueError, match=r"`trainer.strategy.expert_model_parallel_size`=4 does not divide the model's 6 experts"):
        moe.check_parallel(1, 1, 4)
    with pytest.raises(ValueError, match=r"`trainer.strategy.expert_model_parallel_size`=2: the model \(qwen3\) has no experts"):
        arch_of(_config("qwen3")).check_parallel(1, 1, 2)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size` \(4\) x `pipeline_model_parallel_size` \(1\) = 4 does not divide the 2"):
        Layout(2, 1, 1, 4).check_divides(2, "processes")
    with pytest.raises(ValueError, match="`trainer.strategy.expert_tensor_parallel_size` 2: only 1"):
        MegatronStrategy(expert_tensor_parallel_size=2)


@pytest.mark.slow
def test_each_family_gives_transformers_logits_at_every_layout_and_exports_its_folder(tmp_path):
    """Tier 2 (2 gloo processes): Qwen3 (QK-norm, tied), Qwen3-MoE (8 experts, top 2), a Llama 3.1-style folder
    (llama3 rope scaling) and Mistral with a window of 8 on 40-token sequences, each written by plain
    ``save_pretrained``: Megatron's logits equal transformers' (< 1e-4, fp32) at TP=1, TP=2, PP=2 and, for the
    mixture, EP=2 (4 experts a rank, tokens exchanged by all-to-all); the export gives back every tensor of the
    folder bitwise (experts gathered over the expert-parallel group). Without its window Mistral's logits differ
    by more than 0.1: the window is what the match checks. Qwen2.5-VL (issue 43): the same on rows holding images of
    different sizes, with transformers' vision tower in front and M-RoPE's positions."""
    from tests.helpers import run_script

    families = ("qwen3", "qwen3-moe", "llama3", "mistral-window", "qwen2.5-vl")
    result = run_script("family_logits.py", str(tmp_path), *families, timeout=400)
    expected = {f"{layout}/{family}" for layout in ("tp1", "tp2", "pp2") for family in families}
    assert set(result) == expected | {"ep2/qwen3-moe"}, sorted(result)
    for key, entry in result.items():
        assert entry["export_equal"], key
        assert entry["logit_diff"] < 1e-4, (key, entry)
    assert result["tp1/mistral-window"]["without_window_diff"] > 0.1
    # Qwen2.5-VL: a row with two images of different sizes (6 and 8 tokens: dynamic resolution), one with one; the
    # vision tower (windowed and full attention, merger) and M-RoPE's positions are what the match checks
    assert result["tp1/qwen2.5-vl"]["image_tokens"] == [6, 8, 8]
    assert result["tp1/qwen2.5-vl"]["without_mrope_diff"] > 1e-2


def test_what_a_mixture_of_experts_cannot_run_yet_is_refused_before_start_naming_the_key(tmp_path):
    """In-process `yatt fit`, nothing starts: a critic on a MoE, expert parallelism beside a placement that trains on
    some ranks only, experts that the expert-parallel size does not divide."""
    from tests.helpers import REPO, yatt_in_process

    moe = ["fit", "--config", str(REPO / "configs" / "grpo_qwen3_moe_tiny.yaml"), "--trainer.callbacks", "[]"]
    code, err = yatt_in_process([*moe, "--model.advantage_estimator", "yatt_lightning.algorithms.GAE",
                                 "--model.critic", "{}"], cwd=tmp_path)  # fmt: skip
    assert code == 2 and "`model.critic`: " in err and "is a mixture of experts; a critic on one is not supported yet" in err, err
    code, err = yatt_in_process([*moe, "--trainer.devices", "3", "--trainer.strategy.placement",
                                 "yatt_lightning.placement.Disaggregated"], cwd=tmp_path)  # fmt: skip
    assert code == 2 and "`trainer.strategy.expert_model_parallel_size` 2 with Disaggregated" in err, err
    code, err = yatt_in_process([*moe, "--trainer.devices", "4", "--trainer.strategy.expert_model_parallel_size", "4",
                                 "--model.policy.path", "builtin:tiny-qwen3"], cwd=tmp_path)  # fmt: skip
    assert code == 2 and "`trainer.strategy.expert_model_parallel_size`=4: the model (qwen3) has no experts" in err, err

