"""Fitting an EAGLE-3 head's confidence to the chance that the target agrees with it.

The eagle3 strategy drafts with the draft model's policy: it stops at the first token whose
top-1 probability (a softmax over the head's 10 largest logits) is below p_min. A head
trained on the target's distribution inherits the target's uncertainty, as a distilled draft
does, so its top-1 probability is far below how often its argmax is the target's and drafting
stops early. The fix is the draft's (`specdecode.train.calibrate`): one logit scale β, fitted
by maximum likelihood of the agreement events under the top-1 probability and baked into the
head's final norm (`norm.weight`, which multiplies the logits exactly), so its argmax, hence
every greedy draft, is unchanged.

The events are the ones drafting sees: on random training windows, the training-time test's
states (`unrolled_states`: step 0 from the target's features, step j from the head's own
states j tokens past the verified prefix), at every unroll step and every position that step
reaches; an event is "the head's argmax, as a target id, is the target's argmax there". One β
serves all steps, as one p_min does.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdecode.strategies.draft_model import CONFIDENCE_TOP_K
from specdecode.strategies.eagle3_head import Eagle3Head, read_target, unrolled_states
from specdecode.train.calibrate import fit_scale, sample_windows, summary


@torch.no_grad()
def agreement_sample(
    target: nn.Module, head: Eagle3Head, windows: torch.Tensor, unroll: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over windows [W, T+1]: for each unroll step j < unroll and each position p >= j of the
    window's T pairs, the head's 10 largest logits [N, 10] (float64), whether its argmax is the
    target's next token there [N] (bool), and j [N]."""
    device = head.fc.weight.device
    tops, agreements, steps = [], [], []
    for window in windows:
        batch = window[None].to(device)  # [1, T+1]
        logits, feats = read_target(target, head.config.target_layer_ids, batch)
        wanted = logits[0, 1:].argmax(-1)  # [T]: the target's choice after pair p's token
        g = head.fc(feats.to(head.fc.weight.dtype))
        for step, h in enumerate(unrolled_states(head, batch[:, 1:], g, unroll)):
            draft_logits = head.logits(h[0, step:]).float()  # [T - step, V_draft]
            agreements.append((head.d2t[draft_logits.argmax(-1)] == wanted[step:]).cpu())
            k = min(CONFIDENCE_TOP_K, draft_logits.shape[-1])
            tops.append(torch.topk(draft_logits, k).values.cpu().double())
            steps.append(torch.full((len(draft_logits),), step))
    return torch.cat(tops), torch.cat(agreements), torch.cat(steps)


def apply_scale(head: Eagle3Head, scale: float) -> None:
    """Multiply the head's logits by `scale` through its final norm."""
    with torch.no_grad():
        head.norm.weight.mul_(scale)


def calibrate_head(
    target: nn.Module,
    head: Eagle3Head,
    tokens: np.ndarray,
    n_windows: int,
    seq_len: int,
    unroll: int,
    seed: int,
) -> dict:
    """Fit and apply β on `n_windows` random windows of `tokens` (seq_len pairs each); returns
    what the training log records, with the agreement and confidences of each unroll step."""
    windows = sample_windows(tokens, n_windows, seq_len + 1, seed)  # [W, T+1]
    was_training = head.training
    head.eval()
    top_logits, agree, steps = agreement_sample(target, head, windows, unroll)
    scale = fit_scale(top_logits, agree)
    apply_scale(head, scale)
    head.train(was_training)
    per_step = [summary(top_logits[steps == j], agree[steps == j], scale) for j in steps.unique().tolist()]
    return {"scale": scale, **summary(top_logits, agree, scale), "steps": per_step}
