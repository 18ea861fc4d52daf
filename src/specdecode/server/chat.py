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

from specdecode.backends.hf import HFBackend
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


def chat_prompt_ids(backend: HFBackend, messages: Sequence[Message]) -> list[int]:
    """Prompt ids; BOS is added unless the template already wrote it (as most templates do)."""
    text = render(backend.tokenizer, messages)
    bos = backend.tokenizer.bos_token
    return backend.tokenize(text, add_special=not (bos and text.startswith(bos)))
