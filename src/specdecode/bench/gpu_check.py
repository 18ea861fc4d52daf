"""`python -m specdecode.bench.gpu_check --out DIR`: what a GPU run must answer, in one go.

Sections (`--sections` picks some):
- exactness: the bundled pair on the device, per dtype and passes mode: greedy and seeded
  outputs of draft-model chains and trees, n-grams and batches against plain generation;
  where one differs, the position and plain's own top-2 logit margin there, against the
  kernels' rounding (the largest logit difference measured between a row of a multi-row
  pass, a tree pass or a batched pass and the one-row pass for the same position);
- passes: what a pass costs by its rows, t(rows), for one sequence and for several sequences'
  rows in one pass, on random-weight models of Llama-3.2-1B's and Llama-3.1-8B's shapes;
- speed: on those models, tokens/s of plain decoding against transformers' `generate`, of
  speculation with the target as its own draft (an oracle drafting the known greedy
  continuation: the ceiling our overhead allows; the model as draft model, against
  transformers' assisted generation), of batches, and the share of a decode the GPU idles;
- goals: the plan's targets, met or missed, from the numbers above.

Why it is built this way: it runs once, on a machine with only torch, triton, transformers,
safetensors, tokenizers and numpy, in minutes of borrowed time. So it imports only the
generation path, runs every part in a try block that records the error and goes on, skips what
a section's time budget no longer allows, prints progress as it goes, and rewrites
DIR/gpu_check.json and DIR/gpu_check.md after every part: a run cut short leaves what it
measured. `--device cpu --quick` runs the whole of it on tiny shapes, to check the check.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from specdecode.api import Pipeline, Result
from specdecode.backends import Backend
from specdecode.backends.batch import RowGroup, evaluate_groups
from specdecode.backends.hf import DTYPES, load_tokenizer
from specdecode.backends.load import native_backend
from specdecode.chain import Chain
from specdecode.defaults import bundled_pair
from specdecode.drafts import Draft
from specdecode.generate import Generation, GenerationConfig
from specdecode.sampling import Sampler, SamplingParams
from specdecode.strategies import DraftModelConfig, NgramMapConfig, NgramSettings

SECTIONS = ("exactness", "passes", "speed", "goals")
MODES = ("fixed", "bucketed", "invariant")
GRAPH_MODES = ("fixed", "bucketed")
N_CTX = 512  # every backend's context: the longest run is a 128-token prompt, 128 tokens and a draft
SEED = 1234
ORACLE_DRAFT = 8  # tokens an oracle (or the model drafting for itself) drafts per step
ORACLE_SYSTEM = f"ours oracle ({ORACLE_DRAFT} drafted)"
TREE_BRANCHES = 4  # draft-model trees: n_parallel
NGRAM_TYPES = ("ngram-simple", "ngram-map-k")
# Short n-grams: llama.cpp's defaults (12-token keys, drafts of 48) find nothing in 64 tokens.
NGRAM_SHORT = NgramMapConfig(size_n=2, size_m=4)
NGRAM = NgramSettings(simple=NGRAM_SHORT, map_k=NGRAM_SHORT)
ROUNDING_ROWS = (2, 5, 9, 17)  # verify passes whose rows are compared with one-row passes
BATCH_ROUNDING_ROWS = (1, 5)
WARMUP_TOKENS = 8  # a short run before each timed one: CUDA graphs are captured on first use
TOLERANCE = 2.0  # a difference is allowed where plain's top-2 margin <= this x the max rounding
GOAL_PLAIN = 1.5  # our plain >= this x transformers' generate, batch 1
GOAL_ORACLE = 4.0  # oracle self-draft >= this x our plain
GOAL_IDLE = 0.10  # GPU idle share of a plain decode step with graphs

# Code, the first of it repetitive (a quick run keeps the first prompts).
PROMPTS = (
    "red = 1\ngreen = 2\nblue = 3\nred = 1\ngreen = 2\nblue = 3\nred = 1\n",
    "import os\n\n\ndef read_lines(path):\n",
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for index, value in enumerate(values):\n    if value ",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=",
    "with open(path) as handle:\n    for line in handle:\n",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n",
    "    return sorted(set(words), key=len)\n\n\ndef main():\n",
)


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's shape: with random weights, what a pass costs depends on it alone."""

    label: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool


SHAPES = {
    "1b": Shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, True),
    "8b": Shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False),
    "tiny": Shape("tiny", 64, 2, 4, 2, 128, 512, True),  # checks the check on a CPU
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Sizes:
    """How much each section measures, and the seconds it may take (past them, what is left
    is skipped and listed)."""

    prompts: int = 8  # exactness: prompts, and tokens generated for each
    new_tokens: int = 64
    prefix: int = 128  # passes: tokens cached before a timed pass
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    sequences: tuple[int, ...] = (1, 8, 32)
    sequence_rows: tuple[int, ...] = (1, 4)
    reps: int = 5
    speed_prompt: int = 128
    speed_tokens: int = 128
    batches: tuple[int, ...] = (1, 8, 32)
    exactness_budget: float | None = 110.0  # None: no limit
    passes_budget: float | None = 50.0
    speed_budget: float | None = 130.0


FULL = Sizes()
QUICK = Sizes(
    prompts=2,
    new_tokens=16,
    prefix=32,
    rows=(1, 4, 16),
    sequences=(1, 4),
    sequence_rows=(1, 2),
    reps=3,
    speed_prompt=32,
    speed_tokens=32,
    batches=(1, 4),
    exactness_budget=60.0,
    passes_budget=30.0,
    speed_budget=60.0,
)


# --------------------------------------------------------------------------- the report


class Report:
    """The JSON document and its Markdown, rewritten after every part of the run."""

    def __init__(self, out: Path, machine: dict, settings: dict) -> None:
        self.out = out
        self.start = time.perf_counter()
        self.data: dict[str, Any] = {"machine": machine, "settings": settings, "notes": [], "sections": {}}
        self.budgets: dict[str, float] = {}
        self.entered: dict[str, float] = {}  # when each section's current entry began
        out.mkdir(parents=True, exist_ok=True)

    def log(self, message: str) -> None:
        print(f"[gpu-check {time.perf_counter() - self.start:6.1f}s] {message}", flush=True)

    def note(self, text: str) -> None:
        if text not in self.data["notes"]:
            self.data["notes"].append(text)
            self.log(f"note: {text}")

    def add(self, section: str, row: dict, table: str = "rows") -> None:
        self.data["sections"][section].setdefault(table, []).append(row)
        self.log(f"{section}: " + ", ".join(f"{key} {cell(value)}" for key, value in row.items()))
        self.write()

    @contextmanager
    def section(self, name: str, budget: float | None = None) -> Iterator[None]:
        """Time a section (its seconds add up over several entries); an error ends the entry,
        not the run."""
        section = self.data["sections"].setdefault(name, {"seconds": 0.0, "errors": [], "skipped": []})
        self.budgets.setdefault(name, float("inf") if budget is None else budget)
        start = self.entered[name] = time.perf_counter()
        try:
            yield
        except Exception as exc:
            self._error(name, name, exc)
        finally:
            section["seconds"] = round(section["seconds"] + time.perf_counter() - start, 2)
            self.write()

    def attempt(self, section: str, label: str, work: Callable[..., Any], *args: Any) -> Any:
        """work(*args), or None once its error is recorded; skipped (None) when the section's
        budget is spent."""
        spent = self.data["sections"][section]["seconds"] + time.perf_counter() - self.entered[section]
        if spent > self.budgets[section]:
            self.data["sections"][section]["skipped"].append(label)
            self.log(f"{section}: skipped {label} (the section's {self.budgets[section]:.0f} s are spent)")
            return None
        self.log(f"{section}: {label}")
        try:
            return work(*args)
        except Exception as exc:
            self._error(section, label, exc)
            return None
        finally:
            self.write()

    def _error(self, section: str, label: str, exc: BaseException) -> None:
        text = f"{label}: {type(exc).__name__}: {exc}"
        frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
        self.data["sections"][section]["errors"].append(
            {"where": label, "error": text, "traceback": "".join(frames[-4:])}
        )
        self.log(f"{section}: ERROR {text}")
        release()

    def errors(self) -> int:
        return sum(len(section.get("errors", [])) for section in self.data["sections"].values())

    def write(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.data))


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "; ".join(cell(item) for item in value) or "-"
    if isinstance(value, dict):
        return " ".join(f"{key}={cell(item)}" for key, item in value.items())
    return "-" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in columns) + " |" for row in rows]
    return lines


# What each table of the Markdown shows, by (section, table).
CAPTIONS = {
    ("exactness", "rows"): "outputs identical to plain generation's; differences: prompt, first differing "
    f"position, plain's top-2 logit margin there (greedy: allowed up to {TOLERANCE:g}x the rounding)",
    ("exactness", "rounding"): "rounding: the largest |logit difference| between rows of a chain, a tree "
    "and a batched pass and the one-row passes of plain generation at the same positions",
    ("models", "rows"): "random-weight models (bfloat16, built on the device)",
    ("passes", "rows"): "median ms of a pass after the cached prefix (first call: where graphs are captured)",
    ("speed", "rows"): "tokens/s of one generation (prompt included), greedy, end of generation ignored",
    ("goals", "rows"): "the plan's targets",
}


def markdown(data: dict) -> str:
    lines = ["# GPU check", "", "| machine | |", "|---|---|"]
    lines += [f"| {key} | {cell(value)} |" for key, value in data["machine"].items()]
    lines += ["", "settings: " + cell(data["settings"]), ""]
    lines += [f"- note: {note}" for note in data["notes"]]
    for name, section in data["sections"].items():
        lines += ["", f"## {name} ({section['seconds']:.1f} s)"]
        for key, value in section.items():
            if key not in ("errors", "skipped") and isinstance(value, list) and value:
                lines += ["", CAPTIONS.get((name, key), key) + ":", "", *markdown_table(value)]
        if section["skipped"]:
            lines += ["", "skipped (time budget): " + ", ".join(section["skipped"])]
        lines += [""] + [f"- ERROR {error['error']}" for error in section["errors"]]
    return "\n".join(lines) + "\n"


def machine(device: torch.device) -> dict:
    info: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info["gpu"] = properties.name
        info["gpu memory GiB"] = round(properties.total_memory / 2**30, 1)
    else:
        info["gpu"] = f"none ({device.type}: {platform.processor() or platform.machine()})"
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    info["tf32 matmul"] = torch.backends.cuda.matmul.allow_tf32
    info["transformers"] = transformers.__version__
    info["triton"] = package_version("triton")
    info["python"] = platform.python_version()
    info["commit"] = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    info["uncommitted changes"] = None if status is None else bool(status)
    return info


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git(*args: str) -> str | None:
    """A git command's output in this source tree; None where there is no git or no repository."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# --------------------------------------------------------------------------- models and backends


@dataclass
class Run:
    """What every section reads: the device, the sizes and the choices made for this run."""

    report: Report
    device: torch.device
    sizes: Sizes
    dtypes: list[torch.dtype]
    exact_modes: list[str]
    timing_modes: list[str]
    shapes: list[Shape]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def release() -> None:
    """Give back what dropped objects held (a failed part's tensors too) before the next part."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_backend(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, mode: str, name: str) -> Backend:
    return native_backend(model, tokenizer, passes=mode, n_ctx=N_CTX, name=name)


def busy_seconds(backend: Backend) -> float | None:
    """GPU seconds of the backend's passes since its last reset (None: it does not measure them)."""
    measure = getattr(backend, "busy_seconds", None)
    seconds = measure() if measure is not None else None
    return seconds if seconds else None


def reset_busy(backend: Backend) -> None:
    reset = getattr(backend, "reset_busy", None)
    if reset is not None:
        reset()


def llama_config(shape: Shape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(LLAMA3_ROPE),
        tie_word_embeddings=shape.tied,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def random_model(shape: Shape, device: torch.device) -> LlamaForCausalLM:
    """Random bfloat16 weights made on the device itself: an 8B model's 16 GB are never
    initialised by a CPU."""
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(shape))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is exactly the model's ids ("t0", "t1", ...): prompts are
    given as ids, and text is only ever decoded."""
    vocab = {f"t{index}": index for index in range(vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1")


def random_ids(vocab: int, count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (count,), generator=generator).tolist()


def median_seconds(run: Run, call: Callable[[], object], reset: Callable[[], object]) -> tuple[float, float]:
    """(median seconds of `call` after two warm-up calls, seconds of the first call: where
    graphs are captured); every call is followed by `reset`."""
    samples = []
    for _ in range(run.sizes.reps + 2):
        run.sync()
        start = time.perf_counter()
        call()
        run.sync()
        samples.append(time.perf_counter() - start)
        reset()
    return statistics.median(samples[2:]), samples[0]


def agreement(a: Sequence[int], b: Sequence[int]) -> str:
    position = first_difference(a, b)
    return "identical" if position is None else f"differs from token {position}"


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two outputs differ (None: identical)."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------- exactness


def exactness(run: Run) -> None:
    """Mode by mode (the invariant one, slowest on a GPU, last: the budget may skip it), each
    dtype: the pairs are small enough to keep loaded."""
    tokenizer = load_tokenizer(bundled_pair()[0])
    pairs = {}
    for dtype in run.dtypes:
        name = str(dtype).removeprefix("torch.")
        pairs[name] = run.report.attempt(
            "exactness", f"load the bundled pair in {name}", load_pair, run, dtype
        )
    for mode in run.exact_modes:
        for name, pair in pairs.items():
            if pair is not None:
                run.report.attempt("exactness", f"{name} {mode}", exactness_mode, run, *pair, tokenizer, mode)
    del pairs
    release()


def load_pair(run: Run, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedModel]:
    target_dir, draft_dir = bundled_pair()
    return tuple(  # type: ignore[return-value]
        AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
        .to(run.device)
        .eval()
        for directory in (target_dir, draft_dir)
    )


def exactness_mode(
    run: Run,
    target_model: PreTrainedModel,
    draft_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    mode: str,
) -> None:
    report, sizes = run.report, run.sizes
    dtype = str(target_model.dtype).removeprefix("torch.")
    target = make_backend(target_model, tokenizer, mode, "target")
    draft = make_backend(draft_model, tokenizer, mode, "draft")
    prompts = [target.tokenize(text) for text in PROMPTS[: sizes.prompts]]
    config = GenerationConfig(n_predict=sizes.new_tokens, verify="match", ignore_eos=True)
    count = len(prompts)
    samplings = {
        "greedy": [SamplingParams(temperature=0.0)] * count,
        "seeded": [SamplingParams(temperature=0.8, seed=SEED + index) for index in range(count)],
    }
    plain = Pipeline(target)
    spec = {"dtype": dtype, "mode": mode}
    rounding: float | None = None
    for sampling, params in samplings.items():
        reference = [plain.generate(ids, p, config).tokens for ids, p in zip(prompts, params, strict=True)]
        if sampling == "greedy":
            worst = report.attempt(
                "exactness", f"{dtype} {mode} rounding", rounding_error, target, prompts, reference
            )
            if worst is not None:
                report.add("exactness", {**spec, **worst}, "rounding")
                rounding = max(worst.values())
        for case, generate in cases(target, draft).items():
            label = f"{dtype} {mode} {sampling} {case}"
            results = report.attempt("exactness", label, generate, prompts, params, config)
            if results is None:
                continue
            row = compare(target, prompts, reference, results, sampling == "greedy", rounding)
            report.add("exactness", {**spec, "sampling": sampling, "case": case, **row})


Generate = Callable[[list[list[int]], list[SamplingParams], GenerationConfig], list[Result]]


def cases(target: Backend, draft: Backend) -> dict[str, Generate]:
    """Each way of generating whose output must equal plain generation's."""

    def singly(pipe: Pipeline) -> Generate:
        def generate(prompts, params, config):
            return [pipe.generate(ids, p, config) for ids, p in zip(prompts, params, strict=True)]

        return generate

    def batched(pipe: Pipeline) -> Generate:
        def generate(prompts, params, config):
            return pipe.generate_batch(prompts, params, config, max_sequences=len(prompts))

        return generate

    tree = DraftModelConfig(n_parallel=TREE_BRANCHES)
    return {
        "draft chain": singly(Pipeline(target, draft, spec_types=["draft"])),
        "draft tree": singly(Pipeline(target, draft, spec_types=["draft"], draft_config=tree)),
        "n-gram": singly(Pipeline(target, spec_types=list(NGRAM_TYPES), ngram=NGRAM)),
        "batch plain": batched(Pipeline(target)),
        "batch draft chain": batched(Pipeline(target, draft, spec_types=["draft"])),
    }


def compare(
    target: Backend,
    prompts: list[list[int]],
    reference: list[list[int]],
    results: list[Result],
    greedy: bool,
    rounding: float | None,
) -> dict:
    """Outputs identical to plain's; for each that is not, where it first differs and plain's
    top-2 logit margin there; greedy: whether every difference is within the kernels' rounding."""
    differences = []
    for index, (prompt, plain, result) in enumerate(zip(prompts, reference, results, strict=True)):
        position = first_difference(plain, result.tokens)
        if position is not None:
            margin = top2_margin(plain_logits(target, prompt, plain, position))
            differences.append({"prompt": index, "position": position, "margin": margin})
    passes = sum(result.stats.n_passes for result in results)
    row: dict[str, Any] = {
        "identical": f"{len(results) - len(differences)}/{len(results)}",
        "tokens/pass": sum(result.stats.n_step_tokens for result in results) / max(passes, 1),
        "drafted": sum(result.stats.totals.n_drafted for result in results),
        "accepted": sum(result.stats.totals.n_accepted for result in results),
        "differences": differences,
    }
    if not differences:
        row["verdict"] = "exact"
    elif not greedy:
        row["verdict"] = "differs (sampled: no tolerance)"
    elif rounding is None:
        row["verdict"] = "differs (rounding not measured)"
    elif all(d["margin"] <= TOLERANCE * rounding for d in differences):
        row["verdict"] = "within rounding"
    else:
        row["verdict"] = "OUTSIDE rounding"
    return row


def plain_logits(target: Backend, prompt: list[int], tokens: list[int], position: int) -> torch.Tensor:
    """The logits plain generation chose tokens[position] from: the prompt's pass, then one-row
    passes over the tokens before it."""
    target.truncate(0)
    logits = target.evaluate(prompt, logits_rows=1)[0]
    for token in tokens[:position]:
        logits = target.evaluate([token])[0]
    return logits


def top2_margin(logits: torch.Tensor) -> float:
    best = torch.topk(logits.double(), 2).values
    return float(best[0] - best[1])


def rounding_error(target: Backend, prompts: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """The largest |logit difference| between a row of a verify pass (a chain, a tree, several
    sequences' rows) and the one-row pass of plain generation at the same position."""
    alone = []  # per prompt: one-row logits after each of the reference's first tokens
    for prompt, tokens in zip(prompts, reference, strict=True):
        target.truncate(0)
        target.evaluate(prompt, logits_rows=1)
        alone.append(torch.stack([target.evaluate([token])[0] for token in tokens[: max(ROUNDING_ROWS)]]))
    worst = {"chain": 0.0, "tree": 0.0, "batch": 0.0}
    for prompt, tokens, rows_alone in zip(prompts, reference, alone, strict=True):
        target.truncate(0)
        target.evaluate(prompt, logits_rows=1)
        for rows in ROUNDING_ROWS:
            if rows > len(rows_alone):
                continue
            target.truncate(len(prompt))
            chain = target.evaluate(tokens[:rows])
            target.truncate(len(prompt))
            tree = target.evaluate_tree(tokens[:rows], list(range(-1, rows - 1)))
            worst["chain"] = max(worst["chain"], largest_difference(chain, rows_alone[:rows]))
            worst["tree"] = max(worst["tree"], largest_difference(tree, rows_alone[:rows]))
    forks = [target.fork() for _ in prompts]
    for fork, prompt in zip(forks, prompts, strict=True):
        fork.evaluate(prompt, logits_rows=1)
    for rows in BATCH_ROUNDING_ROWS:
        groups = [RowGroup(fork, tokens[:rows]) for fork, tokens in zip(forks, reference, strict=True)]
        for logits, rows_alone in zip(evaluate_groups(groups), alone, strict=True):
            worst["batch"] = max(worst["batch"], largest_difference(logits, rows_alone[:rows]))
        for fork, prompt in zip(forks, prompts, strict=True):
            fork.truncate(len(prompt))
    target.truncate(0)
    return worst


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# --------------------------------------------------------------------------- pass costs


def pass_costs(run: Run, shape: Shape, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    for mode in run.timing_modes:
        run.report.attempt(
            "passes", f"{shape.label} {mode}", pass_costs_mode, run, shape, model, tokenizer, mode
        )
        release()


def pass_costs_mode(
    run: Run, shape: Shape, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, mode: str
) -> None:
    """t(rows) of one sequence after a cached prefix (`evaluate`), then of several sequences'
    rows in one pass (forks, `evaluate_groups`); each pass is rolled back after it is timed."""
    sizes = run.sizes
    backend = make_backend(model, tokenizer, mode, shape.label)
    ids = random_ids(shape.vocab, sizes.prefix + max(sizes.rows), SEED)
    prefix, probe = ids[: sizes.prefix], ids[sizes.prefix :]
    backend.evaluate(prefix, logits_rows=1)
    one_row = 0.0

    def add(call: str, sequences: int, rows: int, timing: tuple[float, float]) -> None:
        seconds, first = timing
        row = {"shape": shape.label, "mode": mode, "call": call, "sequences": sequences, "rows each": rows}
        row.update({"ms": 1e3 * seconds, "x one row": seconds / one_row, "first call ms": 1e3 * first})
        run.report.add("passes", row)

    for rows in sizes.rows:
        timing = median_seconds(
            run, partial(backend.evaluate, probe[:rows]), partial(backend.truncate, len(prefix))
        )
        one_row = one_row or timing[0]
        add("evaluate", 1, rows, timing)
    forks = [backend.fork() for _ in range(max(sizes.sequences))]
    probes = []
    for index, fork in enumerate(forks):
        ids = random_ids(shape.vocab, sizes.prefix + max(sizes.sequence_rows), SEED + 1 + index)
        fork.evaluate(ids[: sizes.prefix], logits_rows=1)
        probes.append(ids[sizes.prefix :])
    for count in sizes.sequences:
        for rows in sizes.sequence_rows:
            groups = [
                RowGroup(fork, probe[:rows]) for fork, probe in zip(forks[:count], probes, strict=False)
            ]
            reset = partial(truncate_all, forks[:count], sizes.prefix)
            add("evaluate_groups", count, rows, median_seconds(run, partial(evaluate_groups, groups), reset))


def truncate_all(backends: Sequence[Backend], length: int) -> None:
    for backend in backends:
        backend.truncate(length)


# --------------------------------------------------------------------------- end-to-end speed


class OracleDrafter:
    """Drafts the target's own greedy continuation, known from a plain run: where the passes
    give verify rows plain's bits, every draft is kept, so the run shows the speed our
    per-step overhead allows at this draft length (a `Strategy`)."""

    name = "oracle"
    n_min = 0

    def __init__(self, sequence: list[int], length: int) -> None:
        self.sequence = sequence  # prompt + plain's output
        self.length = length

    def begin(self, prompt: Sequence[int]) -> None:
        """Nothing to set up: the continuation is known."""

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        at = len(history) + 1
        if at > len(self.sequence) or self.sequence[at - 1] != last:
            return Draft()
        return Draft(tokens=self.sequence[at : at + min(self.length, n_max)])

    def accept(self, n_accepted: int) -> None:
        """Nothing to learn."""

    def end(self) -> None:
        """Nothing to keep."""


def speed(run: Run, shape: Shape, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    report = run.report
    prompt = random_ids(shape.vocab, run.sizes.speed_prompt, SEED)
    hf_tokens = report.attempt("speed", f"{shape.label} transformers", hf_speed, run, shape, model, prompt)
    for mode in run.timing_modes:
        label = f"{shape.label} {mode}"
        backend = report.attempt(
            "speed", f"{label} backend", make_backend, model, tokenizer, mode, shape.label
        )
        if backend is None:
            continue
        where = (run, shape, mode, backend)
        plain = report.attempt("speed", f"{label} plain", plain_speed, *where, prompt, hf_tokens)
        if plain is not None:
            report.attempt("speed", f"{label} oracle", oracle_speed, *where, prompt, plain)
            report.attempt("speed", f"{label} self-draft", self_draft_speed, *where, prompt, plain)
        report.attempt("speed", f"{label} batches", batch_speed, *where)
        del backend
        release()


def timed(run: Run, backend: Backend, call: Callable[[], Any]) -> tuple[Any, float, float | None]:
    """(call's result, its seconds, the share of them the GPU idled: None where the backend
    does not measure its GPU time)."""
    reset_busy(backend)
    run.sync()
    start = time.perf_counter()
    result = call()
    run.sync()
    seconds = time.perf_counter() - start
    busy = busy_seconds(backend)
    return result, seconds, None if busy is None else 1.0 - busy / seconds


def speed_row(shape: Shape, mode: str, system: str, tokens: int, seconds: float, **extra: Any) -> dict:
    return {"shape": shape.label, "mode": mode, "system": system, "tokens/s": tokens / seconds, **extra}


def hf_speed(run: Run, shape: Shape, model: PreTrainedModel, prompt: list[int]) -> list[int]:
    """transformers' `generate`, plain and assisted by the model itself (ORACLE_DRAFT tokens a
    step, no confidence cut); returns the plain greedy output."""
    new = run.sizes.speed_tokens
    hf_generate(run, model, prompt, WARMUP_TOKENS, assisted=False)
    tokens, seconds = hf_generate(run, model, prompt, new, assisted=False)
    run.report.add("speed", speed_row(shape, "-", "transformers generate", new, seconds))
    with assistant_settings(model):
        hf_generate(run, model, prompt, WARMUP_TOKENS, assisted=True)
        assisted, seconds = hf_generate(run, model, prompt, new, assisted=True)
    row = speed_row(shape, "-", "transformers assisted (itself)", new, seconds)
    row["vs plain's output"] = agreement(tokens, assisted)
    run.report.add("speed", row)
    return tokens


@torch.inference_mode()
def hf_generate(
    run: Run, model: PreTrainedModel, prompt: list[int], new_tokens: int, assisted: bool
) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=run.device)
    options: dict[str, Any] = {
        "do_sample": False,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,  # random weights: no end of generation
        "attention_mask": torch.ones_like(ids),
        "pad_token_id": model.config.pad_token_id,
    }
    if assisted:
        options["assistant_model"] = model
    run.sync()
    start = time.perf_counter()
    out = model.generate(ids, **options)
    run.sync()
    return out[0, len(prompt) :].tolist(), time.perf_counter() - start


@contextmanager
def assistant_settings(model: PreTrainedModel) -> Iterator[None]:
    """The assistant's drafting settings (read from its generation config: the model's own)."""
    config = model.generation_config
    settings = {
        "num_assistant_tokens": ORACLE_DRAFT,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }
    saved = {name: getattr(config, name, None) for name in settings}
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def greedy_config(run: Run, tokens: int | None = None) -> GenerationConfig:
    return GenerationConfig(n_predict=tokens or run.sizes.speed_tokens, ignore_eos=True)


GREEDY = SamplingParams(temperature=0.0)


def plain_speed(
    run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int], hf_tokens: list[int] | None
) -> dict:
    """Our plain decoding; returns its row (the oracle drafts its output)."""
    pipe = Pipeline(backend)
    pipe.generate(prompt, GREEDY, greedy_config(run, WARMUP_TOKENS))
    backend.truncate(0)  # the timed run evaluates its prompt, as transformers' does
    result, seconds, idle = timed(run, backend, partial(pipe.generate, prompt, GREEDY, greedy_config(run)))
    row = speed_row(shape, mode, "ours plain", len(result.tokens), seconds, **{"GPU idle": idle})
    if hf_tokens is not None:
        row["vs transformers' output"] = agreement(hf_tokens, result.tokens)
    run.report.add("speed", row)
    return {**row, "tokens": result.tokens}


def oracle_speed(run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int], plain: dict) -> None:
    oracle = OracleDrafter([*prompt, *plain["tokens"]], ORACLE_DRAFT)

    def generate(tokens: int) -> Generation:
        generation = Generation(
            backend, Chain([oracle]), Sampler(GREEDY), greedy_config(run, tokens), list(prompt)
        )
        for _ in generation:
            pass
        return generation

    generate(2 * ORACLE_DRAFT + 2)  # warm-up: one full-length step at least
    backend.truncate(0)
    generation, seconds, idle = timed(run, backend, partial(generate, run.sizes.speed_tokens))
    report_speculation(run, shape, mode, ORACLE_SYSTEM, generation, seconds, idle, plain)


def self_draft_speed(
    run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int], plain: dict
) -> None:
    """The target as its own draft model, drafting ORACLE_DRAFT tokens a step (no p_min cut)."""
    drafting = DraftModelConfig(n_max=ORACLE_DRAFT, p_min=0.0)
    pipe = Pipeline(backend, backend.fork(), spec_types=["draft"], draft_config=drafting)
    pipe.generate(prompt, GREEDY, greedy_config(run, 2 * ORACLE_DRAFT + 2))
    truncate_all([backend, pipe.draft], 0)
    result, seconds, idle = timed(run, backend, partial(pipe.generate, prompt, GREEDY, greedy_config(run)))
    report_speculation(run, shape, mode, "ours draft model (itself)", result, seconds, idle, plain)


def report_speculation(
    run: Run,
    shape: Shape,
    mode: str,
    system: str,
    result: Any,
    seconds: float,
    idle: float | None,
    plain: dict,
) -> None:
    stats = result.stats
    row = speed_row(shape, mode, system, len(result.tokens), seconds)
    row["x ours plain"] = row["tokens/s"] / plain["tokens/s"]
    row["tokens/pass"] = stats.tokens_per_pass
    row["accepted"] = stats.totals.acceptance_rate
    row["GPU idle"] = idle
    row["vs plain's output"] = agreement(plain["tokens"], result.tokens)
    run.report.add("speed", row)


def batch_speed(run: Run, shape: Shape, mode: str, backend: Backend) -> None:
    """Plain decoding of several sequences sharing each pass: tokens/s of them all."""
    pipe = Pipeline(backend)
    for count in run.sizes.batches:
        # The warm-up's prompts differ from the timed run's, which so evaluates its prompts.
        warmup, prompts = (
            [random_ids(shape.vocab, run.sizes.speed_prompt, seed + index) for index in range(count)]
            for seed in (SEED + 1000, SEED + 2000)
        )
        batch = partial(pipe.generate_batch, sampling=GREEDY, max_sequences=count, load_rule=False)
        batch(warmup, config=greedy_config(run, WARMUP_TOKENS))
        results, seconds, idle = timed(run, backend, partial(batch, prompts, config=greedy_config(run)))
        tokens = sum(len(result.tokens) for result in results)
        row = speed_row(shape, mode, f"ours batch of {count}", tokens, seconds, **{"GPU idle": idle})
        run.report.add("speed", row)


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
        hf = found.get((shape, "-", "transformers generate"), {}).get("tokens/s")
        for mode in modes:
            plain = found.get((shape, mode, "ours plain"), {})
            oracle = found.get((shape, mode, ORACLE_SYSTEM), {}).get("tokens/s")
            where = (run, shape, mode)
            ratio_goal(
                *where, f"plain >= {GOAL_PLAIN}x transformers generate", plain.get("tokens/s"), hf, GOAL_PLAIN
            )
            ratio_goal(
                *where, f"oracle >= {GOAL_ORACLE}x our plain", oracle, plain.get("tokens/s"), GOAL_ORACLE
            )
            idle = plain.get("GPU idle")
            numbers, met = (None, None) if idle is None else (f"{100 * idle:.1f}% idle", idle <= GOAL_IDLE)
            add_goal(*where, f"GPU idle <= {100 * GOAL_IDLE:.0f}% of a plain decode", numbers, met)
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


EXPLAINED = ("exact", "within rounding")


def ratio_goal(
    run: Run, shape: str, mode: str, goal: str, value: float | None, base: float | None, factor: float
) -> None:
    if value is None or base is None:
        add_goal(run, shape, mode, goal, None, None)
    else:
        numbers = f"{value / base:.2f}x ({value:.1f} vs {base:.1f} tokens/s)"
        add_goal(run, shape, mode, goal, numbers, value >= factor * base)


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
        prog="python -m specdecode.bench.gpu_check",
        description="Exactness, pass costs, speed and the plan's goals on a GPU: DIR/gpu_check.{json,md}.",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and .md")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (fewer prompts, rows, tokens)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}"
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument(
        "--shapes", help=f"random-weight model shapes, of {', '.join(SHAPES)} (default: 1b,8b; tiny on a CPU)"
    )
    parser.add_argument("--dtypes", default="bfloat16,float32", help="the bundled pair's dtypes (exactness)")
    parser.add_argument(
        "--passes",
        help=f"passes modes, of {', '.join(MODES)} (default: on a GPU all for exactness and fixed,bucketed "
        "for timings; on a CPU invariant)",
    )
    args = parser.parse_args(argv)
    args.sections = names(parser, args.sections, SECTIONS, "section")
    on_gpu = args.device.startswith("cuda")
    args.shapes = names(parser, args.shapes or ("1b,8b" if on_gpu else "tiny"), tuple(SHAPES), "shape")
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
        sizes = replace(sizes, exactness_budget=None, passes_budget=None, speed_budget=None)
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
    timings = {"passes": (pass_costs, sizes.passes_budget), "speed": (speed, sizes.speed_budget)}
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
