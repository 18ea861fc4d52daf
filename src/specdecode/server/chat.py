"""Chat messages -> prompt ids, through the tokenizer's chat template (`specdecode.chat`).

A tokenizer without a template (base models, the bundled pair) gets a plain one here, one line
per message and an open assistant turn (the command line asks for a template instead):

    system: You are terse.
    user: Hello
    assistant:

A conversation that ends with the assistant's message is continued from it (the message left
open, no new turn), as llama-server does; `continue_final_message` asks for that explicitly
(with `add_generation_prompt: false`, as in transformers and vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from specdecode import chat
from specdecode.server.errors import APIError
from specdecode.server.schemas import ChatRequest, Message

LengthCheck = Callable[[int, str, str], None]  # (characters, param, what they are): raises if too many
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template in use: the tokenizer's own, else the plain one."""
    return chat.own_template(tokenizer) or DEFAULT_TEMPLATE


@dataclass(frozen=True)
class Ending:
    """How the rendered prompt ends: an open assistant turn, the last message left open to be
    continued, or (both False) the messages as they are."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


def ending(body: ChatRequest) -> Ending:
    """The request's ending, with llama-server's rules: a last message of the assistant's is
    always continued; asking for both endings is an error."""
    last, before = body.messages[-1].role, [m.role for m in body.messages[-2:-1]]
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message needs add_generation_prompt: false (both cannot be true)",
                param="continue_final_message",
            )
        if last != "assistant":
            raise APIError(
                400, "continue_final_message needs the last message to be the assistant's", param="messages"
            )
        return Ending(False, True)
    if last == "assistant":
        if before == ["assistant"]:
            raise APIError(400, "two or more assistant messages end the conversation", param="messages")
        return Ending(False, True)
    return Ending(body.add_generation_prompt, False)


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    end: Ending = Ending(),
    check: LengthCheck | None = None,
) -> str:
    """The prompt text, ending as `end` says (by default, ready for the assistant's answer).
    A template that fails on the messages, or renders none, raises SpecdecodeError; `check`
    is given the rendering's length (a template may write far more than the messages hold)."""
    text = chat.render(
        tokenizer,
        _dicts(messages),
        template(tokenizer),
        add_generation_prompt=end.add_generation_prompt,
        continue_final_message=end.continue_final_message,
    )
    if check is not None:
        check(len(text), "messages", "rendered chat prompt")
    return text


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    end: Ending = Ending(),
    check: LengthCheck | None = None,
) -> list[int]:
    """The ids of the rendered prompt; `check` refuses a rendering too long before it is tokenized."""
    return chat.encode_rendered(tokenizer, render(tokenizer, messages, end, check))


def _dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text} for m in messages]
