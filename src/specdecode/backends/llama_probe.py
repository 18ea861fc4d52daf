"""llama.cpp's row-invariance probe: whether a row gets the same bits in a pass of several rows
as alone, what that allows a pass, and the verdict kept across runs.

Apart from the backend (`specdecode.backends.llama_cpp`) because it is one question asked of a
loaded model, with constants and a cache entry of its own: `RowProbe` is what the backend class
takes from here, and the probe's passes run through the backend's own `evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.backends import pass_cache

# The row-invariance probe: after PROBE_CONTEXT tokens of this text, one pass of each row count
# in PROBE_PASSES (verify passes of drafts up to 16 long; kernels switch paths at multiples of
# 2, 4 and 8 rows), each over the next tokens, against the same rows one at a time. Then, at
# cache lengths from PROBE_CONTEXT up to the context (`probe_lengths`), passes of every size in
# WIDE_PASSES against PROBE_ROWS rows scored one at a time: llama.cpp's kernels also switch
# with the cached cells (its CPU flash attention splits a one-row pass over 512 cells or more
# among its threads) and past 63 rows (flash attention's tiles of 64 query rows), so passes are
# vouched for only at the lengths and sizes seen to agree (ngram-mod verifies up to 65 rows).
PROBE_TEXT = (
    "import os\n\n\ndef read_lines(path, encoding='utf-8'):\n"
    '    """Return the lines of a text file, without their line ends."""\n'
    "    with open(path, encoding=encoding) as handle:\n"
    "        return [line.rstrip('\\n') for line in handle]\n\n\n"
    "def count_words(lines):\n    total = 0\n    for line in lines:\n"
    "        total += len(line.split())\n    return total\n"
)
PROBE_CONTEXT = 8
PROBE_PASSES = (2, 3, 4, 5, 7, 8, 9, 16, 17)
WIDE_PASSES = (*PROBE_PASSES, 33, 63, 64, 65)
PROBE_ROWS = 17  # rows scored one at a time at each probed length
CLASS_PASS = 130  # beside the wide passes: do all passes past the vouched size round alike?
PROBE_FIRST_LENGTH = 320  # past 256 cells: llama.cpp pads the cells a pass reads to 256
PROBE_LONGEST = 4096  # the probe's fill costs a prompt this long at most
PROBE_FORMAT = 2  # of the probe's stored verdicts (see RowProbe.invariant)


@dataclass(frozen=True)
class RowAgreement:
    """How the rows of multi-row passes compare with the same rows scored one at a time."""

    rows: int
    identical: int  # rows whose logits are bit-identical
    same_argmax: int  # rows with the same greedy choice

    @property
    def invariant(self) -> bool:
        return self.identical == self.rows

    def __add__(self, other: RowAgreement) -> RowAgreement:
        return RowAgreement(
            self.rows + other.rows, self.identical + other.identical, self.same_argmax + other.same_argmax
        )

    @classmethod
    def of(cls, together: torch.Tensor, alone: torch.Tensor) -> RowAgreement:
        return cls(
            len(together),
            int((together == alone).all(-1).sum()),
            int((together.argmax(-1) == alone.argmax(-1)).sum()),
        )


def probe_lengths(n_ctx: int) -> list[int]:
    """The cache lengths the row-invariance probe passes at in a context of n_ctx cells: the
    short PROBE_CONTEXT, then from PROBE_FIRST_LENGTH doubling, and the last length whose
    widest pass still fits the context (or PROBE_LONGEST, past which it costs too much)."""
    room = min(n_ctx, PROBE_LONGEST) - max(WIDE_PASSES)
    lengths, length = [PROBE_CONTEXT], PROBE_FIRST_LENGTH
    while length < room:
        lengths.append(length)
        length *= 2
    if room > lengths[-1]:
        lengths.append(room)
    return lengths


class RowProbe:
    """The probe and its verdicts, for the llama.cpp backend class (`LlamaCppBackend`), which
    provides `model` (a `specdecode.backends.llama_model.LlamaModel`, which keeps the verdict),
    `name`, `n_ctx`, `exact`, `tokenize`, `evaluate`, `truncate`, `tokens` and `_probe_backend`
    (a backend over the same model in a context of its own)."""

    @property
    def invariant(self) -> bool:
        """Whether llama.cpp gives a row the same bits in passes of up to max(PROBE_PASSES) rows
        (a default draft's verify pass) as alone, at every cache length the probe passed at
        (see `probe_invariance`, run once per loaded model on first use): what makes
        speculative output equal plain output bit for bit rather than up to a near-tie. Only
        the target's rows decide the output. Longer passes may still be capped (`row_cap`)."""
        return self._probed_rows() >= max(PROBE_PASSES)

    def _probed_rows(self) -> int:
        """The probe's `invariant_rows`, probing on first use. The verdict is kept with the pass
        timings (see `specdecode.backends.pass_cache`), keyed by the file, the repacking, the threads, the
        context, the machine and llama.cpp's libraries and switches, so that the probe runs
        once per such key rather than at every start."""
        if self.model.probe is None:
            key = self._probe_key()
            stored = pass_cache.read_value(key, "probe") if key is not None else None
            try:
                probe, rows, wide = RowAgreement(*stored[:3]), int(stored[3]), bool(stored[4])
                probed = False
            except (TypeError, ValueError, IndexError):  # nothing stored, or not a verdict
                if self.model.progress is not None:  # passes at up to PROBE_LONGEST cells: a while
                    self.model.progress(
                        f"checking that llama.cpp's multi-row passes give {self.name} the rows of "
                        "one-row passes (once per model and machine)"
                    )
                probe = self.probe_invariance()
                rows, wide = self.model.invariant_rows, self.model.wide_rows_agree
                probed = True
            self.model.probe, self.model.invariant_rows, self.model.wide_rows_agree = probe, rows, wide
            if probed:
                self.keep_verdict()
        return self.model.invariant_rows

    def keep_verdict(self) -> None:
        """Store the probe's verdict under this model's key, where it has one: also called once
        a file probed before it reached its place is there (`specdecode.backends.hf_gguf`)."""
        probe, key = self.model.probe, self._probe_key()
        if probe is not None and key is not None:
            rows, wide = self.model.invariant_rows, self.model.wide_rows_agree
            verdict = [probe.rows, probe.identical, probe.same_argmax, rows, wide]
            pass_cache.write_value(key, "probe", verdict)

    def _probe_key(self) -> dict[str, object] | None:
        key = pass_cache.cache_key(self, WIDE_PASSES) if pass_cache.enabled() else None
        if key is None:
            return None
        return {**key, "n_ctx": probe_lengths(self.n_ctx), "probe": PROBE_FORMAT, "text": PROBE_TEXT}

    @property
    def row_cap(self) -> int | None:
        """The most rows a pass after the prompt may hold for its rows to get the bits plain
        generation gives them, where exactness is asked for and the probe found the rows
        invariant only up to some pass size (at least 1: then nothing is drafted); None where
        passes of any probed size agree, or speed was asked for over exactness."""
        if not self.exact:
            return None
        rows = self._probed_rows()
        return None if rows >= max(WIDE_PASSES) else max(1, rows)

    @property
    def vouched_rows(self) -> int | None:
        """The most rows of a pass whose rows get the bits they get in any other pass, where
        exactness is asked for: the row cap, or where every probed pass agreed the largest pass
        the probe tried (rows of far larger passes have differed on files whose probed passes
        agreed, see `specdecode.backends.llama_cpp`); None where speed was asked for over exactness."""
        if not self.exact:
            return None
        cap = self.row_cap
        return max(WIDE_PASSES) if cap is None else cap

    def row_cap_note(self) -> str | None:
        """What a speculative run on this model is told when its drafts are capped below a
        default draft's length (a cap on longer drafts only, such as ngram-mod's, goes unsaid):
        short, the why is in docs/gguf.md (`specdecode.verdicts.start_verdicts` adds the flag)."""
        cap = self.row_cap
        if cap is None or cap >= max(PROBE_PASSES):
            return None
        if cap == 1:
            return "nothing is drafted, for exact output"
        return f"drafts held to {cap - 1} tokens for exact output"

    def row_variance_warning(self, trees: bool) -> str | None:
        """What a speculative run on this model should be told when its rows are not invariant
        and exactness was given up (--passes bucketed; `trees`, whether it may draft trees,
        changes nothing: any multi-row pass may vary)."""
        if self.exact or self._probed_rows() >= max(WIDE_PASSES):
            return None
        probe = self.model.probe
        return (
            f"llama.cpp rounds {probe.rows - probe.identical} of {probe.rows} probed rows of {self.name} "
            "differently in passes of several rows: with --passes bucketed, output can differ from plain "
            "output where two tokens almost tie (see docs/gguf.md)"
        )

    def probe_invariance(self) -> RowAgreement:
        """Passes of the row counts in PROBE_PASSES, each over the next positions of a greedy
        continuation, against the rows plain generation scored for it one at a time, bit for
        bit; then passes of every size in WIDE_PASSES at each cache length of `probe_lengths`
        (up to this backend's context), against PROBE_ROWS rows scored one at a time there.
        Which kernel llama.cpp runs depends on the build, the weight types, the repacking, the
        threads, the row count and the cells cached, and some round differently only for some
        inputs: hence new rows for every short pass, from the model's own text. A pass size is
        vouched for (`invariant_rows`) where it and every smaller probed size agreed at every
        length. In a context of its own: this backend's cache is untouched."""
        ids = self.tokenize(PROBE_TEXT)[:PROBE_CONTEXT]
        context, needed = len(ids), len(ids) + sum(PROBE_PASSES)
        lengths = probe_lengths(self.n_ctx)
        probe = self._probe_backend(max(needed, lengths[-1] + CLASS_PASS))
        rows = [probe.evaluate(ids)[-1]]
        while len(ids) < needed:
            ids.append(int(rows[-1].argmax()))
            rows.append(probe.evaluate(ids[-1:])[-1])
        alone = torch.stack(rows[1:])  # position context + i
        agreement, start, agreed = RowAgreement(0, 0, 0), context, dict.fromkeys(WIDE_PASSES, True)
        for k in PROBE_PASSES:
            probe.truncate(start)
            this_pass = RowAgreement.of(probe.evaluate(ids[start : start + k]), alone[start - context :][:k])
            agreed[k] &= this_pass.invariant
            agreement += this_pass
            start += k
        text = self.tokenize(PROBE_TEXT)
        filler = [text[i % len(text)] for i in range(lengths[-1] + CLASS_PASS)]
        probe.truncate(0)
        firsts: list[dict[int, torch.Tensor]] = []  # per length: each pass's first rows
        for length in lengths:
            probe.truncate(length)
            if len(probe.tokens) < length:
                probe.evaluate(filler[len(probe.tokens) : length])
            alone = torch.cat([probe.evaluate([token]) for token in filler[length : length + PROBE_ROWS]])
            firsts.append({})
            for k in (*WIDE_PASSES, CLASS_PASS):
                probe.truncate(length)
                together = probe.evaluate(filler[length : length + k])[:PROBE_ROWS]
                firsts[-1][k] = together
                if k in agreed:
                    this_pass = RowAgreement.of(together, alone[: len(together)])
                    agreed[k] &= this_pass.invariant
                    agreement += this_pass
        self.model.invariant_rows = 0
        for k in sorted(agreed):
            if not agreed[k]:
                break
            self.model.invariant_rows = k
        wide = [k for k in (*WIDE_PASSES, CLASS_PASS) if k > self.model.invariant_rows]
        common = min(PROBE_ROWS, wide[0])
        self.model.wide_rows_agree = all(
            torch.equal(rows[k][:common], rows[wide[0]][:common]) for rows in firsts for k in wide
        )
        return agreement
