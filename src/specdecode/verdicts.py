"""Why a generation drafted little or nothing, or had its drafts held short, in words a user reads.

From its counters alone, a generation that drafted nothing looks broken ("drafted 0 tokens").
Yet each such case is a choice made for a measured reason: the adaptive policy found that a
draft model cannot pay on this machine, the copying strategies found nothing to copy, a
backend holds drafts short so that output stays exact. `generation_verdicts` names those
reasons once a generation ends (kept in `GenerationStats.verdicts`, printed once by the
command line, in --json, the server's /props and /metrics and bench's tables), each with the
numbers behind it and the flag that changes it; `start_verdicts` says what is known before
generating (a cap on drafts). The codes, explained in docs/policy.md:

- drafts_capped: drafts held to a few tokens (or none) so that llama.cpp's passes keep the
  output exact (`specdecode.backends.llama_probe`).
- draft_model_too_slow: even drafts kept whole would be slower than plain steps, at the draft
  step and verify pass costs measured (adaptive policy).
- draft_model_rarely_pays: the model ran, and its drafts gave fewer tokens a step than its
  cost needs (adaptive policy).
- draft_model_not_chosen: it could pay, but other candidates were better each step.
- draft_model_unsure: its first token was rarely as likely as --spec-draft-p-min asks (classic).
- nothing_to_copy: the model-free strategies found no earlier text to copy.
- copies_rarely_pay: they had drafts, kept too rarely to pay their verify rows (adaptive policy).

Said only where drafting was little (drafts on fewer than LITTLE of the steps; a drafting
model's reason where it drafted that little), or where a cap cut drafts: nothing when drafting
ran freely.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from specdecode.backends import Backend
from specdecode.chain import Chain
from specdecode.costs import CostModel
from specdecode.policy import AdaptivePolicy
from specdecode.stats import GenerationStats, SpeculationVerdict, StrategyStats
from specdecode.strategies import Strategy
from specdecode.strategies.base import Steerable

LITTLE = 0.1  # drafts on fewer than this share of the steps: drafting little
NOTE_WIDTH = 100  # a printed note's lines, "note: " included
CLASSIC = "--spec-policy classic drafts anyway"
CAP_REMEDY = "--passes bucketed lifts the cap; see docs/gguf.md"
NO_DRAFT_REMEDY = "--passes bucketed drafts anyway; see docs/gguf.md"
MODEL_LABELS = {
    "draft": "the draft model",
    "eagle3": "the EAGLE-3 head",
    "dflash": "the DFlash drafter",
    "mtp": "the MTP layer",
}


def note_lines(text: str, prefix: str = "note: ") -> list[str]:
    """A note as the command line prints it: `prefix`, then the text in lines of NOTE_WIDTH at
    most (a longer word, a path, stays whole), the later ones indented under the first's text."""
    indent = " " * len(prefix)
    return textwrap.wrap(
        text,
        NOTE_WIDTH,
        initial_indent=prefix,
        subsequent_indent=indent,
        break_long_words=False,  # a path stays whole
        break_on_hyphens=False,  # and so does a flag
    )


def start_verdicts(target: Backend, spec_types: Sequence[str]) -> list[SpeculationVerdict]:
    """What is known before generating: a backend's cap on drafts for exactness, where it is
    below a default draft's length (`row_cap_note`: llama.cpp's)."""
    row_cap_note = getattr(target, "row_cap_note", None)
    if not spec_types or row_cap_note is None or (message := row_cap_note()) is None:
        return []
    cap = target.row_cap - 1
    remedy = CAP_REMEDY if cap else NO_DRAFT_REMEDY
    return [SpeculationVerdict("drafts_capped", message, {"draft_cap": cap}, remedy)]


def merged(
    start: Sequence[SpeculationVerdict], latest: Sequence[SpeculationVerdict]
) -> list[SpeculationVerdict]:
    """The latest generation's verdicts, then those known at start that it did not restate."""
    codes = {verdict.code for verdict in latest}
    return [*latest, *(verdict for verdict in start if verdict.code not in codes)]


def generation_verdicts(stats: GenerationStats, chain: Chain) -> list[SpeculationVerdict]:
    """Why this generation drafted little or nothing, or had drafts cut, from its counters and
    what the chain's policy measured; empty where drafting ran freely."""
    steps = stats.n_passes
    if not chain or steps == 0:
        return []
    verdicts = [_capped(stats)] if stats.n_capped else []
    if chain.n_max == 0:  # no step had room for a draft: nothing else to say
        return verdicts
    policy = chain.policy
    free: list[tuple[str, StrategyStats]] = []
    for strategy, counts in zip(chain.strategies, chain.stats, strict=True):
        if counts.n_failed:  # warned about when it failed
            continue
        if not isinstance(strategy, Steerable):
            free.append((strategy.name, counts))
        elif counts.n_gen_drafts < LITTLE * steps:
            verdict = (
                _model(policy, strategy, counts, stats, chain.n_max)
                if policy is not None
                else _unsure(strategy, counts, steps)
            )
            verdicts += [verdict] if verdict is not None else []
    if stats.totals.n_drafts < LITTLE * steps:
        verdicts += _copies(policy, free, steps)
    return verdicts


def _capped(stats: GenerationStats) -> SpeculationVerdict:
    """How often a backend's cap for exactness cut this generation's drafts."""
    cap, steps, capped = stats.draft_cap or 0, stats.n_passes, stats.n_capped
    numbers = {"draft_cap": cap, "capped_steps": capped, "steps": steps}
    if cap == 0:
        message = "nothing was drafted: on this model, passes of several rows would change the output"
        return SpeculationVerdict("drafts_capped", message, numbers, NO_DRAFT_REMEDY)
    message = f"drafts were held to {cap} tokens on {capped} of {steps} steps so that output stays exact"
    return SpeculationVerdict("drafts_capped", message, numbers, CAP_REMEDY)


def best_case(costs: CostModel, strategy: str, n_max: int) -> tuple[int, float]:
    """The draft length up to n_max whose tokens, all kept, would make the most tokens per
    second, and that speed over plain steps', at the measured costs: a model running every
    step, reading the tokens its previous draft and the bonus token added."""
    plain = costs.pass_time(1)
    speedups = {
        k: (k + 1) * plain / (costs.draft_time(strategy, k, k + 1) + costs.pass_time(k + 1))
        for k in range(1, n_max + 1)
    }
    k = max(speedups, key=speedups.__getitem__)
    return k, speedups[k]


def _model(
    policy: AdaptivePolicy, strategy: Strategy, counts: StrategyStats, stats: GenerationStats, n_max: int
) -> SpeculationVerdict:
    """Why the adaptive policy ran this drafting model so little (n_max: the longest draft a
    step asked for, which a long generation's budget, not the model's settings, may set)."""
    costs, name, steps = policy.models.costs, strategy.name, stats.n_passes
    n_max = min(n_max, _configured(strategy, n_max))
    label, runs = MODEL_LABELS.get(name, name), counts.n_call_draft
    plain = costs.pass_time(1)
    k, speedup = best_case(costs, name, n_max)
    ran = f"ran {runs} times" if runs > 1 else "ran once" if runs else "was not run"
    free = {j: (j + 1) * plain / costs.pass_time(j + 1) for j in range(1, n_max + 1)}
    if name in costs.untimed and free and max(free.values()) < 1:  # never worth timing (`costs.time_draft`)
        k = max(free, key=free.__getitem__)
        check = costs.pass_time(k + 1) / plain
        numbers = {"speedup": free[k], "draft_tokens": k, "step_cost": 0.0, "check_cost": check}
        numbers.update(runs=runs, steps=steps)
        message = (
            f"{label} {ran}: checking {_tokens(k)} costs {check:.1f}x a plain step, so even fully kept "
            f"drafts that cost nothing to make would run at {free[k]:.2f}x plain speed"
        )
        return SpeculationVerdict("draft_model_too_slow", message, numbers, CLASSIC)
    if speedup < 1:
        one_pass = name in costs.one_pass  # a DFlash drafter's whole draft is one pass
        step = (costs.draft_time(name, 1, 0) if one_pass else costs.step_time(name)) / plain
        check = costs.pass_time(k + 1) / plain
        numbers = {"speedup": speedup, "draft_tokens": k, "step_cost": step, "check_cost": check}
        numbers.update(runs=runs, steps=steps)
        held = stats.draft_cap is not None and stats.draft_cap < _configured(strategy, n_max)
        if held and best_case(costs, name, _configured(strategy, n_max))[1] >= 1:
            message = (
                f"{label} {ran}: even fully kept drafts of up to {k} tokens, the most kept exact here, "
                f"would run at {speedup:.2f}x plain speed"
            )
            return SpeculationVerdict("draft_model_too_slow", message, numbers, CAP_REMEDY)
        message = (
            f"{label} {ran}: a {'drafting pass' if one_pass else 'draft step'} costs {step:.2f}x a plain "
            f"step and checking {_tokens(k)} "
            f"{check:.1f}x, so even fully kept drafts would run at {speedup:.2f}x plain speed"
        )
        return SpeculationVerdict("draft_model_too_slow", message, numbers, CLASSIC)
    record = policy.models.records.get(policy.source(name))
    if runs and record is not None:
        needed = (costs.draft_time(name, record.steps, record.rows) + costs.pass_time(record.rows)) / plain
        numbers = {"tokens_per_step": record.tokens, "tokens_needed": needed, "runs": runs, "steps": steps}
        message = (
            f"{label} {ran}: it gave {record.tokens:.2f} tokens a step, and it takes {needed:.2f} "
            "to beat plain steps here"
        )
        return SpeculationVerdict("draft_model_rarely_pays", message, numbers, CLASSIC)
    message = f"{label} {ran}: at best {speedup:.2f}x plain speed, but other drafts or plain steps did better"
    return SpeculationVerdict(
        "draft_model_not_chosen", message, {"speedup": speedup, "runs": runs, "steps": steps}
    )


def _configured(strategy: Strategy, n_max: int) -> int:
    """The longest draft the strategy's settings allow (its `config`, and the block a DFlash
    drafter fills: its `longest`), else n_max."""
    allowed = getattr(getattr(strategy, "config", None), "n_max", n_max)
    return min(allowed, getattr(strategy, "longest", allowed))


def _unsure(strategy: Strategy, counts: StrategyStats, steps: int) -> SpeculationVerdict | None:
    """Why the classic chain's drafting model drafted so little: its p_min rule."""
    p_min = getattr(getattr(strategy, "config", None), "p_min", None)
    if p_min is None or not counts.n_call_draft:
        return None
    label, drafts = MODEL_LABELS.get(strategy.name, strategy.name), counts.n_gen_drafts
    message = (
        f"{label} drafted on {drafts} of {steps} steps: its first token was rarely {p_min:g} likely or more"
    )
    numbers = {"p_min": p_min, "drafts": drafts, "steps": steps}
    return SpeculationVerdict(
        "draft_model_unsure", message, numbers, "a lower --spec-draft-p-min drafts more"
    )


def _copies(
    policy: AdaptivePolicy | None, free: list[tuple[str, StrategyStats]], steps: int
) -> list[SpeculationVerdict]:
    """Why the model-free strategies drafted little: nothing to copy, or (adaptive policy)
    copies kept too rarely to pay their verify rows."""
    verdicts = []
    empty = [name for name, counts in free if counts.n_call_draft and not counts.n_offered]
    if empty:
        message = f"{_names(empty)} found no repeated text to copy a draft from"
        verdicts.append(SpeculationVerdict("nothing_to_copy", message, {"steps": steps}))
    if policy is None:
        return verdicts
    costs = policy.models.costs
    check = costs.pass_time(2) / costs.pass_time(1)
    for name, counts in free:
        if counts.n_offered and counts.n_gen_drafts < LITTLE * steps:
            kept = policy.models.acceptance.chain(policy.source(name), [None])[0]
            offered, used = counts.n_offered, counts.n_gen_drafts
            message = (
                f"{name} had drafts on {offered} of {steps} steps, used on {used}: about {kept:.0%} of "
                f"first tokens are kept, and checking one costs {check:.2f}x a plain step"
            )
            numbers = {"offered": offered, "used": used, "first_kept": kept, "check_cost": check}
            verdicts.append(
                SpeculationVerdict("copies_rarely_pay", message, numbers | {"steps": steps}, CLASSIC)
            )
    return verdicts


def _tokens(k: int) -> str:
    return "1 token" if k == 1 else f"{k} tokens"


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
