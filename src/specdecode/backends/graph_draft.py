"""A draft model's greedy steps on the device, for the graph passes: k steps in one replay.

Why: a draft model drafts one token a pass, and on a GPU each of its passes was a graph replay,
a copy of the vocabulary-long logits row to the host, a host argmax and a new row table: the
1B drafter's pass cost a third of an 8B target's pass where its bytes are a sixth. Here the
steps run back to back on the device: each step's token is the argmax of the row before it
(ties to the lowest id, as the host's), written straight into the next one-row pass's table,
with its top-1 confidence (softmax over the largest logits, what p_min reads). Only the tokens
and confidences come back, once per call; on a GPU the whole call is one captured graph.

The caller decides how many steps a call runs and cuts the draft on the host by the same rules
as a step-by-step draft (`strategies.draft_model`): a cut mid-call wastes the passes after it,
which is why calls are short (`DEVICE_DRAFT_STEPS`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial

import torch

from specdecode.backends.graph_attention import StaticInputs, capture

DEVICE_DRAFT_STEPS = 4  # steps a call runs at most: a cut wastes at most 3 passes of the drafter

Forward = Callable[[torch.Tensor], torch.Tensor]  # one pass's inputs -> logits [V] of its row


def greedy_steps(
    logits: torch.Tensor, inputs: torch.Tensor, steps: int, forward: Forward | None, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`steps` greedy tokens after the row whose logits [V] are `logits`, and their top-1
    confidences; the first len(inputs) tokens are evaluated, each by `forward` over its pass's
    inputs (a row of `inputs`, whose first entry, the pass's first token, is filled here; None
    where `inputs` is empty).
    Returns tokens [steps] (long), confidences [steps] (float64) and the logits after the last
    evaluated token. Tensor code only: no host synchronisation, so it can be captured."""
    tokens = torch.empty(steps, dtype=torch.long, device=logits.device)
    confidences = torch.empty(steps, dtype=torch.float64, device=logits.device)
    for step in range(steps):
        values = torch.topk(logits, min(top_k, logits.shape[-1])).values
        confidences[step] = torch.softmax(values.to(torch.float64), dim=0)[0]
        tokens[step] = torch.argmax(logits)
        if step < len(inputs):
            assert forward is not None
            inputs[step, 0] = tokens[step]
            logits = forward(inputs[step])
    return tokens, confidences, logits


class CapturedSteps:
    """`greedy_steps` of one shape captured as one CUDA graph over static buffers, in the graph
    passes' shared pool (`graph_attention.capture`)."""

    def __init__(
        self,
        logits: torch.Tensor,
        inputs: torch.Tensor,
        steps: int,
        forward: Forward,
        top_k: int,
        pool: tuple[int, int] | None,
        kernels: Callable[[], AbstractContextManager],
    ) -> None:
        """logits, inputs: a call's (their shapes and a harmless content for the warm-up: the
        passes' inputs write only scratch slots until replayed with real ones); kernels: the
        attention kernels' context, entered around warm-up and capture."""
        self.logits = logits.clone()
        self.inputs = StaticInputs(inputs.clone())
        self.graph, self.outputs = capture(
            partial(greedy_steps, self.logits, self.inputs.tensor, steps, forward, top_k), pool, kernels
        )

    def __call__(
        self, logits: torch.Tensor, inputs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay on these logits (device) and inputs (host): the outputs, copied out of the
        shared pool, which the next replay of any graph may reuse."""
        self.logits.copy_(logits)
        self.inputs.load(inputs)
        self.graph.replay()
        return tuple(output.clone() for output in self.outputs)  # type: ignore[return-value]
