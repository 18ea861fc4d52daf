"""Fitting a draft's confidence to the chance that the target agrees with it.

The draft-model strategy stops drafting at the first token whose top-1 probability (a softmax
over the draft's 10 largest logits) is below p_min: it reads that number as the chance that the
target keeps the token. Distillation teaches the draft the target's *distribution*; when the
target itself spreads its probability (a small target), the draft's top-1 probability is far
below how often its argmax equals the target's, and drafting stops long before it should. (The
bundled pair before calibration: 0.47 mean top-1 probability against 72% agreement, so that at
the default p_min 0.75 it drafted 0.3 tokens per step, all of them accepted.)

One scalar fixes that: the logits are multiplied by β (temperature scaling), with β chosen by
maximum likelihood of the agreement events — "the target's argmax equals the draft's", read off
teacher-forced windows of the training data — under the draft's top-1 probability. β is baked
into the weight of the draft's final RMSNorm, which multiplies the logits exactly: the saved
draft is a plain Llama, and its argmax, hence every greedy draft, is unchanged.

The fit, the windows and the summary are shared with EAGLE-3 heads (`specdecode.train.calibrate_eagle3`),
whose drafting reads the same top-1 probability.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import PreTrainedModel

from specdecode.errors import SpecdecodeError
from specdecode.strategies.draft_model import CONFIDENCE_TOP_K

LOG_SCALE_RANGE = (-3.0, 3.0)  # β from 0.05 to 20


@torch.no_grad()
def agreement_sample(
    target: PreTrainedModel, draft: PreTrainedModel, windows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every position of `windows` [W, T]: the draft's 10 largest logits [N, 10] (float64)
    and whether the draft's argmax equals the target's [N] (bool)."""
    tops, agreements = [], []
    for window in windows:
        ids = window[None].to(next(draft.parameters()).device)
        target_logits = target(input_ids=ids).logits[0].float()  # [T, V]
        draft_logits = draft(input_ids=ids).logits[0].float()  # [T, V]
        agreements.append((target_logits.argmax(-1) == draft_logits.argmax(-1)).cpu())
        k = min(CONFIDENCE_TOP_K, draft_logits.shape[-1])
        tops.append(torch.topk(draft_logits, k).values.cpu().double())
    return torch.cat(tops), torch.cat(agreements)


def agreement_loss(top_logits: torch.Tensor, agree: torch.Tensor, scale: float) -> float:
    """Mean binary cross-entropy of the agreement events under the top-1 probability at `scale`."""
    log_probs = torch.log_softmax(top_logits * scale, dim=-1)[:, 0]  # log p(top-1)
    log_not = torch.log1p(-log_probs.exp().clamp(max=1 - 1e-12))
    return float(-(torch.where(agree, log_probs, log_not)).mean())


def fit_scale(top_logits: torch.Tensor, agree: torch.Tensor) -> float:
    """β minimising `agreement_loss` (unimodal in log β: golden-section search)."""
    if len(agree) == 0:
        raise SpecdecodeError("calibration needs at least one position")
    low, high = LOG_SCALE_RANGE
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if agreement_loss(top_logits, agree, math.exp(a)) < agreement_loss(top_logits, agree, math.exp(b)):
            high = b
        else:
            low = a
    return math.exp((low + high) / 2)


def apply_scale(draft: PreTrainedModel, scale: float) -> None:
    """Multiply the draft's logits by `scale` through its final norm (Llama layout)."""
    norm = getattr(getattr(draft, "model", None), "norm", None)
    if norm is None or not hasattr(norm, "weight"):
        raise SpecdecodeError("calibration needs a Llama-style draft with a final norm (model.norm.weight)")
    with torch.no_grad():
        norm.weight.mul_(scale)


def sample_windows(tokens: np.ndarray, n_windows: int, length: int, seed: int) -> torch.Tensor:
    """`n_windows` random windows of `length` tokens [W, length], drawn under `seed` alone."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - length, (n_windows,), generator=generator).numpy()
    return torch.from_numpy(tokens[starts[:, None] + np.arange(length)].astype(np.int64))


def summary(top_logits: torch.Tensor, agree: torch.Tensor, scale: float) -> dict:
    """How often the models agree, against the mean top-1 probability before and after `scale`."""
    return {
        "positions": len(agree),
        "agreement": float(agree.double().mean()),
        "mean_confidence_before": float(torch.softmax(top_logits, dim=-1)[:, 0].mean()),
        "mean_confidence_after": float(torch.softmax(top_logits * scale, dim=-1)[:, 0].mean()),
    }


def calibrate_draft(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokens: np.ndarray,
    n_windows: int,
    seq_len: int,
    seed: int,
) -> dict:
    """Fit and apply β on `n_windows` random training windows; returns what the log records."""
    windows = sample_windows(tokens, n_windows, seq_len, seed)  # [W, T]
    was_training = draft.training
    draft.eval()
    top_logits, agree = agreement_sample(target, draft, windows)
    scale = fit_scale(top_logits, agree)
    apply_scale(draft, scale)
    draft.train(was_training)
    return {"scale": scale, **summary(top_logits, agree, scale)}
