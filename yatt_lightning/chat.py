"""How a row becomes the policy's prompt ids: chat templates, system prompts, rows that are chat messages.

One place, used by the checks before start (:mod:`yatt_lightning.run.preflight`), the RL step
(:meth:`~yatt_lightning.module.RLHFModule.tokenize_prompt`) and the LLM judge, so that what was checked is
what runs. The engine receives these ids as they are (it does not tokenize again) and checks that it
saw them (:mod:`yatt_lightning.engines.vllm_engine`).

A row is either a ``prompt`` string or chat ``messages`` (``[{"role": ..., "content": ...}, ...]``; the
data modules accept a ``prompt`` given as such a list too). Decisions:

- With a chat template (the tokenizer's, else a vision-language model's processor's) and
  ``model.apply_chat_template`` on, a ``prompt`` string becomes one user message; ``model.system_prompt``
  goes in front as a system message unless the row's messages start with their own. The ids are the
  tokenizer's own ``apply_chat_template(..., tokenize=True)["input_ids"]`` (in transformers 5 that call
  returns a ``BatchEncoding``, whose ``list()`` is its keys). Messages ending with a user (or tool) turn
  get the generation prompt; messages ending with an assistant turn are continued
  (``continue_final_message``: the row prefills the start of the answer).
- A vision-language model's messages carry structured content (``[{"type": "image"}, {"type": "text",
  ...}]``), the convention of transformers' multimodal chat templates; a ``<image>`` mark in a string
  becomes an image part. The rendered ids must hold one image token per image of the row, or the row
  is refused naming the template.
- Without a template (or with ``apply_chat_template`` off), the prompt text is tokenized with the
  tokenizer's special tokens (a BOS where the model has one); a chat row's text is its parts joined by
  newlines. ``model.system_prompt`` then has no meaning and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_MARK = "<image>"  # where an image goes in a prompt string


# ---------------------------------------------------------------------------------------------- rows
def chat_messages(value: Any, where: str, images: bool = False) -> list[dict]:
    """``value`` checked as chat messages (a list of ``{"role", "content"}``, content a string or a list of
    text parts, and image parts when ``images``); an error names ``where`` and the message."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: chat messages must be a non-empty list of {{'role': ..., 'content': ...}}.")
    out = []
    for k, message in enumerate(value, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"{where}: message {k} must be {{'role': <string>, 'content': ...}}, got {message!r:.200}.")
        content = message["content"]
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    continue
                if kind == "image" and images:
                    continue
                hint = "; rows with images need `data.class_path: ImagePromptDataModule`" if kind == "image" else ""
                raise ValueError(
                    f"{where}: a message part must be {{'type': 'text', 'text': <string>}}"
                    f"{' or an image' if images else ''}, got {part!r:.200} (message {k}){hint}."
                )
        elif not isinstance(content, str):
            raise ValueError(f"{where}: message {k}'s content must be a string or a list of parts, got {content!r:.200}.")
        out.append(dict(message))
    return out


def part_texts(content: str | list) -> list[str]:
    """A message's content as text pieces, an image part as its ``<image>`` mark."""
    if isinstance(content, str):
        return [content]
    return [IMAGE_MARK if part.get("type") == "image" else part["text"] for part in content]


def content_text(content: str | list) -> str:
    """A message's content as one text: its pieces joined by newlines."""
    return "\n".join(part_texts(content))


def messages_text(messages: list[dict]) -> str:
    """The messages' parts joined by newlines (a chat row's prompt without a chat template)."""
    return "\n".join(content_text(m["content"]) for m in messages)


def display_prompt(messages: list[dict]) -> str:
    """What a chat row shows as its ``prompt`` (the reward's ``prompt`` argument, the logged samples): the
    text of its last user message, with ``<image>`` marks."""
    users = [m for m in messages if m["role"] == "user"] or messages
    return content_text(users[-1]["content"])


def content_parts(content: str | list) -> list[dict]:
    """Structured content: a string split at its ``<image>`` marks (text stripped, empty pieces dropped),
    image parts without their data (the pixels reach the model separately)."""
    if isinstance(content, list):
        return [{"type": "image"} if p.get("type") == "image" else {"type": "text", "text": p["text"]} for p in content]
    parts: list[dict] = []
    for k, piece in enumerate(content.split(IMAGE_MARK)):
        if k:
            parts.append({"type": "image"})
        if piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts


def _row_images(row: dict) -> list | None:
    """A row's images: checked references once drawn (``images``), where they are before (``_images``)."""
    for key in ("images", "_images"):
        if key in row:
            return row[key]
    return None


# ---------------------------------------------------------------------------------------------- ids
def render(
    tokenizer: Any, messages: list[dict], chat_template: str | None = None, tools: list[dict] | None = None,
    finished: bool = False,
) -> list[int]:  # fmt: skip
    """The ids of ``messages`` under the chat template, as the tokenizer's own ``apply_chat_template``
    gives them: with the generation prompt after a user turn, continuing a final assistant turn; ``tools``:
    the agent's tool schemas, which the template describes to the model (Qwen's and Hermes' do).
    ``finished``: a whole conversation, as trained on (neither a generation prompt nor a turn left open)."""
    continue_final = messages[-1]["role"] == "assistant" and not finished
    out = tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=True, return_dict=True, tools=tools,
        add_generation_prompt=not continue_final and not finished, continue_final_message=continue_final,
    )  # fmt: skip
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    if ids and isinstance(ids[0], list):  # a batch of one conversation
        ids = ids[0]
    return [int(t) for t in ids]


@dataclass(frozen=True)
class PromptFormat:
    """How rows become prompt ids for one model: its tokenizer, the chat template in use (``None``: plain
    text), the system prompt, and a vision-language model's image token (``None`` for a text model)."""

    tokenizer: Any
    chat_template: str | None = None
    system_prompt: str | None = None
    image_token_id: int | None = None
    source: str = "the model"  # where the template came from, for messages
    tools: list[dict] | None = None  # an agent's tool schemas, rendered by the template

    @classmethod
    def of(
        cls, path: Path, tokenizer: Any, *, apply_chat_template: bool = True, system_prompt: str | None = None,
        tools: list[dict] | None = None,
    ) -> PromptFormat:
        """The format of the model folder ``path`` (its tokenizer already loaded). Raises a ``ValueError``
        naming ``model.system_prompt`` when it is set but no chat template is in use."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        vision = hasattr(config, "vision_config")
        template, source = None, str(path)
        if apply_chat_template:
            template = getattr(tokenizer, "chat_template", None)
            if template is None and vision:  # a processor's template (transformers 4 kept it apart)
                from transformers import AutoProcessor

                template = getattr(AutoProcessor.from_pretrained(path), "chat_template", None)
                source = f"{path} (its processor)"
        if system_prompt is not None and template is None:
            why = "`model.apply_chat_template` is false" if not apply_chat_template else f"{path} has no chat template"
            raise ValueError(
                f"`model.system_prompt` is set but {why}, so there is no system turn to put it in; unset it, or use "
                "a model whose tokenizer has a chat template (tokenizer.chat_template)."
            )
        image_token = None
        if vision:
            from yatt_lightning.models.vlm import image_token_id

            image_token = image_token_id(config)
        return cls(tokenizer, template, system_prompt, image_token, source, tools if template is not None else None)

    def _conversation(self, row: dict) -> list[dict]:
        """``row``'s messages (or its prompt as a user turn), behind the system prompt unless they bring their own."""
        messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def _marked(self, row: dict) -> list[dict]:
        """The messages as text, each ``<image>`` mark the model's own image token (for string templates)."""
        token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        return [{**m, "content": content_text(m["content"]).replace(IMAGE_MARK, token)} for m in self._conversation(row)]

    def _fails(self, where: str, err: Exception) -> ValueError:
        parts = " (a vision-language model's messages carry content parts, then text)" if self.image_token_id else ""
        return ValueError(
            f"prompt ({where}): the chat template of {self.source} fails on it{parts}: {type(err).__name__}: "
            f"{err}; fix the template or the row, or set `model.apply_chat_template` false."
        )

    def messages(self, row: dict) -> list[dict]:
        """The conversation the template renders for ``row``: its messages (or its prompt as a user turn),
        behind the system prompt unless they bring their own; structured content for a vision model."""
        convert = content_parts if self.image_token_id is not None else content_text
        return [{**m, "content": convert(m["content"])} for m in self._conversation(row)]

    def ids(self, row: dict) -> list[int]:
        """The prompt ids of ``row`` (one image token per image for a vision-language model). A vision model's
        messages go to its template as content parts first; when that renders no image token for them (a
        template that prints ``content`` as a string, as many community templates do), as text with the model's
        image token where the row's ``<image>`` marks are, the convention of such templates."""
        where = row["_source"] if "_source" in row else "built-in task"
        images = _row_images(row)
        if self.chat_template is not None:
            try:
                ids = render(self.tokenizer, self.messages(row), self.chat_template, self.tools)
            except Exception as err:  # jinja's TemplateError, a template's own raise_exception, TypeError, ...
                if self.image_token_id is None:
                    raise self._fails(where, err) from err
                ids = None
            if self.image_token_id is not None and images is not None and (ids is None or ids.count(self.image_token_id) != len(images)):
                try:
                    ids = render(self.tokenizer, self._marked(row), self.chat_template, self.tools)
                except Exception as err:
                    raise self._fails(where, err) from err
        else:
            text = messages_text(row["messages"]) if "messages" in row else row["prompt"]
            if self.image_token_id is not None:  # the marks as the model's own image token
                text = text.replace(IMAGE_MARK, self.tokenizer.convert_ids_to_tokens(self.image_token_id))
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {row.get('prompt')!r} ({where}) tokenizes to nothing.")
        if self.image_token_id is not None and images is not None and ids.count(self.image_token_id) != len(images):
            because = (
                f"; the chat template of {self.source} renders no image token for each {{'type': 'image'}} content part "
                "(transformers' multimodal convention) nor for each <image> mark in the text (string templates'), "
                "or set `model.apply_chat_template` false"
                if self.chat_template is not None
                else "; write one <image> mark per image in the prompt"
            )
            raise ValueError(
                f"prompt ({where}) tokenizes to {ids.count(self.image_token_id)} image tokens for "
                f"{len(images)} images{because}."
            )
        return ids
