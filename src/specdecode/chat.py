"""Chat prompts: messages rendered through a chat template, then tokenized; one code path for
`generate --chat`, `bench --chat` and the server's chat endpoint.

A template is Jinja, rendered as transformers' `apply_chat_template` renders it, with an open
assistant turn (add_generation_prompt). It comes from the model: a Hugging Face directory's
tokenizer (tokenizer_config.json or chat_template.jinja), a GGUF file's `tokenizer.chat_template`
metadata (which transformers' GGUF tokenizer reads); or from a file that overrides it.

Light on purpose: the command line builds its flags from here before torch loads.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.errors import SpecdecodeError, read_text_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REASON_CHARS = 300  # of the first line of a template's error


def own_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer's chat template (its default one, when it has several); None without one."""
    own = tokenizer.chat_template
    if isinstance(own, dict):
        own = own.get("default")
    return own or None


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, str]],
    template: str | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text, by default ready for the assistant's answer; `template` overrides the
    tokenizer's. A template is code from a file or a model: whatever it raises (a Jinja error,
    a division by zero, a range the sandbox refuses, a conversation it does not take), and a
    rendering of no text, is a SpecdecodeError."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except Exception as exc:  # the template's code may raise anything
        lines = str(exc).strip().splitlines()  # the first: transformers appends the rendered chat
        reason = f"{type(exc).__name__}: {lines[0][:REASON_CHARS]}" if lines else type(exc).__name__
        raise SpecdecodeError(f"the chat template failed on the messages: {reason}") from None
    if not isinstance(text, str) or not text:
        raise SpecdecodeError("the chat template rendered the messages as an empty prompt")
    return text


def encode_rendered(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids of a rendered prompt: BOS is added unless the template already wrote it (as most
    templates do), so a prompt never starts with two."""
    bos = tokenizer.bos_token
    return encode(tokenizer, text, add_special=not (bos and text.startswith(bos)))


def encode(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special: bool = True, parse_special: bool = True
) -> list[int]:
    """Token ids of `text`, as the backends tokenize it (parse_special False: the text of
    special tokens is tokenized as plain text)."""
    options = {} if parse_special else {"split_special_tokens": True}
    return list(tokenizer(text, add_special_tokens=add_special, **options)["input_ids"])


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], template: str | None = None
) -> list[int]:
    return encode_rendered(tokenizer, render(tokenizer, messages, template))


def no_template(model: str) -> SpecdecodeError:
    return SpecdecodeError(
        f"{model} has no chat template: give one with --chat-template-file FILE (a Jinja template)"
    )


def stored_template(path: str | os.PathLike) -> bool | None:
    """Whether a model on disk carries a chat template, read from its files in a fraction of a
    second, without loading it or transformers: a GGUF file's `tokenizer.chat_template`; a
    directory's chat_template.jinja, chat_template.json or tokenizer_config.json
    `chat_template` (a list of named templates counts where one is "default", as `own_template`
    reads it). None where the files do not tell (no GGUF magic, no tokenizer_config.json, a
    file that does not parse): the tokenizer decides once it is read."""
    from specdecode.gguf_header import chat_template

    path = Path(path)
    if path.is_file():
        try:
            return chat_template(path) is not None
        except SpecdecodeError:  # not a GGUF file, or a damaged one: loading it says which
            return None
    if not path.is_dir():
        return None
    if (path / "chat_template.jinja").is_file():
        return True
    for name in ("chat_template.json", "tokenizer_config.json"):
        if not (path / name).is_file():
            continue
        try:
            stored = json.loads((path / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):  # AttributeError: JSON but not an object
            return None
        if isinstance(stored, list):  # named templates: [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in stored if isinstance(t, dict)}
            stored = named.get("default")
        if isinstance(stored, str) and stored:
            return True
    return False if (path / "tokenizer_config.json").is_file() else None


@dataclass(frozen=True)
class ChatPrompt:
    """How the command line turns a plain prompt into a chat: the prompt is the user's message,
    after an optional system message, rendered through `template` (default: the model's)."""

    system: str | None = None
    template: str | None = None  # the text of a template that overrides the model's

    def messages(self, user: str | Sequence[str]) -> list[dict[str, str]]:
        """user: the user's message, or a conversation's turns (the user's messages and the
        assistant's answers alternating, the user's first and last)."""
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        turns = [user] if isinstance(user, str) else list(user)
        roles = ("user", "assistant")
        return [*system, *({"role": roles[i % 2], "content": turn} for i, turn in enumerate(turns))]

    def check(self, tokenizer: PreTrainedTokenizerBase, model: str) -> None:
        """An error for a model without a template when none is given."""
        if self.template is None and own_template(tokenizer) is None:
            raise no_template(model)

    def check_files(self, path: str | os.PathLike, model: str) -> None:
        """`check` from the model's files, before it loads (`stored_template`): a GGUF file's
        metadata, a directory's tokenizer files. Where they do not tell, `check` decides once
        the tokenizer is read."""
        if self.template is None and stored_template(path) is False:
            raise no_template(model)

    def text(self, tokenizer: PreTrainedTokenizerBase, user: str | Sequence[str], model: str) -> str:
        """The rendered prompt (of a message or a conversation, see `messages`); an error for a
        model without a template when none is given (`check`), or a template that fails on the
        messages."""
        self.check(tokenizer, model)
        return render(tokenizer, self.messages(user), self.template)


def add_chat_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, conversation: bool = False
) -> None:
    """llama.cpp's chat flags (-cnv, -sys, --chat-template-file); conversation: the command
    holds a conversation when -cnv comes with no prompt (generate)."""
    more = "; with no prompt and a terminal, a conversation (/exit ends it)" if conversation else ""
    parser.add_argument(
        "-cnv",
        "--chat",
        action="store_true",
        help=f"the prompt is a user's message: render it through the model's chat template{more}",
    )
    parser.add_argument("-sys", "--system-prompt", metavar="TEXT", help="--chat: a system message first")
    parser.add_argument(
        "--chat-template-file",
        metavar="FILE",
        help="--chat: a Jinja chat template used in place of the model's",
    )


def chat_from_args(args: argparse.Namespace) -> ChatPrompt | None:
    """The chat the flags ask for, None without --chat; -sys or a template file without --chat is
    a mistake (they would be silently ignored)."""
    if not args.chat:
        given = {"-sys/--system-prompt": args.system_prompt, "--chat-template-file": args.chat_template_file}
        for flag, value in given.items():
            if value is not None:
                raise SpecdecodeError(f"{flag} applies to a chat: add --chat")
        return None
    template = None
    if args.chat_template_file is not None:
        template = read_text_file(args.chat_template_file, "chat template file")
        if not template.strip():
            raise SpecdecodeError(f"the chat template file {args.chat_template_file} is empty")
    return ChatPrompt(args.system_prompt, template)
