"""Prompts as llama-server and OpenAI's completions take them: text, token ids, text and ids
mixed, or a list of such prompts, each answered on its own.

A list is one prompt when it holds ids (with or without text): `[1, 2]`, `["def f", 3]`; a
list of texts, or of lists, is several prompts: `["a", "b"]`, `[[1, 2], "b"]` (llama-server's
reading). Several prompts run as requests of their own, side by side in the slots; their answers
come back in the prompts' order: a list on /completion, one choice each (OpenAI's `index`) on
/v1/completions.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from specdecode.chat import encode

OnePrompt = str | list[str | int]
MAX_PROMPTS = 64  # prompts in one request: each is a generation, which waits for a slot


def split_prompts(prompt: str | list) -> list[OnePrompt]:
    """The prompts a request's `prompt` holds (one, unless it is a list of texts or lists)."""
    if isinstance(prompt, str) or any(isinstance(part, int) for part in prompt):
        return [prompt]
    return list(prompt)


def mixed_ids(tokenizer: PreTrainedTokenizerBase, parts: Sequence[str | int]) -> list[int]:
    """Ids of a prompt of text and ids: each text tokenized, the special tokens (BOS) added only
    when the prompt starts with text, as llama-server does."""
    ids: list[int] = []
    for position, part in enumerate(parts):
        if isinstance(part, int):
            ids.append(part)
        else:
            ids += encode(tokenizer, part, add_special=position == 0)
    return ids


def merged_choices(answers: Sequence[dict]) -> dict:
    """One OpenAI completion from the answers to each prompt: their choices in order, numbered
    anew, and their usage summed."""
    merged = dict(answers[0])
    choices = [choice for answer in answers for choice in answer["choices"]]
    merged["choices"] = [{**choice, "index": index} for index, choice in enumerate(choices)]
    usage = merged.get("usage")
    if usage is not None:
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        merged["usage"] = {
            **usage,
            **{key: sum(answer["usage"][key] for answer in answers) for key in counts},
        }
    return merged
