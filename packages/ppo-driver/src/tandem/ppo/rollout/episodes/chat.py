"""The chat grows turn by turn through the model's own chat template, without re-tokenizing the model.

The first prompt is the template applied to the first observation's messages (with the
tools' schemas where there are tools), generation prompt included. After a model turn, the
tokens that follow it are the template's own text between that turn and the next
generation prompt, found by rendering a fixed conversation twice (`_BASE`, then `_BASE`
and the new messages) and taking the difference: the template's closing of the
assistant turn (e.g. `<|im_end|>\\n`, less the stop token when the model wrote it), the
new messages as the template writes them (tool results as the template's tool messages),
and the next generation prompt. Those are context tokens; the model's tokens stay
exactly as sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tandem.ppo.rollout.episodes.environment import Message

__all__ = ["ChatRenderer"]

_MARK = "\u2063tandem-turn\u2063"
"""The assistant content of the fixed conversation: text no model writes, found once in the rendering."""

_BASE: list[Message] = [{"role": "user", "content": "\u2063"}, {"role": "assistant", "content": _MARK}]


class ChatRenderer:
    """Renders an episode's chat with `tokenizer`'s chat template; `tools`: functions or JSON schemas."""

    def __init__(self, tokenizer: Any, tools: Sequence[Callable[..., Any] | dict[str, Any]] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "episodes grow through the model's chat template, but the tokenizer of --hf-checkpoint has "
                "none; use a model whose tokenizer has a chat template"
            )
        self.tokenizer = tokenizer
        self.tools = list(tools) or None
        base = self._render(_BASE, generation_prompt=False)
        at = base.rfind(_MARK)
        if at < 0:
            raise ValueError("the chat template drops assistant messages; episodes need them rendered")
        self._base = base
        self._closing = base[at + len(_MARK) :]
        """The template's text after an assistant turn's content (its end-of-turn marker)."""

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert isinstance(text, str), type(text)
        return text

    def encode(self, text: str) -> list[int]:
        """`text` as tokens; the template wrote its special tokens as text, so none are added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_prompt(self, messages: Sequence[Message]) -> tuple[str, list[int]]:
        """The episode's first prompt: `messages` through the template, generation prompt included."""
        text = self._render(messages, generation_prompt=True)
        return text, self.encode(text)

    def after_turn(self, last_token: int | None, messages: Sequence[Message]) -> tuple[str, list[int]]:
        """The context after a model turn whose last token is `last_token`: the template's end of the turn
        (less `last_token`'s text when the model wrote the marker itself), `messages`, and the next
        generation prompt."""
        closing = self._closing
        if last_token is not None:
            written = self.tokenizer.decode([last_token])
            if written and closing.startswith(written):
                closing = closing[len(written) :]
        full = self._render([*_BASE, *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError(
                "the chat template renders earlier messages differently once more follow, so the chat "
                "cannot grow turn by turn; use a template that only appends"
            )
        text = closing + full[len(self._base) :]
        return text, self.encode(text)
