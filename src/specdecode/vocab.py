"""Can the draft's tokens be fed to the target as they are, and if not, how to translate them.

The compatibility rules are llama.cpp's (`common_speculative_are_compatible`); translation
through text is its classic `--spec-replace` path (Hugging Face calls it universal assisted
generation): detokenize with one vocabulary, apply replacements, tokenize with the other.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.backends import Backend

MAX_SIZE_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE
FIRST_CHECKED_ID = 5  # SPEC_VOCAB_CHECK_START_TOKEN_ID: ids below are often control tokens


def vocab_difference(target: Backend, draft: Backend) -> str | None:
    """The first reason the two vocabularies are incompatible, or None if they match."""
    tv, dv = target.vocab, draft.vocab
    if tv.kind != dv.kind:
        return f"vocabulary types differ: target {tv.kind}, draft {dv.kind}"
    if tv.add_bos != dv.add_bos or (tv.add_bos and tv.bos_id != dv.bos_id):
        return f"BOS differs: target add={tv.add_bos} id={tv.bos_id}, draft add={dv.add_bos} id={dv.bos_id}"
    if tv.add_eos != dv.add_eos or (tv.add_eos and tv.eos_id != dv.eos_id):
        return f"EOS differs: target add={tv.add_eos} id={tv.eos_id}, draft add={dv.add_eos} id={dv.eos_id}"
    if abs(tv.size - dv.size) > MAX_SIZE_DIFFERENCE:
        return (
            f"vocabulary sizes differ by {abs(tv.size - dv.size)} (target {tv.size}, draft {dv.size}; "
            f"at most {MAX_SIZE_DIFFERENCE} allowed)"
        )
    for token_id in range(FIRST_CHECKED_ID, min(tv.size, dv.size)):
        a, b = target.token_text(token_id), draft.token_text(token_id)
        if a != b:
            return f"token {token_id} differs: target {a!r}, draft {b!r}"
    return None


class VocabTranslator:
    """Maps token ids between two vocabularies through text, with string replacements.

    `replacements` are (target text, draft text) pairs: applied left to right, all
    occurrences, towards the draft; reversed on the way back.
    """

    def __init__(self, target: Backend, draft: Backend, replacements: Sequence[tuple[str, str]] = ()):
        self.target = target
        self.draft = draft
        self.replacements = list(replacements)

    def to_draft(self, ids: Sequence[int]) -> list[int]:
        """Target ids -> draft ids; the draft gets its own BOS when it normally adds one."""
        text = self.target.detokenize(ids, skip_special=True)
        for target_text, draft_text in self.replacements:
            text = text.replace(target_text, draft_text)
        converted = self.draft.tokenize(text, add_special=False)
        vocab = self.draft.vocab
        return [vocab.bos_id, *converted] if vocab.add_bos and vocab.bos_id is not None else converted

    def to_target(self, ids: Sequence[int]) -> list[int]:
        """Draft ids (a continuation) -> target ids."""
        text = self.draft.detokenize(ids, skip_special=True)
        for target_text, draft_text in self.replacements:
            text = text.replace(draft_text, target_text)
        return self.target.tokenize(text, add_special=False) if text else []
