"""One sampler for plain and speculative generation alike.

The transform follows llama.cpp's default chain: logit bias -> penalties -> top-k -> top-p -> min-p ->
temperature -> draw. It is a pure function of (logits, history); the only state a
`Sampler` holds is its random generator, and it takes exactly one uniform draw per token
it samples. That is what lets `match` verification reproduce plain generation token for
token at any temperature: both consume the same draws in the same order.

A row in which nothing may be drawn (every logit -inf once a grammar's mask and the logit bias
are applied: the bias bans every token the grammar allows) samples NO_TOKEN, without a draw;
the generation ends there ("no allowed token"), in plain and speculative generation alike.

The candidates come in two stages: stage 1 (bias, then the argmax, or the top-k) reads the whole
vocabulary; stage 2 (top-p, min-p, temperature) reads only what stage 1 kept. Stage 1 can run
for every row of a pass where the logits are (`reduce_rows`, on a GPU), so that only a few
numbers per row come back to the host; the sampler reads such a `ReducedRow` as it reads the
full row, with the same result bit for bit (`reducible` says when that holds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.config import SamplingParams

NO_TOKEN = -1  # what a row that allows no token samples: the generation ends there


@dataclass(frozen=True)
class ReducedRow:
    """Stage 1 of a row's candidates (see the module docstring), made by `reduce_rows`: the
    values it kept (float64, descending; ties by ascending id) and their ids. Greedy settings
    keep one (the argmax, the lowest id among equals); sampling keeps the top-k."""

    values: torch.Tensor  # [k] float64
    ids: torch.Tensor  # [k] long
    vocab: int  # V, the full row's length


Row = torch.Tensor | ReducedRow  # a logits row [V], or its stage 1


def row_vocab(row: Row) -> int:
    """V, the length of the full row."""
    return row.vocab if isinstance(row, ReducedRow) else row.shape[-1]


def reducible(params: SamplingParams, vocab: int) -> bool:
    """Whether stage 1 may run away from the history (`reduce_rows`) and keep few values: not
    under penalties (each row's depend on the context of its node), nor where the logit bias
    names an id twice (a GPU adds both in either order: the rounding could differ), nor where
    sampling keeps the whole vocabulary (top-k 0, or at least V)."""
    unique_bias = len({token for token, _ in params.logit_bias}) == len(params.logit_bias)
    return not params.has_penalties and unique_bias and (params.greedy or 0 < params.top_k < vocab)


def reduce_rows(logits: torch.Tensor, params: SamplingParams) -> list[ReducedRow]:
    """Stage 1 of every row of logits [R, V] (float32 or float64, as the host's rows are) on
    their device, in batched operations, and one copy of the small results to the host.

    Greedy: the argmax and its value (the first maximum, as on the host). Sampling: the
    top-k, ordered by value then id (off the CPU by `top_k_keyed`, in one topk without a host
    synchronisation; on it by `top_k_rows`, as the host path, where that costs a tenth).
    Callers check `reducible` first: penalties are not applied here."""
    rows, vocab = logits.shape
    x = apply_bias(logits, params)
    if params.greedy:
        ids = _argmax(x)[:, None]  # [R, 1]
        values = x.gather(-1, ids).to(torch.float64)
    else:
        k = params.top_k if 0 < params.top_k < vocab else vocab
        keyed = x.device.type != "cpu" and x.dtype != torch.float64  # a CPU's sync costs nothing
        values, ids = top_k_keyed(x, k) if keyed else top_k_rows(x, k)
    packed = torch.stack([values, ids.to(torch.float64)]).cpu()  # ids < 2**53: exact
    return [ReducedRow(packed[0, r], packed[1, r].long(), vocab) for r in range(rows)]


def top_k_keyed(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k_rows` for rows of float32 or narrower (exact in float32), in one topk without a
    host synchronisation: each value's order-preserving 32-bit key, above 32 bits that rank
    the ids in reverse, makes every key unique, so any topk returns the same k in the same
    order. The values come back as float64."""
    x = x.float()
    bits = (x + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 ranks as 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negatives ordered as their values
    reverse_ids = torch.arange(x.shape[-1] - 1, -1, -1, device=x.device)
    ids = torch.topk(ordered * 2**32 + reverse_ids, k, dim=-1).indices
    return x.gather(-1, ids).to(torch.float64), ids


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [R, V] and their ids, by descending value and,
    among equal values, ascending id: the first k of a stable sort. torch.topk promises no
    order among ties (a GPU's and a CPU's differ), and which of several equal values top-k
    or top-p keeps must not depend on the device. A topk nonetheless (a stable sort of the
    vocabulary takes several times its time), put in that order where values tie."""
    vocab = x.shape[-1]
    if k >= vocab:
        values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return values, ids
    values, ids = torch.topk(x, k + 1, dim=-1)  # one more than kept: is a tie cut at the k-th?
    cut = (values[:, k] == values[:, k - 1]).nonzero()[:, 0].tolist()
    values, ids = values[:, :k], ids[:, :k]
    for r in cut:  # the values above the k-th, then the lowest ids of those equal to it
        floor = values[r, -1]
        above = ids[r][values[r] > floor]  # every value above the k-th is kept
        ids[r] = torch.cat([above, _equal_ids(x[r], floor)[: k - len(above)]])
        values[r] = x[r, ids[r]]
    if not bool((values[:, 1:] == values[:, :-1]).any()):
        return values, ids  # no ties among the kept: topk's order is the sort's
    by_id = torch.argsort(ids, dim=-1)
    ids, values = ids.gather(-1, by_id), values.gather(-1, by_id)
    order = torch.argsort(values, dim=-1, descending=True, stable=True)
    return values.gather(-1, order), ids.gather(-1, order)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row of x [R, V]: numpy's on a CPU (as `greedy_token`'s)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(-1))
    return torch.argmax(x, dim=-1)


def _equal_ids(row: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The ids of row [V] whose value is `value`, ascending: numpy's on a CPU (a fifth of the
    time of PyTorch's there)."""
    if row.device.type == "cpu" and row.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.flatnonzero(row.detach().numpy() == value.detach().numpy()))
    return torch.nonzero(row == value)[:, 0]


def apply_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits with `params.logit_bias` added, first in the chain as in llama.cpp's; ids past
    the row (a draft's smaller vocabulary) are skipped. logits: [V], or rows [R, V] (each as
    alone); `logits` itself without a bias.

    A sum past the largest finite value of the logits' dtype is that value: a huge bias makes
    its token certain (ties share), and never lifts a token a grammar keeps out (-inf + inf
    would be NaN)."""
    vocab = logits.shape[-1]
    pairs = [(token, bias) for token, bias in params.logit_bias if token < vocab]
    if not pairs:
        return logits
    largest = torch.finfo(logits.dtype).max
    ids = torch.tensor([token for token, _ in pairs], dtype=torch.long)
    biases = torch.tensor([min(bias, largest) for _, bias in pairs], dtype=logits.dtype, device=logits.device)
    biases = biases.expand(*logits.shape[:-1], len(pairs))
    return logits.index_add(-1, ids.to(logits.device), biases).clamp_(max=largest)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """Repetition, presence and frequency penalties over the last `repeat_last_n` tokens.

    logits: [V]. Returns a new tensor when a penalty applies, else `logits` itself.
    """
    if not params.has_penalties or not history:
        return logits
    window = history if params.repeat_last_n == -1 else history[-params.repeat_last_n :]
    vocab = logits.shape[-1]
    ids = torch.tensor([t for t in window if 0 <= t < vocab], dtype=torch.long)
    counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)  # [V]
    seen = counts > 0
    out = logits.clone()
    if params.repeat_penalty != 1.0:
        penalised = torch.where(out > 0, out / params.repeat_penalty, out * params.repeat_penalty)
        out = torch.where(seen, penalised, out)
    return out - counts * params.frequency_penalty - seen.to(out.dtype) * params.presence_penalty


def greedy_token(logits: Row, params: SamplingParams, history: Sequence[int]) -> int:
    """Argmax after penalties (ties go to the lowest id, in numpy as in PyTorch); NO_TOKEN where
    every score is -inf. numpy's on a CPU row of float32 or float64 (a tenth of PyTorch's time
    on a vocabulary-long row, paid for every token), PyTorch's elsewhere; a reduced row's first."""
    if isinstance(logits, ReducedRow):
        _check_reduced(params)
        return NO_TOKEN if float(logits.values[0]) == -math.inf else int(logits.ids[0])
    scores = apply_penalties(apply_bias(logits, params), params, history)
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        row = scores.detach().numpy()
        best = int(row.argmax())
        return NO_TOKEN if row[best] == -math.inf else best
    best = int(torch.argmax(scores))
    return NO_TOKEN if float(scores[best]) == -math.inf else best


def distribution(logits: Row, params: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """The probabilities the sampler draws from: [V] float64, zero outside the kept candidates.

    Greedy settings give a one-hot vector at the greedy token; a row that allows no token, zeros.
    """
    ids, probs = candidates(logits, params, history)
    out = torch.zeros(row_vocab(logits), dtype=torch.float64)
    out[ids] = probs
    return out


def candidates(
    logits: Row, params: SamplingParams, history: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids the sampler may draw, ascending, and their probabilities (float64): the nonzero
    part of `distribution`, at most top-k long, so that a draw need not walk the vocabulary.
    Empty where the row allows no token (every logit -inf)."""
    reduced = isinstance(logits, ReducedRow)
    assert reduced or logits.ndim == 1, f"expected logits [V], got {tuple(logits.shape)}"
    nothing = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
    if params.greedy:
        token = greedy_token(logits, params, history)
        return nothing if token == NO_TOKEN else (torch.tensor([token]), torch.ones(1, dtype=torch.float64))
    if isinstance(logits, ReducedRow):
        _check_reduced(params)
        values, ids = logits.values, logits.ids
    else:
        vocab = logits.shape[0]
        x = apply_penalties(apply_bias(logits, params), params, history).to(torch.float64)
        k = params.top_k if 0 < params.top_k < vocab else vocab
        values, ids = (part[0] for part in top_k_rows(x[None], k))
    return _narrowed(values, ids, params)


def _narrowed(
    values: torch.Tensor, ids: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: top-p, min-p and temperature over stage 1's values (float64, descending) -> the
    kept ids, ascending, and their probabilities."""
    if values[0] == -math.inf:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
    keep = len(values)
    if params.top_p < 1.0:
        cumulative = torch.cumsum(torch.softmax(values, dim=0), dim=0)
        keep = min(
            keep, int(torch.searchsorted(cumulative, torch.tensor([params.top_p], dtype=torch.float64))) + 1
        )
    if params.min_p > 0.0:
        floor = values[0] + math.log(params.min_p)
        keep = min(keep, max(1, int((values >= floor).sum())))
    probs = torch.softmax(values[:keep] / params.temperature, dim=0)
    order = torch.argsort(ids[:keep])
    return ids[:keep][order], probs[order]


def _check_reduced(params: SamplingParams) -> None:
    assert not params.has_penalties, "a reduced row carries no penalties: they read each row's history"


class Sampler:
    """Draws tokens with a seeded generator; one uniform draw per sampled token (none when greedy)."""

    def __init__(self, params: SamplingParams, stream: int = 0) -> None:
        """stream: 0, the seed's own stream (plain generation's); k > 0, the k-th stream spawned
        from the seed (numpy's SeedSequence), independent of every seed's own stream and of the
        other spawned ones, which seed + k would not be (it is the next seed's own stream)."""
        self.params = params
        self.seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
        entropy = self.seed if stream == 0 else np.random.SeedSequence(self.seed, spawn_key=(stream - 1,))
        self._rng = np.random.default_rng(entropy)

    def uniform(self) -> float:
        """One draw from U[0, 1)."""
        return float(self._rng.random())

    def draw(self, probs: torch.Tensor) -> int:
        """Sample an id from probs [V] (need not be normalised) by inverse CDF, using one draw;
        NO_TOKEN, without a draw, where no id has mass."""
        return self.draw_among(torch.arange(len(probs)), probs)

    def draw_among(self, ids: torch.Tensor, probs: torch.Tensor) -> int:
        """Sample one of `ids` (ascending) by their probs (need not be normalised), using one
        draw: the id `draw` gives for the [V] vector holding probs at ids and zeros elsewhere,
        since its running sums are these sums (adding a zero rounds nothing) held flat.
        NO_TOKEN, without a draw, where no id has mass."""
        cumulative = torch.cumsum(probs.to(torch.float64), dim=0)
        if not len(ids) or not float(cumulative[-1]) > 0.0:
            return NO_TOKEN
        target = torch.tensor([self.uniform() * float(cumulative[-1])], dtype=torch.float64)
        index = int(torch.searchsorted(cumulative, target, right=True))
        if index < len(ids):  # the sum rose there: the id has mass
            return int(ids[index])
        # Past the end only when the draw equals the total: the last id with mass.
        return int(ids[torch.nonzero(probs)[-1]])

    def sample(self, logits: Row, history: Sequence[int]) -> int:
        """The next token for logits [V] (or their `ReducedRow`) after `history` (greedy takes no
        draw); NO_TOKEN where the row allows none."""
        if self.params.greedy:
            return greedy_token(logits, self.params, history)
        return self.draw_among(*candidates(logits, self.params, history))
