"""Chat messages -> prompt ids, through the tokenizer's chat template (`specdecode.chat`).

A tokenizer without a template (base models, the bundled pair) gets a plain one here, one line
per message and an open assistant turn (the command line asks for a template instead):

    system: You are terse.
    user: Hello
    assistant:
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from specdecode import chat
from specdecode.server.schemas import Message

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template in use: the tokenizer's own, else the plain one."""
    return chat.own_template(tokenizer) or DEFAULT_TEMPLATE


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> str:
    """The prompt text, ready for the assistant's answer."""
    return chat.render(tokenizer, _dicts(messages), template(tokenizer))


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    return chat.prompt_ids(tokenizer, _dicts(messages), template(tokenizer))


def _dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text} for m in messages]
