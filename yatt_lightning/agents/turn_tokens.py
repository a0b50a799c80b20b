"""The token ids between two of the model's turns: the observation, tokenized once, never the conversation.

Re-tokenizing a conversation's text after each turn gives other ids than the engine sampled (a merge across
a turn's end, a template that strips what the model wrote): the trainer would then train on a sequence the
engine never produced. So a trajectory is the prompt's ids, then each turn's ids as the engine sampled them,
then the observation's ids, and so on; only the observation is tokenized, once.

With a chat template the observation's ids are what the template puts between the assistant's message and
the next assistant message's start: the end of the assistant's turn (unless the model sampled it), the
observation's message, and the generation prompt. They are read off the template once per message, as the
difference between the rendering of a conversation with and without that message (so a template that adds
tokens between turns gets them). Without a template the observation's text is tokenized as it is.
"""

from __future__ import annotations

from yatt_lightning.agents.environment import Observation

_PROBE = "\u2063yatt\u2063"  # a model turn's content no template changes (an invisible separator around a word)


class TurnTokens:
    """Token ids of observations between turns, for one tokenizer.

    Args:
        tokenizer: The policy's tokenizer.
        chat: Render observations with the tokenizer's chat template (``model.apply_chat_template`` and a
            template exists); otherwise they are tokenized as they are.
    """

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(chat and getattr(tokenizer, "chat_template", None))
        self.close_ids: list[int] = []  # what ends an assistant turn (``<|im_end|>`` and a newline, say)
        if self.chat:
            before = self._render([{"role": "user", "content": "u"}], generation_prompt=True)
            turn = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}])
            if not turn.startswith(before) or _PROBE not in turn:
                raise ValueError(
                    "`model.agent`: the tokenizer's chat template does not render an assistant turn after the "
                    "generation prompt; set `model.apply_chat_template: false` to use plain text between turns."
                )
            self.close_ids = self._ids(turn[turn.rindex(_PROBE) + len(_PROBE) :])

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def between(self, turn_ids: list[int], observation: Observation) -> list[int]:
        """The ids that follow the model's turn ``turn_ids`` (as sampled) before its next turn."""
        if not self.chat:
            if observation.token_ids is not None:
                return list(observation.token_ids)
            return self._ids(observation.text)
        close = self._close(turn_ids)
        if observation.token_ids is not None:
            return close + list(observation.token_ids)
        return close + self._ids(self.messages_text([{"role": observation.role, "content": observation.text}]))

    def after_turn(self, turn_ids: list[int], messages: list[dict]) -> list[int]:
        """The ids of ``messages`` (a tool's results, the user's next message) after the model's turn
        ``turn_ids``, up to the next turn's generation prompt; without a template, their texts joined by
        newlines after a newline."""
        if not self.chat:
            return self._ids("\n" + "\n".join(str(m.get("content", "")) for m in messages))
        return self._close(turn_ids) + self._ids(self.messages_text(messages))

    def _close(self, turn_ids: list[int]) -> list[int]:
        """What ends the model's turn ``turn_ids``: the template's close, less its first token when the model
        sampled that token itself."""
        close = self.close_ids
        if close and turn_ids and turn_ids[-1] == close[0]:
            return close[1:]
        return close

    def messages_text(self, messages: list[dict]) -> str:
        """The template's text of ``messages`` and the next generation prompt (after the end of the
        assistant's turn)."""
        conversation = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}]
        turn = self._render(conversation)
        after = self._render([*conversation, *messages], generation_prompt=True)
        if not after.startswith(turn):
            raise ValueError(
                f"`model.agent`: the chat template renders the conversation before a {messages[0]['role']!r} "
                "message differently once the message follows; set `model.apply_chat_template: false`."
            )
        return after[len(turn) :]
