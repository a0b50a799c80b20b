"""Tier 1: prompt ids of users' models (tests/user_models.py) equal their tokenizers' own, for every kind of row."""

from __future__ import annotations

import json

import pytest
from yatt_lightning.datamodules.prompt import read_jsonl

from tests.user_models import CHATML, CHATML_VISION, FAMILIES, build
from yatt_lightning.chat import PromptFormat, render

TEXT = [f for f in FAMILIES if not f.startswith("llava")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-models")
    return {family: build(family, root / family) for family in FAMILIES}


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _own(tokenizer, messages, **kwargs) -> list[int]:
    """What the tokenizer itself gives (``BatchEncoding`` in transformers 5: its ``input_ids``)."""
    kwargs = kwargs or {"add_generation_prompt": True}
    return list(tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])


@pytest.mark.parametrize("family", TEXT)
def test_text_rows_get_the_tokenizers_own_chat_template_ids(folders, family):
    tok = _tokenizer(folders[family])
    fmt = PromptFormat.of(folders[family], tok)
    user = {"role": "user", "content": "after f"}
    assert fmt.ids({"prompt": "after f"}) == _own(tok, [user])
    conversation = [{"role": "system", "content": "Count on."}, {"role": "user", "content": "after a"},
                    {"role": "assistant", "content": "b c d e"}, user]  # fmt: skip
    assert fmt.ids({"messages": conversation, "prompt": "after f"}) == _own(tok, conversation)
    # A conversation ending with the assistant's turn is continued: the row prefills the answer's start.
    prefill = [user, {"role": "assistant", "content": "g h"}]
    assert fmt.ids({"messages": prefill, "prompt": "after f"}) == _own(tok, prefill, continue_final_message=True)
    # A list of text parts renders as the joined text (text templates take strings).
    parts = [{"role": "user", "content": [{"type": "text", "text": "after"}, {"type": "text", "text": "f"}]}]
    assert fmt.ids({"messages": parts, "prompt": "f"}) == _own(tok, [{"role": "user", "content": "after\nf"}])


@pytest.mark.parametrize("family", TEXT)
def test_the_system_prompt_goes_first_unless_the_row_brings_its_own(folders, family):
    tok = _tokenizer(folders[family])
    fmt = PromptFormat.of(folders[family], tok, system_prompt="Be brief.")
    user = {"role": "user", "content": "after f"}
    assert fmt.ids({"prompt": "after f"}) == _own(tok, [{"role": "system", "content": "Be brief."}, user])
    own_system = [{"role": "system", "content": "Count on."}, user]
    assert fmt.ids({"messages": own_system, "prompt": "after f"}) == _own(tok, own_system)


@pytest.mark.parametrize("family", TEXT)
def test_without_a_template_the_prompt_is_plain_text_with_the_tokenizers_special_tokens(folders, family):
    tok = _tokenizer(folders[family])
    fmt = PromptFormat.of(folders[family], tok, apply_chat_template=False)
    plain = tok("after f", add_special_tokens=True)["input_ids"]
    assert fmt.ids({"prompt": "after f"}) == plain
    assert (plain[0] == tok.bos_token_id) == (not family.startswith("qwen"))  # Llama 3 and Mistral put a BOS in front
    messages = [{"role": "user", "content": "after"}, {"role": "user", "content": "f"}]
    assert fmt.ids({"messages": messages, "prompt": "f"}) == tok("after\nf", add_special_tokens=True)["input_ids"]
    with pytest.raises(ValueError, match=r"`model.system_prompt` is set but `model.apply_chat_template` is false"):
        PromptFormat.of(folders[family], tok, apply_chat_template=False, system_prompt="Be brief.")


def test_a_system_prompt_without_any_chat_template_is_refused_naming_the_key(tiny_model_path):
    with pytest.raises(ValueError, match=r"`model.system_prompt` is set but .* has no chat template"):
        PromptFormat.of(tiny_model_path, _tokenizer(tiny_model_path), system_prompt="Be brief.")


def test_llava_rows_render_structured_content_with_one_image_token_per_image(folders):
    """llava-hf's template (images first, then text) and a ChatML one for structured content, on a prompt
    string with its mark, a chat row, and a system prompt; a text-only template that drops the image is
    refused naming the template."""
    tok = _tokenizer(folders["llava"])
    image = tok.convert_tokens_to_ids("<image>")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour:"}]}]
    for template in (None, CHATML_VISION):
        if template is not None:
            tok.chat_template = template
        fmt = PromptFormat.of(folders["llava"], tok, system_prompt="Look.")
        system = [{"role": "system", "content": [{"type": "text", "text": "Look."}]}]
        ids = fmt.ids({"prompt": "<image>\ncolour:", "_images": ["a.png"]})
        assert ids == _own(tok, system + chat) and ids.count(image) == 1
        row = {"messages": chat, "prompt": "colour:", "images": ["ref"]}
        assert PromptFormat.of(folders["llava"], tok).ids(row) == _own(tok, chat)
    row = {"prompt": "<image>\ncolour:", "images": ["ref"], "_source": "r.jsonl:1"}
    tok.chat_template = CHATML  # a text template: adds strings to message['content'], so content parts fail in it
    ids = PromptFormat.of(folders["llava"], tok).ids(row)  # then the row's text, its mark the image token
    assert ids == _own(tok, [{"role": "user", "content": "<image>\ncolour:"}]) and ids.count(image) == 1
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] + 1 }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"prompt \(r\.jsonl:1\): the chat template of .* fails on it \(a vision-language "
                                         r"model's messages carry content parts, then text\): TypeError"):  # fmt: skip
        PromptFormat.of(folders["llava"], tok).ids(row)  # fails both ways
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'][-1]['text'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"tokenizes to 0 image tokens for 1 images; the chat template of .* renders no "
                                         r"image token for each .* nor for each <image> mark"):  # fmt: skip
        PromptFormat.of(folders["llava"], tok).ids(row)  # a template that drops the image either way


def test_a_llava_template_that_prints_content_as_a_string_gets_the_rows_text_with_its_image_token(folders):
    """A community-style template (``{{ message['content'] }}``): a prompt string with its mark, or a chat row of
    content parts, render as text with the image token where the mark is (what transformers' processor renders
    for that row); content parts alone would print the list."""
    folder = folders["llava-string"]
    tok = _tokenizer(folder)
    image = tok.convert_tokens_to_ids("<image>")
    fmt = PromptFormat.of(folder, tok)
    ids = fmt.ids({"prompt": "What colour is <image> here?", "_images": ["a.png"]})
    assert ids == _own(tok, [{"role": "user", "content": "What colour is <image> here?"}]) and ids.count(image) == 1
    parts = [{"type": "image"}, {"type": "text", "text": "colour:"}]
    row = {"messages": [{"role": "user", "content": parts}], "prompt": "colour:", "images": ["ref"]}
    assert fmt.ids(row) == _own(tok, [{"role": "user", "content": "<image>\ncolour:"}])
    two = PromptFormat.of(folder, tok, system_prompt="Look.").ids({"prompt": "<image> and <image>?", "_images": [1, 2]})
    assert two.count(image) == 2 and two == _own(tok, [{"role": "system", "content": "Look."},
                                                       {"role": "user", "content": "<image> and <image>?"}])  # fmt: skip


def test_the_judge_wraps_its_prompt_in_its_tokenizers_chat_template(folders):
    from yatt_lightning.rewards.genrm import GenerativeRewardModel

    judge = GenerativeRewardModel(model=str(folders["qwen2"]), template="Q: {prompt} A: {completion} Score:")
    judge.tokenizer = _tokenizer(folders["qwen2"])
    ids = judge.judge_prompts(["after f"], ["g h"], [{"prompt": "after f"}])[0]
    assert ids == _own(judge.tokenizer, [{"role": "user", "content": "Q: after f A: g h Score:"}])
    assert render(judge.tokenizer, [{"role": "user", "content": "x"}]) == _own(judge.tokenizer, [{"role": "user", "content": "x"}])


def test_chat_rows_in_a_jsonl_file(tmp_path):
    """``messages``, or a ``prompt`` given as messages: kept as messages, shown by their last user turn; a
    malformed one names its line."""
    path = tmp_path / "p.jsonl"
    conversation = [{"role": "system", "content": "Count on."}, {"role": "user", "content": "after f"}]
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": conversation, "answer": "g"}, {"prompt": conversation[1:], "answer": "g"}, {"prompt": "after f"},
    ]) + "\n")  # fmt: skip
    rows = read_jsonl(path)
    assert [r["prompt"] for r in rows] == ["after f"] * 3
    assert rows[0]["messages"] == conversation and rows[1]["messages"] == conversation[1:] and "messages" not in rows[2]
    for line, message in [
        ({"messages": []}, r"p\.jsonl:1: chat messages must be a non-empty list"),
        ({"messages": [{"content": "x"}]}, r"p\.jsonl:1: message 1 must be \{'role': <string>, 'content': \.\.\.\}"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]},
         r"p\.jsonl:1: a message part must be .*rows with images need `data.class_path: ImagePromptDataModule`"),
        ({"prompt": "x", "messages": conversation}, r"p\.jsonl:1: both 'prompt' and 'messages'"),
    ]:  # fmt: skip
        path.write_text(json.dumps(line) + "\n")
        with pytest.raises(ValueError, match=message):
            read_jsonl(path)


def test_the_engine_refuses_samples_drawn_after_other_prompt_ids_than_it_was_given():
    """vLLM reports the prompt ids it sampled after; they must be the policy's (images expanded)."""
    from types import SimpleNamespace

    from yatt_lightning.engines.vllm_outputs import check_prompt

    check_prompt(SimpleNamespace(prompt_token_ids=[5, 9, 9, 2]), [5, 9, 9, 2])
    with pytest.raises(RuntimeError, match=r"other prompt ids than it was given \(5 vs 4 tokens, first difference "
                                           r"at position 0: \[1, 5, 9, 9, 2\] vs \[5, 9, 9, 2\]\)"):  # fmt: skip
        check_prompt(SimpleNamespace(prompt_token_ids=[1, 5, 9, 9, 2]), [5, 9, 9, 2])  # a BOS added by the engine


def test_a_llava_folder_whose_template_only_its_processor_has_uses_that_one(folders, tmp_path):
    """transformers 4 kept a processor's template in ``chat_template.json``, where the tokenizer does not look."""
    import shutil

    folder = shutil.copytree(folders["llava"], tmp_path / "llava4")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (folder / "chat_template.jinja").unlink()
    tok = _tokenizer(folder)
    assert tok.chat_template is None
    fmt = PromptFormat.of(folder, tok)
    assert fmt.source.endswith("(its processor)")
    tok.chat_template = template  # what the processor's own rendering gives
    assert fmt.ids({"prompt": "<image>\ncolour:", "_images": ["a.png"]}) == _own(
        tok, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour:"}]}]
    )
