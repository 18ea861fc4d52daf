"""Counters and timings of a generation, per strategy and in total.

Returned with the output, never printed by the library: the CLI, the server and the
benchmark all read the same `GenerationStats`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DraftCounts:
    """Drafted and accepted tokens, overall and by draft position (depth, for trees).

    A chain of k tokens is a tree of k nodes and depth k; a tree drafts more nodes than its
    depth and can keep at most one path of them.
    """

    n_drafts: int = 0  # verified drafts
    n_drafts_accepted: int = 0  # drafts with at least one token kept
    n_tree_drafts: int = 0  # drafts with more than one branch
    n_drafted: int = 0  # draft tokens (tree nodes) verified
    n_accepted: int = 0
    n_depth: int = 0  # sum of the drafts' depths
    drafted_per_pos: list[int] = field(default_factory=list)  # drafts reaching depth i + 1
    accepted_per_pos: list[int] = field(default_factory=list)  # drafts whose token at depth i + 1 was kept

    def record(self, n_nodes: int, depth: int, n_accepted: int) -> None:
        self.n_drafts += 1
        self.n_drafts_accepted += n_accepted > 0
        self.n_tree_drafts += n_nodes > depth
        self.n_drafted += n_nodes
        self.n_accepted += n_accepted
        self.n_depth += depth
        for per_pos, upto in ((self.drafted_per_pos, depth), (self.accepted_per_pos, n_accepted)):
            per_pos.extend([0] * (upto - len(per_pos)))
            for i in range(upto):
                per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (tree nodes count each)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(token at depth i + 1 kept | the draft reached depth i + 1)."""
        return [
            a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=False)
        ]

    @property
    def mean_tree_size(self) -> float:
        """Draft tokens verified per draft (a chain's length, a tree's node count)."""
        return self.n_drafted / self.n_drafts if self.n_drafts else 0.0

    @property
    def mean_depth(self) -> float:
        return self.n_depth / self.n_drafts if self.n_drafts else 0.0

    @property
    def mean_accepted_depth(self) -> float:
        """Draft tokens kept per draft: how far down the tree verification got."""
        return self.n_accepted / self.n_drafts if self.n_drafts else 0.0

    @property
    def nodes_per_accepted_token(self) -> float:
        """Draft tokens verified for each one kept: what a tree pays for its branches."""
        return self.n_drafted / self.n_accepted if self.n_accepted else 0.0


@dataclass
class StrategyStats:
    """llama.cpp's per-implementation counters (§5.1), with times in seconds."""

    name: str
    n_call_begin: int = 0
    n_call_draft: int = 0
    n_call_accept: int = 0
    n_gen_drafts: int = 0
    n_gen_tokens: int = 0
    n_failed: int = 0  # calls that raised (see `specdecode.chain`): the strategy then stops
    n_offered: int = 0  # draft calls that gave a draft (the adaptive policy may pass it over)
    counts: DraftCounts = field(default_factory=DraftCounts)
    t_begin: float = 0.0
    t_draft: float = 0.0
    t_accept: float = 0.0


@dataclass
class SpeculationVerdict:
    """Why a generation drafted little or nothing, or had its drafts held short: without it a
    user sees "drafted 0 tokens" and no reason. `code` is for programs (bench, /metrics),
    `message` a sentence for people, `numbers` the measurements behind it, `remedy` the flag
    that changes it, in words (empty where none does). Made by `specdecode.verdicts`."""

    code: str
    message: str
    numbers: dict[str, float] = field(default_factory=dict)
    remedy: str = ""

    @property
    def text(self) -> str:
        """The message with its remedy: what the command line prints after "note: "."""
        return f"{self.message} ({self.remedy})" if self.remedy else self.message

    def to_dict(self) -> dict:
        """Its fields and its `text`, as JSON carries it (generate --json, the server's /props)."""
        return asdict(self) | {"text": self.text}


@dataclass
class GenerationStats:
    n_prompt: int = 0
    n_generated: int = 0
    n_passes: int = 0  # target forward passes after the prompt (one per step)
    n_step_tokens: int = 0  # tokens those passes emitted
    totals: DraftCounts = field(default_factory=DraftCounts)
    t_prompt: float = 0.0  # prompt evaluation
    t_generation: float = 0.0  # everything after it
    t_draft: float = 0.0
    t_verify: float = 0.0  # target passes + verification sampling
    t_grammar: float = 0.0  # the constraint's matcher (masks, walks, commits), within the above
    n_masks: int = 0  # token masks the constraint computed
    stop_reason: str = ""
    n_context_shifts: int = 0  # times a full context dropped tokens to go on (context_shift)
    seed: int | None = None
    strategies: list[StrategyStats] = field(default_factory=list)
    draft_cap: int | None = None  # the most draft tokens a step could carry for exactness (None: no cap)
    n_capped: int = 0  # steps whose draft that cap cut short (or, at 0, left out)
    verdicts: list[SpeculationVerdict] = field(default_factory=list)  # why drafting was little, or held short

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens emitted per target pass (tau), the bonus or recovered token included."""
        return self.n_step_tokens / self.n_passes if self.n_passes else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.n_prompt / self.t_prompt if self.t_prompt > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.n_generated / self.t_generation if self.t_generation > 0 else 0.0

    @property
    def t_other(self) -> float:
        return max(0.0, self.t_generation - self.t_draft - self.t_verify)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance_rate=self.totals.acceptance_rate,
            acceptance_by_position=self.totals.acceptance_by_position,
            mean_tree_size=self.totals.mean_tree_size,
            mean_depth=self.totals.mean_depth,
            mean_accepted_depth=self.totals.mean_accepted_depth,
            nodes_per_accepted_token=self.totals.nodes_per_accepted_token,
            tokens_per_pass=self.tokens_per_pass,
            prompt_tokens_per_second=self.prompt_tokens_per_second,
            tokens_per_second=self.tokens_per_second,
            t_other=self.t_other,
        )
        for strategy, data in zip(self.strategies, out["strategies"], strict=True):
            data["acceptance_rate"] = strategy.counts.acceptance_rate
        out["verdicts"] = [verdict.to_dict() for verdict in self.verdicts]
        return out

    def format(self) -> str:
        """A readable block for the end of `specdecode generate`."""
        t = self.totals
        gen = self.t_generation or 1.0
        lines = [
            f"prompt      {self.n_prompt:6d} tokens  {self.t_prompt:8.3f} s  "
            f"{self.prompt_tokens_per_second:9.2f} tokens/s",
            f"generated   {self.n_generated:6d} tokens  {self.t_generation:8.3f} s  "
            f"{self.tokens_per_second:9.2f} tokens/s   (stopped: {self.stop_reason})",
            f"drafted     {t.n_drafted:6d} tokens, accepted {t.n_accepted} ({100 * t.acceptance_rate:.1f}%)",
            f"target      {self.n_passes:6d} passes, {self.tokens_per_pass:.2f} tokens per pass",
            f"time split  draft {100 * self.t_draft / gen:.1f}%  verify {100 * self.t_verify / gen:.1f}%  "
            f"other {100 * self.t_other / gen:.1f}%",
        ]
        if self.n_masks:
            lines.append(
                f"grammar     {self.n_masks:6d} masks, {1e3 * self.t_grammar:.1f} ms "
                f"({100 * self.t_grammar / gen:.1f}% of generation, "
                f"{1e6 * self.t_grammar / max(1, self.n_generated):.0f} us per token)"
            )
        if t.n_tree_drafts:
            lines.append(
                f"trees       {t.n_tree_drafts:6d} of {t.n_drafts} drafts branched; "
                f"{t.mean_tree_size:.2f} nodes and depth {t.mean_depth:.2f} per draft, "
                f"{t.mean_accepted_depth:.2f} accepted, "
                f"{t.nodes_per_accepted_token:.2f} nodes per accepted token"
            )
        if t.drafted_per_pos:
            label = "depth" if t.n_tree_drafts else "position"
            rates = ", ".join(f"{r:.2f}" for r in t.acceptance_by_position[:16])
            lines.append(f"acceptance by {label}  ({rates})")
        lines.extend(_strategy_line(s) for s in self.strategies)
        return "\n".join(lines)


def _strategy_line(s: StrategyStats) -> str:
    c = s.counts
    return (
        f"strategy {s.name:>16}: calls(b,d,a) = {s.n_call_begin} {s.n_call_draft} {s.n_call_accept}, "
        f"drafts gen/acc = {s.n_gen_drafts}/{c.n_drafts_accepted}, tokens gen/acc = "
        f"{s.n_gen_tokens}/{c.n_accepted} ({100 * c.acceptance_rate:.1f}%), "
        f"time(b,d,a) = {1e3 * s.t_begin:.1f}, {1e3 * s.t_draft:.1f}, {1e3 * s.t_accept:.1f} ms"
        + (f", FAILED {s.n_failed}x" if s.n_failed else "")
    )
