"""MTP strategy: the target's own multi-token-prediction layer proposes the continuation.

llama.cpp's `draft-mtp`, vLLM's `method: "mtp"`. The layer (`mtp_head.MtpLayer`) is driven as an
EAGLE-3 head is, over the target's last hidden state instead of three layers' features, so
the drafting is the EAGLE-3 strategy's: chains with p_min, n_max and n_min (or a policy's
`keep_drafting` rule), drafting by sampling for rejection verification, the layer's own KV
cache kept over the longest common prefix, EAGLE-2 trees when `tree_tokens` > 0; k > 1 chains
the one layer on its own state, as vLLM and llama.cpp do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from specdecode.backends import Backend, hidden_state_source
from specdecode.sampling import Sampler
from specdecode.strategies.draft_model import DraftModelConfig
from specdecode.strategies.eagle3 import Eagle3Strategy
from specdecode.strategies.mtp_head import MtpLayer

if TYPE_CHECKING:
    from specdecode.constraints import Constraint


class MtpStrategy(Eagle3Strategy):
    name: ClassVar[str] = "mtp"

    def __init__(
        self,
        layer: MtpLayer,
        target: Backend,
        config: DraftModelConfig,
        sampler: Sampler | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        hidden_state_source(target, "--spec-type draft-mtp")  # said in this strategy's name
        super().__init__(layer, target, config, sampler, constraint)
