"""Chat messages -> prompt ids, through the tokenizer's chat template.

A tokenizer without a template (base models, the bundled pair) gets a plain one, one line per
message and an open assistant turn:

    system: You are terse.
    user: Hello
    assistant:
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from specdecode.server.schemas import Message

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> str:
    """The prompt text, ready for the assistant's answer."""
    return tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.text} for m in messages],
        chat_template=None if tokenizer.chat_template else DEFAULT_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )


def template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template in use: the tokenizer's own (its default one, when it has several),
    else the plain one."""
    own = tokenizer.chat_template
    if isinstance(own, dict):
        own = own.get("default")
    return own or DEFAULT_TEMPLATE


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """Prompt ids; BOS is added unless the template already wrote it (as most templates do)."""
    text = render(tokenizer, messages)
    bos = tokenizer.bos_token
    return encode(tokenizer, text, add_special=not (bos and text.startswith(bos)))


def encode(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special: bool = True, parse_special: bool = True
) -> list[int]:
    """Token ids of `text`, as the backends tokenize it (parse_special False: the text of
    special tokens is tokenized as plain text)."""
    options = {} if parse_special else {"split_special_tokens": True}
    return list(tokenizer(text, add_special_tokens=add_special, **options)["input_ids"])
