"""The GPU check's settings: the sections, the goals and tolerances, the prompts, the
random-weight models' shapes and how much each section measures. Apart so that every part of
the check (its report too) reads them from one place below it."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from specdecode.strategies import NgramMapConfig, NgramSettings

SECTIONS = ("exactness", "passes", "speed", "replay", "prefill", "goals")
MODES = ("fixed", "bucketed", "invariant")
GRAPH_MODES = ("fixed", "bucketed")
N_CTX = 512  # every backend's context: the longest run is a 128-token prompt, 128 tokens and a draft
SEED = 1234
ORACLE_DRAFT = 8  # tokens an oracle (or the model drafting for itself) drafts per step
PLAIN_SYSTEM = "ours plain"
VS_PLAIN = "vs ours plain's output"  # whether a row's output equals our plain decode's
ORACLE_SYSTEM = f"ours oracle ceiling ({ORACLE_DRAFT} drafted, every draft kept)"
TREE_BRANCHES = 4  # draft-model trees: n_parallel
NGRAM_TYPES = ("ngram-simple", "ngram-map-k")
# Short n-grams: llama.cpp's defaults (12-token keys, drafts of 48) find nothing in 64 tokens.
NGRAM_SHORT = NgramMapConfig(size_n=2, size_m=4)
NGRAM = NgramSettings(simple=NGRAM_SHORT, map_k=NGRAM_SHORT)
ROUNDING_ROWS = (2, 5, 9, 17)  # verify passes whose rows are compared with one-row passes
BATCH_ROUNDING_ROWS = (1, 5)
WARMUP_TOKENS = 8  # a short run before each timed one: CUDA graphs are captured on first use
TOLERANCE = 2.0  # a difference is allowed where plain's top-2 margin <= this x the max rounding
GOAL_PLAIN = 1.1  # our plain >= this x the strongest baseline's decode tokens/s, batch 1
GOAL_ORACLE = 6.0  # the oracle ceiling >= this x our plain
GOAL_IDLE = 0.05  # GPU idle share of a plain decode step with graphs
VERIFY_ROWS = 17  # a default verify pass: 16 drafted tokens and the last
GOAL_VERIFY = 1.1  # a pass of VERIFY_ROWS rows costs <= this x a one-row pass

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
# Our plain decode's share of the memory-bandwidth roofline (MBU), by shape: where SGLang and
# gpt-fast sit on an 8B model; launch and tail effects cap multi-kernel engines lower on a 1B.
GOAL_MBU = {SHAPES["1b"].label: 0.40, SHAPES["8b"].label: 0.65}
GOAL_EAGLE3 = {SHAPES["8b"].label: 2.0}  # EAGLE-3 replay of real acceptance, temperature 0, x our plain
# Our plain batches: the larger batch >= this x the tokens/s of the smaller, by shape.
GOAL_BATCH = {SHAPES["8b"].label: (8, 32, 2.0)}
# Time to the first token of a prompt of this many tokens <= these seconds, by shape.
GOAL_TTFT = {SHAPES["8b"].label: (4000, 0.25)}
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
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 17, 32, 64)  # 17: VERIFY_ROWS
    sequences: tuple[int, ...] = (1, 8, 32)
    sequence_rows: tuple[int, ...] = (1, 4)
    reps: int = 5
    speed_prompt: int = 128
    speed_tokens: int = 128
    speed_repeats: int = 3  # timed generations of every batch-1 figure: median and range
    batches: tuple[int, ...] = (1, 8, 32)
    ttft_prompt: int = 4000  # prefill: the prompt whose time to the first token is measured
    exactness_budget: float | None = 60.0  # None: no limit
    passes_budget: float | None = 30.0
    # Ours and the baselines on both shapes, two compilations a shape among them (30-60 s each
    # for the 8B shape on a cold machine): the parts run most important first.
    speed_budget: float | None = 190.0
    prefill_budget: float | None = 30.0  # a few seconds on an H200: the rest is slack


FULL = Sizes()
QUICK = Sizes(
    prompts=2,
    new_tokens=16,
    prefix=32,
    rows=(1, 4, 16, 17),
    sequences=(1, 4),
    sequence_rows=(1, 2),
    reps=3,
    speed_prompt=32,
    speed_tokens=32,
    batches=(1, 4),
    ttft_prompt=256,
    exactness_budget=40.0,
    passes_budget=20.0,
    speed_budget=120.0,
    prefill_budget=20.0,
)


def release() -> None:
    """Give back what dropped objects held (a failed part's tensors too) before the next part."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
