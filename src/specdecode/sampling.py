"""One sampler for plain and speculative generation alike.

The transform follows llama.cpp's default chain: logit bias -> penalties -> top-k -> top-p -> min-p ->
temperature -> draw. It is a pure function of (logits, history); the only state a
`Sampler` holds is its random generator, and it takes exactly one uniform draw per token
it samples. That is what lets `match` verification reproduce plain generation token for
token at any temperature: both consume the same draws in the same order.

A row in which nothing may be drawn (every logit -inf once a grammar's mask and the logit bias
are applied: the bias bans every token the grammar allows) samples NO_TOKEN, without a draw;
the generation ends there ("no allowed token"), in plain and speculative generation alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from specdecode.config import SamplingParams

NO_TOKEN = -1  # what a row that allows no token samples: the generation ends there


def apply_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits with `params.logit_bias` added, first in the chain as in llama.cpp's; ids past
    the row (a draft's smaller vocabulary) are skipped. logits: [V]; `logits` itself without a bias.

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
    return logits.index_add(0, ids.to(logits.device), biases).clamp_(max=largest)


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


def greedy_token(logits: torch.Tensor, params: SamplingParams, history: Sequence[int]) -> int:
    """Argmax after penalties (ties go to the lowest id, in numpy as in PyTorch); NO_TOKEN where
    every score is -inf. numpy's on a CPU row of float32 or float64 (a tenth of PyTorch's time
    on a vocabulary-long row, paid for every token), PyTorch's elsewhere."""
    scores = apply_penalties(apply_bias(logits, params), params, history)
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        row = scores.detach().numpy()
        best = int(row.argmax())
        return NO_TOKEN if row[best] == -math.inf else best
    best = int(torch.argmax(scores))
    return NO_TOKEN if float(scores[best]) == -math.inf else best


def distribution(logits: torch.Tensor, params: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """The probabilities the sampler draws from: [V] float64, zero outside the kept candidates.

    Greedy settings give a one-hot vector at the greedy token; a row that allows no token, zeros.
    """
    ids, probs = candidates(logits, params, history)
    out = torch.zeros(logits.shape[0], dtype=torch.float64)
    out[ids] = probs
    return out


def candidates(
    logits: torch.Tensor, params: SamplingParams, history: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids the sampler may draw, ascending, and their probabilities (float64): the nonzero
    part of `distribution`, at most top-k long, so that a draw need not walk the vocabulary.
    Empty where the row allows no token (every logit -inf)."""
    assert logits.ndim == 1, f"expected logits [V], got {tuple(logits.shape)}"
    vocab = logits.shape[0]
    nothing = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
    if params.greedy:
        token = greedy_token(logits, params, history)
        return nothing if token == NO_TOKEN else (torch.tensor([token]), torch.ones(1, dtype=torch.float64))
    x = apply_penalties(apply_bias(logits, params), params, history).to(torch.float64)
    k = params.top_k if 0 < params.top_k < vocab else vocab
    values, ids = torch.topk(x, k)  # sorted, descending
    if values[0] == -math.inf:
        return nothing
    keep = k
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

    def sample(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """The next token for logits [V] after `history` (greedy takes no draw); NO_TOKEN where
        the row allows none."""
        if self.params.greedy:
            return greedy_token(logits, self.params, history)
        return self.draw_among(*candidates(logits, self.params, history))
