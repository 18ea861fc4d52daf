"""`python -m specdecode.compare.gpu_check --out DIR`: what a GPU run must answer, in one go.

Sections (`--sections` picks some):
- exactness: the bundled pair on the device, per dtype and passes mode: greedy and seeded
  outputs of draft-model chains and trees, n-grams and batches against plain generation;
  where one differs, the position and plain's own top-2 logit margin there, against the
  kernels' rounding (the largest logit difference measured between a row of a multi-row
  pass, a tree pass or a batched pass and the one-row pass for the same position);
- passes: what a pass costs by its rows, t(rows), for one sequence and for several sequences'
  rows in one pass, on random-weight models of Llama-3.2-1B's and Llama-3.1-8B's shapes;
- speed: on those models, batch-1 decode tokens/s (time to the first token apart; median and
  range of three runs) of our plain decoding beside the memory-bandwidth roofline (MBU) and
  against the strongest baseline torch and transformers allow (a compiled gpt-fast-style loop
  and `generate` with a static cache; `gpu_baselines`); the oracle ceiling (the target drafting
  its own known greedy continuation: the speed our per-step overhead allows), the model as its
  own draft model, batches, and the share of a decode the GPU idles;
- replay: speculation at those shapes under real acceptance: traces recorded on a CPU with real
  pairs, replayed with every pass a real run makes (`gpu_replay`), after a calibration that
  replays the bundled pair's own trace beside its real run;
- prefill: the time to the first token of a 4,000-token prompt (256 with --quick), ours per
  mode beside the compiled loop's prompt pass (`gpu_prefill`);
- goals: the plan's targets, met or missed, from the numbers above.

Why it is built this way: it runs once, on a machine with only torch, triton, transformers,
safetensors, tokenizers and numpy, in minutes of borrowed time. So it imports only the
generation path, runs every part in a try block that records the error and goes on, skips what
a section's time budget no longer allows, prints progress as it goes, and rewrites
DIR/gpu_check.json and DIR/gpu_check.md after every part: a run cut short leaves what it
measured. `--device cpu --quick` runs the whole of it on tiny shapes, to check the check.

This module holds the goals section and the run; its settings are in `gpu_setup`, the report in
`gpu_report`, the models and shared helpers in `gpu_models`, the sections in `gpu_exactness` and
`gpu_speed` (passes and speed, with `gpu_baselines` and the roofline's arithmetic in
`gpu_roofline`), `gpu_replay` and `gpu_prefill`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.backends.hf import DTYPES
from specdecode.compare.gpu_baselines import COMPILED_LOOP, strongest_baseline
from specdecode.compare.gpu_exactness import exactness
from specdecode.compare.gpu_models import Run, random_model, word_tokenizer
from specdecode.compare.gpu_prefill import prefill
from specdecode.compare.gpu_replay import CALIBRATION_GOAL, REPLAY_BUDGET, replay_section
from specdecode.compare.gpu_report import Report, machine
from specdecode.compare.gpu_setup import (
    FULL,
    GOAL_BATCH,
    GOAL_EAGLE3,
    GOAL_IDLE,
    GOAL_MBU,
    GOAL_ORACLE,
    GOAL_PLAIN,
    GOAL_TTFT,
    GOAL_VERIFY,
    GRAPH_MODES,
    MODES,
    N_CTX,
    ORACLE_SYSTEM,
    PLAIN_SYSTEM,
    QUICK,
    SECTIONS,
    SHAPES,
    VERIFY_ROWS,
    Shape,
    release,
)
from specdecode.compare.gpu_speed import pass_costs, speed

# --------------------------------------------------------------------------- goals


def goals(run: Run) -> None:
    """The plan's targets, from what the other sections measured ("not measured" where they
    did not run or failed)."""
    sections = run.report.data["sections"]
    speed_rows = sections.get("speed", {}).get("rows", [])
    found = {(row["shape"], row["mode"], row["system"]): row for row in speed_rows}
    shapes = list(dict.fromkeys(row["shape"] for row in speed_rows)) or [shape.label for shape in run.shapes]
    modes = list(dict.fromkeys(row["mode"] for row in speed_rows if row["mode"] != "-")) or run.timing_modes
    for shape in shapes:
        strongest = strongest_baseline(run.report.data, shape) or {}
        against = strongest.get("system", "the strongest baseline")
        against += " (fallback: no static-cache baseline ran)" if "fallback" in strongest else ""
        for mode in modes:
            plain = found.get((shape, mode, PLAIN_SYSTEM), {})
            rate = plain.get("decode tokens/s")
            oracle = found.get((shape, mode, ORACLE_SYSTEM), {}).get("decode tokens/s")
            where = (run, shape, mode)
            goal = f"plain >= {GOAL_PLAIN:g}x the strongest baseline"
            ratio_goal(*where, goal, rate, strongest.get("decode tokens/s"), GOAL_PLAIN, against)
            if shape in GOAL_MBU:
                mbu_goal(*where, plain, GOAL_MBU[shape])
            goal = f"oracle ceiling >= {GOAL_ORACLE:g}x our plain"
            ratio_goal(*where, goal, oracle, rate, GOAL_ORACLE, "our plain")
            idle = plain.get("GPU idle")
            numbers, met = (None, None) if idle is None else (f"{100 * idle:.1f}% idle", idle <= GOAL_IDLE)
            add_goal(*where, f"GPU idle <= {100 * GOAL_IDLE:.0f}% of a plain decode", numbers, met)
    verify_goals(run, sections.get("passes", {}).get("rows", []))
    batch_goals(run, speed_rows, modes)
    ttft_goals(run, sections.get("prefill", {}).get("rows", []), modes)
    replay_goals(run, sections.get("replay", {}))
    greedy = [row for row in sections.get("exactness", {}).get("rows", []) if row["sampling"] == "greedy"]
    goal = "greedy output identical to plain (or within rounding)"
    for dtype, mode in dict.fromkeys((row["dtype"], row["mode"]) for row in greedy):
        rows = [row for row in greedy if (row["dtype"], row["mode"]) == (dtype, mode)]
        bad = [f"{row['case']} {row['identical']}" for row in rows if row["verdict"] not in EXPLAINED]
        within = [row["case"] for row in rows if row["verdict"] == "within rounding"]
        numbers = f"{len(rows) - len(bad)}/{len(rows)} cases exact or within rounding"
        numbers += f"; within rounding: {', '.join(within)}" if within else ""
        numbers += f"; not: {', '.join(bad)}" if bad else ""
        add_goal(run, f"bundled {dtype}", mode, goal, numbers, not bad)
    if not greedy:
        add_goal(run, "bundled", "-", goal, None, None)
    reduced = sections.get("exactness", {}).get("reduction", [])
    rows, identical = sum(row["rows"] for row in reduced), sum(row["identical"] for row in reduced)
    numbers = f"{identical}/{rows} rows identical" if reduced else None
    goal = "rows reduced on the device sample as the host's whole rows"
    add_goal(run, "all", "-", goal, numbers, identical == rows if reduced else None)


EXPLAINED = ("exact", "within rounding")


def verify_goals(run: Run, passes: list[dict]) -> None:
    """A verify pass of VERIFY_ROWS rows against a one-row pass, one sequence after the same
    cached prefix (the passes section's table), per shape and mode."""
    found = {
        (row["shape"], row["mode"], row["rows each"]): row["ms"]
        for row in passes
        if row["call"] == "evaluate" and row["sequences"] == 1
    }
    goal = f"a {VERIFY_ROWS}-row verify pass <= {GOAL_VERIFY:g}x a one-row pass"
    for shape, mode in dict.fromkeys((shape, mode) for shape, mode, _ in found) or [("all", "-")]:
        verify, one = found.get((shape, mode, VERIFY_ROWS)), found.get((shape, mode, 1))
        if verify is None or one is None:
            add_goal(run, shape, mode, goal, None, None)
        else:
            numbers = f"{verify / one:.2f}x ({verify:.2f} vs {one:.2f} ms)"
            add_goal(run, shape, mode, goal, numbers, verify <= GOAL_VERIFY * one)


def batch_goals(run: Run, speed_rows: list[dict], modes: list[str]) -> None:
    """Our plain batches on the shapes GOAL_BATCH names: the larger batch's tokens/s (all its
    sequences') against the smaller's."""
    rates = {(row["shape"], row["mode"], row["system"]): row.get("tokens/s") for row in speed_rows}
    measured = {shape.label for shape in run.shapes}
    for shape, (small, large, factor) in GOAL_BATCH.items():
        if shape not in measured:
            continue
        goal = f"batch {large} >= {factor:g}x the tokens/s of batch {small}"
        for mode in modes:
            large_rate = rates.get((shape, mode, f"ours batch of {large}"))
            small_rate = rates.get((shape, mode, f"ours batch of {small}"))
            if large_rate is None or small_rate is None:
                add_goal(run, shape, mode, goal, None, None)
            else:
                numbers = f"{large_rate / small_rate:.2f}x ({large_rate:.1f} vs {small_rate:.1f} tokens/s)"
                add_goal(run, shape, mode, goal, numbers, large_rate >= factor * small_rate)


def ttft_goals(run: Run, prefill_rows: list[dict], modes: list[str]) -> None:
    """Our time to the first token on the shapes GOAL_TTFT names, per mode the prefill section
    measured (else `modes`): not measured where its prompt was shorter than the goal's (a quick
    run's)."""
    found = {(row["shape"], row["mode"], row["system"]): row for row in prefill_rows}
    modes = list(dict.fromkeys(row["mode"] for row in prefill_rows if row["mode"] != "-")) or modes
    measured = {shape.label for shape in run.shapes}
    for shape, (prompt, limit) in GOAL_TTFT.items():
        if shape not in measured:
            continue
        goal = f"time to the first token of a {prompt}-token prompt <= {limit:g} s"
        loop = found.get((shape, "-", COMPILED_LOOP))
        for mode in modes:
            row = found.get((shape, mode, PLAIN_SYSTEM))
            if row is None or row["prompt tokens"] < prompt:
                numbers = None if row is None else f"a {row['prompt tokens']}-token prompt only"
                add_goal(run, shape, mode, goal, numbers, None)
                continue
            seconds = row["TTFT ms"] / 1e3
            numbers = f"{seconds:.3f} s (median of {row['runs']})"
            if loop is not None and loop["prompt tokens"] == row["prompt tokens"]:
                numbers += f"; {COMPILED_LOOP}: {loop['TTFT ms'] / 1e3:.3f} s"
            add_goal(run, shape, mode, goal, numbers, seconds <= limit)


def replay_goals(run: Run, replayed: dict) -> None:
    """The replay's own checks (tokens per pass as recorded; the calibration's gap) and the
    speed plan's EAGLE-3 target, from the replay section's tables."""
    rows = [row for row in replayed.get("rows", []) if row.get("replayed tokens/pass") is not None]
    goal = "replayed tokens/pass equal the recorded"
    unequal = [row for row in rows if row["replayed tokens/pass"] != row["recorded tokens/pass"]]
    numbers = f"{len(rows) - len(unequal)}/{len(rows)} rows equal" if rows else None
    add_goal(run, "all", "-", goal, numbers, not unequal if rows else None)
    gaps = [row["gap"] for row in replayed.get("calibration", []) if row.get("gap") is not None]
    goal = f"calibration: replay within {100 * CALIBRATION_GOAL:.0f}% of the real run"
    numbers = ", ".join(f"{100 * gap:+.1f}%" for gap in gaps) or None
    add_goal(
        run,
        "bundled",
        "-",
        goal,
        numbers,
        all(abs(gap) <= CALIBRATION_GOAL for gap in gaps) if gaps else None,
    )
    measured = {shape.label for shape in run.shapes}
    for shape, factor in GOAL_EAGLE3.items():
        if shape not in measured:
            continue
        eagle = [
            row["x ours plain"]
            for row in rows
            if row["shape"] == shape
            and row["strategy"] == "eagle3"
            and row["temperature"] == 0
            and row.get("x ours plain") is not None
        ]
        goal = f"EAGLE-3 replay at temperature 0 >= {factor:g}x our plain"
        numbers = ", ".join(f"{ratio:.2f}x" for ratio in eagle) or None
        add_goal(run, shape, "-", goal, numbers, min(eagle) >= factor if eagle else None)


def ratio_goal(
    run: Run,
    shape: str,
    mode: str,
    goal: str,
    value: float | None,
    base: float | None,
    factor: float,
    base_name: str,
) -> None:
    if value is None or base is None:
        add_goal(run, shape, mode, goal, None, None)
    else:
        numbers = f"{value / base:.2f}x ({value:.1f} vs {base:.1f} decode tokens/s, {base_name})"
        add_goal(run, shape, mode, goal, numbers, value >= factor * base)


def mbu_goal(run: Run, shape: str, mode: str, plain: dict, target: float) -> None:
    """Our plain decode's share of the memory-bandwidth roofline."""
    goal = f"plain MBU >= {100 * target:.0f}% of the roofline"
    mbu = plain.get("MBU")
    if mbu is None:
        add_goal(run, shape, mode, goal, None, None)
    else:
        rates = f"{plain['decode tokens/s']:.1f} of {plain['roofline tokens/s']:.1f} tokens/s"
        add_goal(run, shape, mode, goal, f"{100 * mbu:.1f}% ({rates})", mbu >= target)


def add_goal(run: Run, shape: str, mode: str, goal: str, numbers: str | None, met: bool | None) -> None:
    status = "not measured" if met is None else "met" if met else "MISSED"
    run.report.add(
        "goals", {"goal": goal, "shape": shape, "mode": mode, "numbers": numbers, "status": status}
    )


# --------------------------------------------------------------------------- the run


def build(run: Run, shape: Shape) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    start = time.perf_counter()
    model = random_model(shape, run.device)
    tokenizer = word_tokenizer(shape.vocab)
    run.sync()
    row = {
        "shape": shape.label,
        "parameters (B)": sum(p.numel() for p in model.parameters()) / 1e9,
        "build s": time.perf_counter() - start,
    }
    if run.device.type == "cuda":
        row["GPU GiB allocated"] = torch.cuda.memory_allocated(run.device) / 2**30
    run.report.add("models", row)
    return model, tokenizer


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m specdecode.compare.gpu_check",
        description="Exactness, pass costs, speed and the plan's goals on a GPU: DIR/gpu_check.{json,md}.",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and .md")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (fewer prompts, rows, tokens)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}"
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument(
        "--shapes", help=f"random-weight model shapes, of {', '.join(SHAPES)} (default: 8b,1b; tiny on a CPU)"
    )
    parser.add_argument(
        "--dtypes", default="bfloat16", help="the bundled pair's dtypes (exactness), e.g. bfloat16,float32"
    )
    parser.add_argument(
        "--passes",
        help=f"passes modes, of {', '.join(MODES)} (default: on a GPU all for exactness and fixed,bucketed "
        "for timings; on a CPU invariant)",
    )
    args = parser.parse_args(argv)
    args.sections = names(parser, args.sections, SECTIONS, "section")
    on_gpu = args.device.startswith("cuda")
    args.shapes = names(parser, args.shapes or ("8b,1b" if on_gpu else "tiny"), tuple(SHAPES), "shape")
    args.dtypes = names(parser, args.dtypes, tuple(DTYPES), "dtype")
    if args.passes is not None:
        args.exact_modes = args.timing_modes = names(parser, args.passes, MODES, "passes mode")
    else:
        args.exact_modes = list(MODES) if on_gpu else ["invariant"]
        args.timing_modes = list(GRAPH_MODES) if on_gpu else ["invariant"]
    return args


def names(parser: argparse.ArgumentParser, text: str, choices: tuple[str, ...], what: str) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    for name in chosen:
        if name not in choices:
            parser.error(f"unknown {what} {name!r} (choose from {', '.join(choices)})")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sections asked for; 1 when any part recorded an error (the files hold it)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu --quick to check the check)", file=sys.stderr)
        return 2
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if device.type == "cpu":
        # One thread: the CPU run checks the check on tiny models, where more threads only add
        # synchronisation, and on a shared machine make every pass many times slower.
        torch.set_num_threads(1)
    sizes = QUICK if args.quick else FULL
    if device.type != "cuda":  # the budgets ration a GPU's borrowed minutes; a CPU run rehearses all
        sizes = replace(
            sizes, exactness_budget=None, passes_budget=None, speed_budget=None, prefill_budget=None
        )
    settings = {
        "quick": args.quick,
        "sections": args.sections,
        "shapes": args.shapes,
        "dtypes": args.dtypes,
        "n_ctx": N_CTX,
        **asdict(sizes),
    }
    report = Report(args.out, machine(device), settings)
    run = Run(
        report=report,
        device=device,
        sizes=sizes,
        dtypes=[DTYPES[name] for name in args.dtypes],
        exact_modes=args.exact_modes,
        timing_modes=args.timing_modes,
        shapes=[SHAPES[name] for name in args.shapes],
    )
    settings.update(exact_modes=run.exact_modes, timing_modes=run.timing_modes)
    report.log(
        f"{report.data['machine']['gpu']}, torch {torch.__version__}; sections {', '.join(args.sections)}"
    )
    if "exactness" in args.sections:
        with report.section("exactness", sizes.exactness_budget):
            exactness(run)
    replay_budget = REPLAY_BUDGET if device.type == "cuda" else None
    timings = {
        "passes": (pass_costs, sizes.passes_budget),
        "speed": (speed, sizes.speed_budget),
        "replay": (replay_section, replay_budget),
        "prefill": (prefill, sizes.prefill_budget),  # last: its engine goes with the model
    }
    timings = {name: entry for name, entry in timings.items() if name in args.sections}
    for shape in run.shapes if timings else []:
        with report.section("models"):
            built = report.attempt("models", f"build {shape.label}", build, run, shape)
        if built is None:
            continue
        for name, (measure, budget) in timings.items():
            with report.section(name, budget):
                measure(run, shape, *built)
        del built
        release()
    if "goals" in args.sections:
        with report.section("goals"):
            goals(run)
    errors = report.errors()
    report.log(f"done: {errors} error(s) recorded; wrote {args.out / 'gpu_check.json'} and gpu_check.md")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
