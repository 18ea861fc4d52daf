"""Tokenizing and detokenizing off the event loop.

Tokenizing a text of a few megabytes takes seconds; on the event loop it would stall every
stream and /health for as long. So the work runs in worker threads, each with its own copy
of the tokenizer (a fast tokenizer must not be used from two threads at once), and a text
that cannot fit the context is refused before any of it is tokenized (`max_chars`).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from specdecode.generate import chars_per_token
from specdecode.server.errors import exceeds_context

T = TypeVar("T")


class Tokenizers:
    """A pool of threads that run functions of a tokenizer, each thread on its own copy."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, threads: int, n_ctx: int) -> None:
        self._template = tokenizer
        self._copying = threading.Lock()
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        entries = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.n_ctx = n_ctx
        self.max_chars = n_ctx * chars_per_token(entries)  # a longer text has more than n_ctx tokens

    def check_length(self, n_chars: int, param: str, what: str | None = None) -> None:
        """Refuse a text that no tokenization could fit into the context. what: the text's name
        in the message (default: the request's field, `param`). Called from worker threads too."""
        if n_chars > self.max_chars:
            raise exceeds_context(
                f"the {what or param} is {n_chars} characters: more than the context's {self.n_ctx} "
                f"tokens can hold (at most {self.max_chars} characters are tokenized)",
                param,
                self.n_ctx,
            )

    async def run(self, work: Callable[..., T], *args: object) -> T:
        """work(tokenizer, *args) in a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, work, args)

    def _call(self, work: Callable[..., T], args: tuple) -> T:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            with self._copying:
                tokenizer = self._local.tokenizer = copy.deepcopy(self._template)
        return work(tokenizer, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special: bool = False) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


def pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[dict[str, int | str]]:
    """llama-server's /tokenize with_pieces: each id with the text it decodes to alone."""
    return [{"id": token, "piece": decode(tokenizer, [token])} for token in ids]
