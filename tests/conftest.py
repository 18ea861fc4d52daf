"""Shared fixtures: tiny tokenizers, cached float64 Llama models and target/draft pairs.

Models are cheap but not free, so every model is built once per session and looked up by
its recipe (`functools.lru_cache`). Backends wrap a model with a fresh KV cache and are
made per use (`ModelZoo.backend`), so tests never see each other's cache state.
"""

from __future__ import annotations

import atexit
import copy
import difflib
import functools
import inspect
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from scipy import stats
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

import specdecode.chain
from specdecode import HFBackend, Sampler, SamplingParams
from specdecode.backends import llama_kernels
from specdecode.costs import CostModel, DraftCalls
from specdecode.policy import PolicyModels
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy, save_model, truncated_copy

VOCAB_SIZE = 320
OTHER_VOCAB_SIZE = 384
INIT_STD = 0.5  # larger than make_llama's default: the default gives degenerate repeat-one-token models
SHARPEN = 4.0  # lm_head scale: top-1 confidences above p_min = 0.75 become common

# The models here are tiny: intra-op threads only add synchronisation, and on a busy machine
# (2 cores shared with other jobs) OpenMP spinning makes a 24-token generation 20-40x slower.
torch.set_num_threads(1)

# Pass timings are never read from or written to the user's cache (and a test that times passes
# must time them); tests of that cache turn it back on in a temporary directory.
os.environ["SPECDECODE_NO_PASS_CACHE"] = "1"
# Nor is anything else cached there (tokenizers built from GGUF files): a fresh cache per
# session, removed at its end (the bundled models decoded into it are tens of MB).
USER_CACHE_HOME = os.environ.get("XDG_CACHE_HOME")  # where a test looks for what a user built
# llama.cpp's kernels are the exception: the suite runs on those `make setup` built for this CPU
# (in the user's cache), as a user's run does, and so do the processes the tests start.
KERNELS = llama_kernels.choose_library()
if KERNELS.directory is not None:
    os.environ.setdefault(llama_kernels.LIB_VARIABLE, str(KERNELS.directory))
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="specdecode-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

# A busy machine draws a property test's examples slowly too: no test fails for the time its
# examples take (each test's own settings still choose how many).
settings.register_profile("busy-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("busy-machine")

# Draft kinds: perturbed copies at these noise levels, or an unrelated model.
NOISES = (0.0, 0.02, 0.1, 0.5)
INDEPENDENT = "independent"


# --------------------------------------------------------------------------- tokenizers


@functools.cache
def cached_tokenizer(vocab_size: int = VOCAB_SIZE, source: str = "textwrap", add_bos: bool = True):
    """make_tokenizer trained on the source of a stdlib module ("textwrap" is the default text)."""
    text = None if source == "textwrap" else inspect.getsource(difflib)
    return make_tokenizer(vocab_size=vocab_size, text=text, add_bos=add_bos)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return cached_tokenizer()


@pytest.fixture(scope="session")
def other_tokenizer() -> PreTrainedTokenizerFast:
    """Trained on different text with a different size: every id past the specials differs."""
    return cached_tokenizer(OTHER_VOCAB_SIZE, "difflib")


@pytest.fixture(scope="session")
def other_text_tokenizer() -> PreTrainedTokenizerFast:
    """Same size as `tokenizer`, trained on different text."""
    return cached_tokenizer(VOCAB_SIZE, "difflib")


@pytest.fixture(scope="session")
def no_bos_tokenizer() -> PreTrainedTokenizerFast:
    """`tokenizer`'s vocabulary without the BOS post-processor."""
    return cached_tokenizer(VOCAB_SIZE, "textwrap", add_bos=False)


# --------------------------------------------------------------------------- models


def _sharpen(model: LlamaForCausalLM, factor: float) -> LlamaForCausalLM:
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


def _tie_eos(model: LlamaForCausalLM, vocab_size: int) -> LlamaForCausalLM:
    """Make EOS (id 1) the greedy choice wherever the model's favourite token would be.

    Its lm_head row becomes a copy of that token's row; the tie goes to the lower id (1),
    so greedy traces end (or, with ignore_eos, pass through EOS) regularly.
    """
    favourites: Counter[int] = Counter()
    with torch.no_grad():
        for start in (3, 40, 90, 150, 200):
            ids = torch.arange(start, start + 24).remainder(vocab_size - 3).add(3)[None]
            favourites.update(model(input_ids=ids).logits[0].argmax(-1).tolist())
        favourite = next(t for t, _ in favourites.most_common() if t > 2)
        model.lm_head.weight[1] = model.lm_head.weight[favourite]
    return model


@dataclass(frozen=True)
class TargetSpec:
    seed: int = 0
    hidden: int = 32
    layers: int = 2
    vocab_size: int = VOCAB_SIZE
    eos_tie: bool = False
    max_positions: int = 512


@functools.cache
def target_model(spec: TargetSpec) -> LlamaForCausalLM:
    model = make_llama(
        spec.vocab_size,
        hidden=spec.hidden,
        layers=spec.layers,
        heads=4,
        kv_heads=2,
        init_std=INIT_STD,
        seed=spec.seed,
        max_positions=spec.max_positions,
    )
    _sharpen(model, SHARPEN)
    if spec.eos_tie:
        _tie_eos(model, spec.vocab_size)
    return model


@functools.cache
def draft_model(spec: TargetSpec, kind: float | str, draft_seed: int = 1) -> LlamaForCausalLM:
    """A draft for `target_model(spec)`: perturbed copy (kind = noise), an independent model
    (kind = INDEPENDENT) or an early-exit copy (kind = "truncated:N")."""
    target = target_model(spec)
    if kind == INDEPENDENT:
        return target_model(TargetSpec(1000 + draft_seed, spec.hidden, spec.layers, spec.vocab_size))
    if isinstance(kind, str) and kind.startswith("truncated:"):
        return truncated_copy(target, int(kind.split(":")[1]))
    return perturbed_copy(target, float(kind), seed=draft_seed)


@functools.cache
def in_dtype(model: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    """A copy of a cached model in another dtype, made once."""
    return copy.deepcopy(model).to(dtype)


@dataclass
class ExactnessLog:
    """What the exactness tests ran, for the terminal summary (and the report)."""

    cases: Counter[str] = field(default_factory=Counter)
    dtypes: Counter[str] = field(default_factory=Counter)  # cases by the target's dtype
    drafted: int = 0
    accepted: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [drafted, accepted]
    eos_stops: int = 0
    accepting: int = 0  # cases where at least one draft token was accepted
    rejecting: int = 0  # cases where at least one draft token was rejected
    # rejection sampling checked against the target's exact distribution: test -> draws
    distribution: Counter[str] = field(default_factory=Counter)

    def record(self, test: str, kind: str, stats, stop_reason: str = "", dtype: str = "float64") -> None:
        self.cases[test] += 1
        self.dtypes[dtype] += 1
        self.drafted += stats.totals.n_drafted
        self.accepted += stats.totals.n_accepted
        entry = self.by_kind.setdefault(f"{test.split('/')[0]:<20} draft {kind}", [0, 0])
        entry[0] += stats.totals.n_drafted
        entry[1] += stats.totals.n_accepted
        self.eos_stops += stop_reason == "eos"
        self.accepting += stats.totals.n_accepted > 0
        self.rejecting += stats.totals.n_drafted > stats.totals.n_accepted

    def record_distribution(self, test: str, draws: int) -> None:
        """A chi-square fit of speculative draws to the target's exact distribution that passed."""
        self.distribution[test] += draws


EXACTNESS_LOG = ExactnessLog()


@pytest.fixture(scope="session")
def exactness_log() -> ExactnessLog:
    return EXACTNESS_LOG


def pytest_terminal_summary(terminalreporter) -> None:
    log = EXACTNESS_LOG
    if log.cases:
        _report_cases(terminalreporter, log)
    if log.distribution:
        terminalreporter.write_line(
            f"{len(log.distribution)} rejection-sampling fits to the target's exact distribution "
            f"({sum(log.distribution.values())} draws):"
        )
        for name, draws in sorted(log.distribution.items()):
            terminalreporter.write_line(f"  {name}: {draws} draws")


def _report_cases(terminalreporter, log: ExactnessLog) -> None:
    total = sum(log.cases.values())
    rate = log.accepted / log.drafted if log.drafted else 0.0
    terminalreporter.write_sep("-", "speculative exactness cases")
    terminalreporter.write_line(
        f"{total} cases compared with plain generation; drafted {log.drafted}, accepted "
        f"{log.accepted} ({100 * rate:.1f}%); {log.accepting} cases accepted drafts, "
        f"{log.rejecting} rejected some; {log.eos_stops} ended at EOS"
    )
    terminalreporter.write_line(
        "by dtype: " + ", ".join(f"{dtype} {count}" for dtype, count in log.dtypes.most_common())
    )
    for name, count in sorted(log.cases.items()):
        terminalreporter.write_line(f"  {name}: {count}")
    for kind, (drafted, accepted) in sorted(log.by_kind.items()):
        share = accepted / drafted if drafted else 0.0
        terminalreporter.write_line(f"  {kind:<40} {accepted:5d}/{drafted:<5d} accepted ({100 * share:.1f}%)")


class ModelZoo:
    """Cached models, fresh backends."""

    TargetSpec = TargetSpec

    def target(self, spec: TargetSpec | None = None) -> LlamaForCausalLM:
        return target_model(spec or TargetSpec())

    def draft(self, spec: TargetSpec, kind: float | str, draft_seed: int = 1) -> LlamaForCausalLM:
        return draft_model(spec, kind, draft_seed)

    def tokenizer(self, vocab_size: int = VOCAB_SIZE, source: str = "textwrap", add_bos: bool = True):
        return cached_tokenizer(vocab_size, source, add_bos)

    def backend(self, model: LlamaForCausalLM, tokenizer=None, **kwargs) -> HFBackend:
        return HFBackend(model, tokenizer or cached_tokenizer(), **kwargs)

    def pair(self, spec: TargetSpec, kind: float | str, *, draft_n_ctx: int = 0, target_n_ctx: int = 0):
        """(target backend, draft backend), both fresh."""
        tok = cached_tokenizer()
        return (
            HFBackend(target_model(spec), tok, n_ctx=target_n_ctx),
            HFBackend(draft_model(spec, kind), tok, n_ctx=draft_n_ctx),
        )


@pytest.fixture(scope="session")
def zoo() -> ModelZoo:
    return ModelZoo()


@pytest.fixture
def saved_model_dir(tmp_path: Path, tokenizer) -> Path:
    """A float64 model and its tokenizer saved as a Hugging Face directory."""
    model = target_model(TargetSpec(seed=7, hidden=16, layers=1))
    return save_model(tmp_path / "model", model, tokenizer)


class CountingSampler(Sampler):
    """A Sampler that counts its uniform draws (one per sampled token is the contract)."""

    def __init__(self, p: SamplingParams) -> None:
        super().__init__(p)
        self.n_uniform = 0

    def uniform(self) -> float:
        self.n_uniform += 1
        return super().uniform()


# --------------------------------------------------------------------------- EAGLE-3

EAGLE3_LAYERS = (0, 2, 4)
# Output projections of every layer scaled by this: the target's next token then depends
# mostly on the current token, with a little context, which a one-layer head learns in a few
# seconds (a target as chaotic as the ones above would take minutes). Heads for real targets
# are `specdecode train eagle3`'s job.
EAGLE3_LAYER_SCALE = 0.005


@functools.cache
def eagle3_target() -> LlamaForCausalLM:
    """A 4-layer target, so that a head can read layers 0, 2 and 4 (the last one's output)."""
    model = make_llama(
        VOCAB_SIZE, hidden=32, layers=4, heads=4, kv_heads=2, init_std=INIT_STD, seed=2, max_positions=1024
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(EAGLE3_LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(EAGLE3_LAYER_SCALE)
    return _sharpen(model, SHARPEN)


@functools.cache
def eagle3_corpus(n_sequences: int = 48, length: int = 40) -> np.ndarray:
    """The target's own sampled generations (temperature 0.7) from random prompts: what a head
    for it should learn to predict."""
    model = eagle3_target()
    rng = np.random.default_rng(0)
    pieces = []
    with torch.no_grad():
        for index in range(n_sequences):
            ids = torch.tensor([rng.integers(3, VOCAB_SIZE, int(rng.integers(2, 8))).tolist()])
            generator = torch.Generator().manual_seed(index)
            for _ in range(length):
                logits = model(input_ids=ids).logits[0, -1] / 0.7
                token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
                ids = torch.cat([ids, token[None]], dim=1)
            pieces.append(ids[0].numpy())
    return np.concatenate(pieces).astype(np.int32)


@functools.cache
def eagle3_head(steps: int = 200, draft_vocab: int = 200, layer_ids: tuple[int, ...] = EAGLE3_LAYERS):
    """A float64 head for `eagle3_target()` reading the inputs of `layer_ids`, trained for a few
    seconds with the training-time test loss on the target's generations: it agrees with the
    target often, not always."""
    from specdecode.train.eagle3 import HeadShape, draft_vocabulary, new_head, ttt_loss
    from specdecode.train.lm import sample_batch

    target = eagle3_target()
    tokens = eagle3_corpus()
    shape = HeadShape(
        heads=4, kv_heads=2, intermediate=64, draft_vocab=draft_vocab, unroll=3, layer_ids=layer_ids
    )
    head = new_head(target, shape, draft_vocabulary(tokens, VOCAB_SIZE, draft_vocab), seed=0)
    loss_fn = ttt_loss(target, shape.unroll)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    head.train()
    for _ in range(steps):
        loss = loss_fn(head, sample_batch(tokens, 8, 32, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval().requires_grad_(False)


DFLASH_LAYERS = (1, 3)  # layer inputs that llama.cpp hands out too (not the last output, 4)


@functools.cache
def dflash_head(steps: int = 400, block_size: int = 5):
    """A float64 DFlash drafter for `eagle3_target()` (mask id VOCAB_SIZE - 1), trained for a
    few seconds with the block loss on the target's generations: it agrees with the target now
    and then (about one drafted token in ten), not always."""
    from specdecode.train.config import DFlashShape
    from specdecode.train.dflash import dflash_loss, new_head
    from specdecode.train.lm import sample_batch

    target = eagle3_target()
    tokens = eagle3_corpus()
    shape = DFlashShape(
        heads=4,
        kv_heads=2,
        head_dim=8,
        intermediate=64,
        block_size=block_size,
        anchors=8,
        layer_ids=DFLASH_LAYERS,
        mask_token_id=VOCAB_SIZE - 1,
    )
    head = new_head(target, shape, seed=0)
    loss_fn = dflash_loss(target, shape.anchors)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    head.train()
    for _ in range(steps):
        loss = loss_fn(head, sample_batch(tokens, 8, 32, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval().requires_grad_(False)


def chi_square_pvalue(counts: dict, expected: dict[object, float]) -> float:
    """Goodness of fit of `counts` (cell -> n) to `expected` (cell -> probability).

    Cells with expected count below 5 are pooled into one bin (merged into the smallest
    regular bin if the pool itself stays below 5), the usual validity rule for the chi-square
    approximation. An observation in a cell of probability zero is an outright failure
    (p-value 0).
    """
    n = sum(counts.values())
    if any(count > 0 and expected.get(cell, 0.0) <= 0.0 for cell, count in counts.items()):
        return 0.0
    total = sum(expected.values())
    assert abs(total - 1.0) < 1e-9, total
    observed, wanted = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for cell, prob in expected.items():
        if prob <= 0.0:
            continue
        if n * prob < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += n * prob
        else:
            observed.append(counts.get(cell, 0))
            wanted.append(n * prob)
    if pooled_exp > 0:
        if pooled_exp >= 5 or not wanted:
            observed.append(pooled_obs)
            wanted.append(pooled_exp)
        else:  # too small to stand alone: merge it into the smallest bin
            smallest = int(np.argmin(wanted))
            observed[smallest] += pooled_obs
            wanted[smallest] += pooled_exp
    assert len(observed) >= 2, "need at least two bins"
    return float(stats.chisquare(observed, wanted).pvalue)


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """The test pair as Hugging Face directories and as f32 and Q8_0 GGUF files, by name."""
    from specdecode.backends.gguf_files import export_gguf

    root = tmp_path_factory.mktemp("gguf")
    tokenizer = cached_tokenizer()
    paths = {
        "target": save_model(root / "target", target_model(TargetSpec()), tokenizer),
        "draft": save_model(root / "draft", draft_model(TargetSpec(), 0.02), tokenizer),
    }
    for role in ("target", "draft"):
        paths[f"{role}.gguf"] = export_gguf(paths[role], root / f"{role}.gguf", "f32")
        paths[f"{role}-q8_0.gguf"] = export_gguf(paths[role], root / f"{role}-q8_0.gguf", "q8_0")
    return paths


class CpuCosts(CostModel):
    """A large target's costs on a CPU (by default a pass of 17 rows 2.6x one row, a draft step
    a tenth of a one-row pass), held fixed: on the tiny models here a draft step costs what a
    target step does, and measured costs would have the policy draft next to nothing."""

    def __init__(self, seventeen_rows: float = 0.026, draft_step: float | None = None) -> None:
        super().__init__()
        self.calibrated.update({1: 0.010, 17: seventeen_rows})
        if draft_step is not None:
            self.draft_calls["draft"] = DraftCalls(draft_step)

    def observe_pass(self, rows: int, seconds: float, sequences: int = 1, weight: float = 1.0) -> None:
        """Held fixed."""

    def observe_draft(self, strategy: str, steps: int, seconds: float, missed: int) -> None:
        """Held fixed."""


class CpuPolicyModels(PolicyModels):
    """Policy models over `CpuCosts`, whose achieved rate is held at plain generation's under
    those costs: the tiny models' real steps would value a second at thousands of tokens."""

    @property
    def rate(self) -> float | None:
        return None


def cpu_policy() -> PolicyModels:
    return CpuPolicyModels(costs=CpuCosts())


def gpu_policy() -> PolicyModels:
    """Costs shaped as a GPU's for a large target (a verify row nearly free, a draft step a
    fiftieth of a target pass), where wide trees pay."""
    return CpuPolicyModels(costs=CpuCosts(seventeen_rows=0.0105, draft_step=0.0002))


@pytest.fixture
def steady_clock(monkeypatch) -> None:
    """The chain's clock stands still: asking the model-free strategies and running a drafting
    model take no time by it, as on an idle machine. The adaptive policy weighs a step's
    candidates by the seconds already spent drafting; on a busy machine a process descheduled
    for tens of milliseconds in that window would lower the rate a second is worth, and with
    it the price of a row, so that a test's choices would follow the machine's load, not the
    costs it set."""
    monkeypatch.setattr(specdecode.chain, "time", SimpleNamespace(perf_counter=lambda: 0.0))


@pytest.fixture
def fixed_costs(monkeypatch, steady_clock) -> None:
    """Every adaptive pipeline made in the test, by the command line and the server too, prices
    passes and draft steps by `cpu_policy`'s fixed costs instead of timing them on this machine:
    what the policy chooses from times measured on a busy machine is its own business (it
    rightly drafts nothing where a draft step costs as much as a target pass), not a test's."""

    def for_target(cls, target, progress=None, drafts=None) -> PolicyModels:
        return cpu_policy()

    monkeypatch.setattr(PolicyModels, "for_target", classmethod(for_target))
