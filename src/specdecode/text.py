"""Incremental detokenization with stop strings, for streaming text as tokens arrive.

Decoding a growing id list token by token is not a matter of decoding each id: byte-level
pieces can end inside a UTF-8 character, and some tokenizers drop a leading space when an
id is decoded alone. So each new piece is decoded together with a few preceding ids and
only the difference is kept (the offsets technique of vLLM and TGI). Text that could still
grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.backends import Backend

INCOMPLETE = "\ufffd"


class TextAssembler:
    def __init__(self, backend: Backend, stop: Sequence[str] = ()) -> None:
        self.backend = backend
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0  # characters of `text` already handed out

    def push(self, token: int) -> str:
        """Add one token; return the text that is now safe to show (may be "")."""
        self.ids.append(token)
        new = self._pending_text()
        if new and not new.endswith(INCOMPLETE):
            self._append(new)
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush at the end: text held back for a stop string, and the pieces that were waiting
        for the rest of a UTF-8 character (shown as U+FFFD, as a full decode shows them)."""
        if not self.stopped and self._read_offset < len(self.ids):
            self._append(self._pending_text())
            self._prefix_offset = self._read_offset = len(self.ids)
        return self._release(final=True)

    def _pending_text(self) -> str:
        """Text of the ids not yet read, decoded after the preceding ones for context."""
        prefix = self.backend.detokenize(self.ids[self._prefix_offset : self._read_offset])
        return self.backend.detokenize(self.ids[self._prefix_offset :])[len(prefix) :]

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
