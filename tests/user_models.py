"""Small models as users bring them: written by plain ``save_pretrained`` of transformers, each with a chat template.

The built-in models are built by yatt-lightning itself; these are what a user's folder looks like instead:
the family's own tokenizer class (Qwen2's byte-level BPE, Llama 3's ``PreTrainedTokenizerFast`` with a BOS
post-processor, Mistral's sentencepiece-style ``LlamaTokenizer``), a chat template, and for LLaVA a
``LlavaProcessor`` with transformers' CLIP image processor and llava-hf's template. The 2026 families: Qwen3
(QK-norm, tied), Qwen3-MoE (8 experts of 64, top 2 renormalised), a Llama 3.1-style folder (``llama3`` rope
scaling at this model's scale) and Mistral with a sliding window shorter than the tests' sequences. Random weights, a few
hundred thousand parameters, vocabularies trained on the built-in tasks' text (so the alphabet task can be
learned), head size 32 (vLLM on CPU).

    python -m tests.user_models OUT_DIR     # writes every family under OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Qwen's ChatML.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Vicuna's "USER: ... ASSISTANT:", with the tokenizer's BOS in front.
USER_ASSISTANT = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'USER: ' + message['content'] + '\n' }}"
    "{% else %}{{ 'ASSISTANT: ' + message['content'] + eos_token + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# llava-hf's LLaVA 1.5 template: structured content, images first, then the text.
LLAVA = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# A community-style LLaVA template that prints each message's content as a string (rows then carry <image> in
# their text): given content parts it would print the list itself.
LLAVA_STRING = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{{ message['content'] }}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# ChatML for structured content (as Qwen2-VL writes it), with LLaVA's image token.
CHATML_VISION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<image>' }}{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2-VL's template (structured content; an image or a video between vision marks), as its folders carry it.
QWEN_VL = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif content['type'] == 'video' %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_VL_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL's vision transformer at a tiny size: 14 px patches merged 2x2 (an image of 56 x 84 px takes 6 tokens),
# windows of 2x2 merged patches on block 0, full attention on block 1; M-RoPE channel pairs (t, h, w) of head 32.
QWEN_VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)  # fmt: skip
QWEN_VL_MROPE = [4, 6, 6]

FAMILIES = ("qwen2", "llama-tied", "mistral", "llava", "qwen3", "qwen3-moe", "llama3", "mistral-window", "llava-string")
# Folders whose policy runs but whose `yatt fit` is not built yet (issue 43): built by name, not among FAMILIES.
POLICY_ONLY = ("qwen2.5-vl",)
# Llama 3.1's rope scaling (its values, at this tiny model's scale: the low frequencies of positions beyond 64
# are scaled); Mistral's window shorter than the tests' sequences.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
MISTRAL_WINDOW = 8
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6)  # fmt: skip


def _corpus() -> list[str]:
    from yatt_lightning.models.tiny import COLOUR_CORPUS

    return [*COLOUR_CORPUS, "USER ASSISTANT user assistant system You are a helpful assistant."]


def _bpe(special: list[str], *, metaspace: bool = False, vocab_size: int = 400) -> tuple[dict, list]:
    """Vocabulary and merges of a BPE trained on the tasks' text: byte-level (Qwen2, Llama 3), or
    sentencepiece-style with byte fallback tokens (``metaspace``: Llama 2, Mistral)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=metaspace))
    if metaspace:
        # Merges within words, as sentencepiece learns them (the tokenizer then encodes without splitting).
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        special = special + [f"<0x{i:02X}>" for i in range(256)]
        alphabet = []
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + (256 if metaspace else 0), special_tokens=special, initial_alphabet=alphabet,
        min_frequency=1, show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_corpus(), trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    return state["vocab"], merges


def _tokenizer(family: str):
    from tokenizers import processors
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer

    llava = family.startswith("llava")
    if family in ("qwen2", "llava", "qwen3", "qwen3-moe", "llava-string", "qwen2.5-vl"):
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<image>"] if llava else [])
        special += QWEN_VL_SPECIAL if family == "qwen2.5-vl" else []
        vocab, merges = _bpe(special)
        tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>")  # fmt: skip
        tok.add_special_tokens({"additional_special_tokens": special[1:]})
        tok.chat_template = QWEN_VL if family == "qwen2.5-vl" else CHATML
        return tok
    if family in ("llama-tied", "llama3"):  # Llama 3: PreTrainedTokenizerFast, byte-level BPE, BOS by its post-processor
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
        vocab, merges = _bpe(special)
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])]
        )
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                      eos_token="<|eot_id|>", pad_token="<|end_of_text|>")  # fmt: skip
        tok.add_special_tokens({"additional_special_tokens": special})
        tok.chat_template = USER_ASSISTANT
        return tok
    if family in ("mistral", "mistral-window"):  # sentencepiece-style BPE, as Mistral's (and Llama 2's) LlamaTokenizer
        vocab, merges = _bpe(["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"], metaspace=True)
        tok = LlamaTokenizer(vocab=vocab, merges=merges, pad_token="<unk>", add_bos_token=True)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = CHATML
        return tok
    raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES + POLICY_ONLY)}")


def build(family: str, folder: Path, seed: int = 0) -> Path:
    """Write ``family``'s model, tokenizer (and processor) into ``folder`` with plain ``save_pretrained``."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlamaForCausalLM,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )  # fmt: skip

    tok = _tokenizer(family)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id)  # fmt: skip
    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, **ids))
    elif family == "llama-tied":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, **ids, tie_word_embeddings=True))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**SHAPE, **ids, sliding_window=None))
    elif family == "mistral-window":
        model = MistralForCausalLM(MistralConfig(**SHAPE, **ids, sliding_window=MISTRAL_WINDOW))
    elif family == "llama3":  # Llama 3.1-style: llama3 rope scaling, untied
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, **ids, rope_parameters=LLAMA3_ROPE))
    elif family == "qwen3":  # QK-norm, tied embeddings (as Qwen3's small models)
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, **ids, tie_word_embeddings=True))
    elif family == "qwen3-moe":  # 8 experts, top 2, renormalised (as Qwen3-30B-A3B)
        config = Qwen3MoeConfig(**SHAPE, **ids, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, router_aux_loss_coef=0.001)  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
    elif family == "qwen2.5-vl":
        return _qwen_vl(folder, tok, ids)
    else:
        vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=56, patch_size=14, projection_dim=64)  # fmt: skip
        config = LlavaConfig(
            vision_config=vision, text_config=Qwen2Config(**SHAPE, **ids), image_token_index=tok.convert_tokens_to_ids("<image>"),
            image_seq_length=16, vision_feature_select_strategy="default", vision_feature_layer=-1,
        )  # fmt: skip
        model = LlavaForConditionalGeneration(config)
        template = LLAVA_STRING if family == "llava-string" else LLAVA
        processor = LlavaProcessor(
            image_processor=CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
            tokenizer=tok, patch_size=14, vision_feature_select_strategy="default", chat_template=template,
            num_additional_image_tokens=1,
        )  # fmt: skip
        tok.chat_template = template
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    (processor if family.startswith("llava") else tok).save_pretrained(folder)
    return folder


def _qwen_vl(folder: Path, tok, ids: dict) -> Path:
    """A Qwen2.5-VL folder: the model, the tokenizer and the image processor (transformers' PIL one; its video
    processor needs torchvision, which the CPU stack has not), the chat template in both."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    names = ("vision_start", "vision_end", "image_pad", "video_pad")
    token = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in names}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": QWEN_VL_MROPE}
    text = dict(SHAPE, **ids, rope_parameters=rope)
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(QWEN_VL_VISION, out_hidden_size=SHAPE["hidden_size"]),
        image_token_id=token["image_pad"], video_token_id=token["video_pad"],
        vision_start_token_id=token["vision_start"], vision_end_token_id=token["vision_end"], tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN_VL)
    return folder


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name in FAMILIES + POLICY_ONLY:
        print(build(name, out / name))


# How transformers versions name a LLaVA's tensors, from what 5.19's save_pretrained writes: the tower's
# prefix, the language model's, its output layer's, the projector's.
LLAVA_LAYOUTS = {
    "transformers 5 save_pretrained": ("vision_tower.", "language_model.model.", "language_model.lm_head.", "multi_modal_projector."),
    "transformers 4 (published)": ("vision_tower.vision_model.", "language_model.model.", "language_model.lm_head.", "multi_modal_projector."),
    "transformers 4.52+": ("model.vision_tower.vision_model.", "model.language_model.", "lm_head.", "model.multi_modal_projector."),
    "transformers 5 modules": ("model.vision_tower.", "model.language_model.", "lm_head.", "model.multi_modal_projector."),
}  # fmt: skip


def relayout(folder: Path, layout: str, out: Path) -> Path:
    """A copy of the LLaVA ``folder`` (as :func:`build` writes it) with its tensors named as ``layout``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    source, target = LLAVA_LAYOUTS["transformers 5 save_pretrained"], LLAVA_LAYOUTS[layout]
    renamed = {}
    for name, tensor in load_file(out / "model.safetensors").items():
        prefix = next(p for p in source if name.startswith(p))
        renamed[target[source.index(prefix)] + name.removeprefix(prefix)] = tensor
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out
