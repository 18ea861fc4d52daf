"""From measured runs to the figures the report shows, per task and system.

Speed is end-to-end generated tokens per second (prompt evaluation included, the same for
every system), as the median over runs with its range, and beside it tokens per CPU-second of
this process (its median), which a busy machine's other processes disturb less; speed-ups are
ratios of the wall-clock medians measured in the same interleaved run. Counters (acceptance,
tokens per pass, time split) are sums over all runs, so long and short drafts weigh by their
tokens.

The ideal speed-up is Leviathan et al.'s S(α, γ, c) = (1 − α^(γ+1)) / ((1 − α)(1 + γc)),
with the verify pass priced as measured: (1 − α^(γ+1)) / ((1 − α)(v + γc)). γ is the mean
number of drafted tokens per target pass, c the cost of drafting one token relative to one
plain step, v the cost of the system's verify pass (of γ + 1 rows on average) relative to one
plain step, both measured on the same task, and α the per-token acceptance probability that,
in the i.i.d. model, gives the measured tokens per pass with drafts of γ tokens. Leviathan's
v = 1 holds where a pass of a few rows costs what one row does (a GPU); on a CPU a pass of 17
rows can cost twice a row's, and an S that ignored it would promise long drafts a gain the
machine cannot give (`ideal_speedup_flat` keeps v = 1, for comparison). A measured speed-up
below S is what the rest costs: sampling, rollback, and the loop itself.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from specdecode.bench.suite import Measurement
from specdecode.stats import DraftCounts


def solve_alpha(tokens_per_pass: float, gamma: float) -> float:
    """α with (1 − α^(γ+1)) / (1 − α) = tokens_per_pass (increasing in α: bisection)."""
    if gamma <= 0 or tokens_per_pass <= 1:
        return 0.0
    if tokens_per_pass >= gamma + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        alpha = (low + high) / 2
        if (1 - alpha ** (gamma + 1)) / (1 - alpha) < tokens_per_pass:
            low = alpha
        else:
            high = alpha
    return (low + high) / 2


def ideal_speedup(alpha: float, gamma: float, cost_ratio: float, pass_ratio: float = 1.0) -> float:
    """S = (1 − α^(γ+1)) / ((1 − α)(v + γc)), v = pass_ratio: a verify pass's cost over a
    plain step's (Leviathan et al.'s S(α, γ, c) at v = 1)."""
    expected_tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return expected_tokens / (pass_ratio + gamma * cost_ratio)


def step_seconds(runs: Sequence[Measurement]) -> float | None:
    """Mean seconds of a target pass (verification included) over our runs: plain's is a
    one-row step, a speculative system's its verify pass."""
    stats = [m.stats for m in runs if m.stats is not None]
    passes = sum(s.n_passes for s in stats)
    return sum(s.t_verify for s in stats) / passes if passes else None


def _counters(runs: Sequence[Measurement], plain_step: float | None = None) -> dict:
    """Drafting counters and times summed over our runs (empty for Hugging Face's); plain_step:
    plain generation's step on the task, against which passes and drafts are priced (without
    it, this system's own mean pass)."""
    stats = [m.stats for m in runs if m.stats is not None]
    if not stats:
        return {}
    counts = DraftCounts()
    for s in stats:
        counts.n_drafts += s.totals.n_drafts
        counts.n_tree_drafts += s.totals.n_tree_drafts
        counts.n_drafted += s.totals.n_drafted
        counts.n_accepted += s.totals.n_accepted
        for mine, theirs in (
            (counts.drafted_per_pos, s.totals.drafted_per_pos),
            (counts.accepted_per_pos, s.totals.accepted_per_pos),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value
    passes = sum(s.n_passes for s in stats)
    t_draft, t_verify = sum(s.t_draft for s in stats), sum(s.t_verify for s in stats)
    t_generation = sum(s.t_generation for s in stats) or 1.0
    gamma = counts.n_drafted / passes if passes else 0.0
    tokens_per_pass = sum(s.n_step_tokens for s in stats) / passes if passes else 0.0
    step = plain_step or (t_verify / passes if passes else 0.0)
    cost_ratio = (t_draft / counts.n_drafted) / step if counts.n_drafted and step else 0.0
    pass_ratio = (t_verify / passes) / step if passes and step else 1.0
    alpha = solve_alpha(tokens_per_pass, gamma)
    tree = counts.n_tree_drafts > 0  # S(α, γ, c) models a chain: no ideal for trees
    return {
        "acceptance_rate": counts.acceptance_rate,
        "acceptance_by_position": counts.acceptance_by_position,
        "drafted_by_position": counts.drafted_per_pos,
        "accepted_by_position": counts.accepted_per_pos,
        "tokens_per_pass": tokens_per_pass,
        "draft_tokens_per_pass": gamma,
        "tree_drafts": counts.n_tree_drafts / counts.n_drafts if counts.n_drafts else 0.0,
        "alpha": None if tree else alpha,
        "cost_ratio": cost_ratio,
        "pass_ratio": pass_ratio,
        "ideal_speedup": None if tree else ideal_speedup(alpha, gamma, cost_ratio, pass_ratio),
        "ideal_speedup_flat": None if tree else ideal_speedup(alpha, gamma, cost_ratio),
        "share_draft": t_draft / t_generation,
        "share_verify": t_verify / t_generation,
        "share_other": max(0.0, 1 - (t_draft + t_verify) / t_generation),
        # why drafting was little or held short, as its last run says (`specdecode.verdicts`)
        "verdicts": [verdict.to_dict() for verdict in stats[-1].verdicts],
    }


def summarize(measurements: Sequence[Measurement]) -> list[dict]:
    """One row per (task, system), in the order measured, with speed-ups against our plain
    generation and against Hugging Face's plain `generate` (when measured)."""
    groups: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    reference: dict[tuple[str, int, int], list[int]] = {}
    for m in measurements:
        groups[m.task, m.system].append(m)
        if m.system == "plain":
            reference.setdefault((m.task, m.prompt, m.turn), m.tokens)
    plain_steps = {task: step_seconds(runs) for (task, system), runs in groups.items() if system == "plain"}
    medians = {key: statistics.median(m.tokens_per_second for m in runs) for key, runs in groups.items()}
    rows = []
    for (task, system), runs in groups.items():
        speeds = [m.tokens_per_second for m in runs]
        # Sampled tasks: Hugging Face's sampler draws other tokens from the same distribution.
        comparable = [
            m for m in runs if (task, m.prompt, m.turn) in reference and not (m.sampled and m.family == "hf")
        ]
        exact = [m.tokens == reference[task, m.prompt, m.turn] for m in comparable]
        row = {
            "task": task,
            "system": system,
            "family": runs[0].family,
            "runs": len(runs),
            "tokens_per_second": medians[task, system],
            "tokens_per_second_min": min(speeds),
            "tokens_per_second_max": max(speeds),
            "cpu_seconds": sum(m.cpu_seconds for m in runs),
            "seconds": sum(m.seconds for m in runs),
            "tokens_per_cpu_second": statistics.median(m.tokens_per_cpu_second for m in runs),
            "speedup_vs_plain": _ratio(medians, task, system, "plain"),
            "speedup_vs_hf_plain": _ratio(medians, task, system, "hf-plain"),
            "exact_match_rate": sum(exact) / len(exact) if exact else None,
            **_counters(runs, plain_steps.get(task)),
        }
        if row.get("ideal_speedup") and row["speedup_vs_plain"] is not None:
            row["fraction_of_ideal"] = row["speedup_vs_plain"] / row["ideal_speedup"]
        rows.append(row)
    return rows


def _ratio(medians: dict, task: str, system: str, baseline: str) -> float | None:
    return medians[task, system] / medians[task, baseline] if (task, baseline) in medians else None
