"""Strategies and how the chain builds them: names, priority and construction.

PRIORITY (in `specdecode.config`, with the names) is llama.cpp's fixed order, cheapest first;
the chain instantiates the enabled strategies in this order whatever order they were named in.
A strategy is built from a `SpecSetup`, which carries everything any strategy may need, so
adding one never changes the loop or the chain.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from specdecode.backends import Backend
from specdecode.config import (
    NEEDS_DFLASH,
    NEEDS_DRAFT,
    NEEDS_HEAD,
    NEEDS_MTP,
    PRIORITY,
    NgramSettings,
    parse_spec_types,
)
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.sampling import Sampler, SamplingParams
from specdecode.strategies.base import Strategy
from specdecode.strategies.dflash import DFlashStrategy
from specdecode.strategies.draft_model import DraftModelConfig, DraftModelStrategy
from specdecode.strategies.eagle3 import Eagle3Strategy
from specdecode.strategies.forced import ForcedStrategy
from specdecode.strategies.mtp import MtpStrategy
from specdecode.strategies.ngram_cache import NgramCache, NgramCacheStrategy, load
from specdecode.strategies.ngram_map import NgramMapStrategy
from specdecode.strategies.ngram_mod import NgramModConfig, NgramModPool, NgramModStrategy
from specdecode.strategies.ngram_simple import NgramMapConfig, NgramSimpleStrategy
from specdecode.strategies.suffix import SuffixStore, SuffixStrategy
from specdecode.vocab import VocabTranslator

if TYPE_CHECKING:
    from specdecode.constraints import Constraint
    from specdecode.strategies.dflash_head import DFlashHead
    from specdecode.strategies.eagle3_head import Eagle3Head
    from specdecode.strategies.mtp_head import MtpLayer


class SharedState:
    """What outlives a generation and is shared by all of them: the ngram-mod pool, the
    ngram-cache files and the suffix store. Loading happens here, once, so a bad file fails
    before any work. `lock` serialises the strategies that touch the first two, for generations
    running in parallel threads (the suffix store has its own, for learning only).
    vocab_size: the target's; cache files naming ids past it are refused."""

    def __init__(self, settings: NgramSettings, names: list[str], vocab_size: int | None = None) -> None:
        self.lock = threading.Lock()
        self.mod_pool = NgramModPool(settings.mod.n_match) if "ngram-mod" in names else None
        uses_cache = "ngram-cache" in names
        static = settings.cache_static
        self.cache_static = load(static, vocab_size) if uses_cache and static else None
        self.cache_dynamic: NgramCache | None = None
        if uses_cache and settings.cache_dynamic:
            path = settings.cache_dynamic
            self.cache_dynamic = load(path, vocab_size) if path.exists() else {}  # absent: created at the end
        uses_suffix = "suffix" in names
        self.suffix = SuffixStore(settings.suffix, settings.suffix_file, vocab_size) if uses_suffix else None


@dataclass(frozen=True)
class SpecSetup:
    """What strategies are built from for one generation."""

    target: Backend | None  # None only where no strategy needs a model (drafting benchmarks)
    sampling: SamplingParams
    verify: str = "match"
    seed: int = 0
    draft_backend: Backend | None = None
    draft: DraftModelConfig = field(default_factory=DraftModelConfig)
    translator: VocabTranslator | None = None
    eagle3_head: Eagle3Head | None = None  # uses the draft settings (`draft`) too
    dflash_head: DFlashHead | None = None  # likewise
    mtp_head: MtpLayer | None = None  # the target's own MTP layer; likewise
    ngram: NgramSettings = field(default_factory=NgramSettings)
    shared: SharedState | None = None
    constraint: Constraint | None = None  # the generation's grammar, if any


def _draft_sampler(setup: SpecSetup, stream: int) -> Sampler | None:
    """For rejection verification a model drafts by sampling from its own distribution, with its
    own stream of draws (one spawned stream per strategy, see `Sampler`)."""
    if setup.verify != "rejection":
        return None
    return Sampler(replace(setup.sampling, seed=setup.seed), stream)


def _build_draft_model(setup: SpecSetup) -> Strategy:
    if setup.draft_backend is None or setup.target is None:
        raise SpecdecodeError(NEEDS_DRAFT)
    sampler = _draft_sampler(setup, 1)
    return DraftModelStrategy(
        setup.draft_backend,
        setup.draft,
        target_vocab_size=setup.target.vocab.size,
        translator=setup.translator,
        sampler=sampler,
        constraint=setup.constraint,
    )


def _build_eagle3(setup: SpecSetup) -> Strategy:
    if setup.eagle3_head is None or setup.target is None:
        raise SpecdecodeError(NEEDS_HEAD)
    return Eagle3Strategy(
        setup.eagle3_head, setup.target, setup.draft, _draft_sampler(setup, 2), setup.constraint
    )


def _build_dflash(setup: SpecSetup) -> Strategy:
    if setup.dflash_head is None or setup.target is None:
        raise SpecdecodeError(NEEDS_DFLASH)
    return DFlashStrategy(
        setup.dflash_head, setup.target, setup.draft, _draft_sampler(setup, 3), setup.constraint
    )


def _build_mtp(setup: SpecSetup) -> Strategy:
    if setup.mtp_head is None or setup.target is None:
        raise SpecdecodeError(NEEDS_MTP)
    return MtpStrategy(setup.mtp_head, setup.target, setup.draft, _draft_sampler(setup, 4), setup.constraint)


def _shared(setup: SpecSetup) -> SharedState:
    assert setup.shared is not None, "n-gram strategies need the pipeline's SharedState"
    return setup.shared


class Synchronized:
    """A strategy whose every call holds the shared state's lock, so that generations in
    parallel threads never read the ngram-mod pool or the dynamic cache while another one
    writes it (a dict merged while another thread iterates it fails). Uncontended, the lock
    costs next to nothing next to a draft."""

    def __init__(self, strategy: Strategy, lock: threading.Lock) -> None:
        self.strategy = strategy
        self.name = strategy.name
        self.n_min = strategy.n_min
        self._lock = lock

    def begin(self, prompt: Sequence[int]) -> None:
        with self._lock:
            self.strategy.begin(prompt)

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        with self._lock:
            return self.strategy.draft(history, last, n_max)

    def accept(self, n_accepted: int) -> None:
        with self._lock:
            self.strategy.accept(n_accepted)

    def end(self) -> None:
        with self._lock:
            self.strategy.end()


def _build_ngram_mod(setup: SpecSetup) -> Strategy:
    shared = _shared(setup)
    return Synchronized(NgramModStrategy(setup.ngram.mod, shared.mod_pool), shared.lock)


def _build_ngram_cache(setup: SpecSetup) -> Strategy:
    shared = _shared(setup)
    strategy = NgramCacheStrategy(shared.cache_static, shared.cache_dynamic, setup.ngram.cache_dynamic)
    return Synchronized(strategy, shared.lock)


def _build_forced(setup: SpecSetup) -> Strategy:
    assert setup.constraint is not None, "forced drafting needs a constraint"
    return ForcedStrategy(setup.constraint)


FACTORIES: dict[str, Callable[[SpecSetup], Strategy]] = {
    "ngram-simple": lambda setup: NgramSimpleStrategy(setup.ngram.simple),
    "ngram-map-k": lambda setup: NgramMapStrategy(setup.ngram.map_k, key_only=True),
    # Classic llama.cpp built k4v from the map-k settings (a bug); its own flags apply here.
    "ngram-map-k4v": lambda setup: NgramMapStrategy(setup.ngram.map_k4v, key_only=False),
    "ngram-mod": _build_ngram_mod,
    "ngram-cache": _build_ngram_cache,
    "suffix": lambda setup: SuffixStrategy(setup.ngram.suffix, _shared(setup).suffix),
    "draft": _build_draft_model,
    "eagle3": _build_eagle3,
    "dflash": _build_dflash,
    "mtp": _build_mtp,
    "forced": _build_forced,
}
assert set(FACTORIES) == set(PRIORITY), "every strategy needs its place in PRIORITY, and every name a factory"
AVAILABLE = tuple(name for name in PRIORITY if name in FACTORIES)


def build_strategies(names: list[str], setup: SpecSetup) -> list[Strategy]:
    """The strategies named, in priority order. A constrained generation that speculates at all
    drafts forced tokens too; an unconstrained one has none to draft."""
    names = [name for name in names if name != "forced" or setup.constraint is not None]
    if setup.constraint is not None and names:
        names.append("forced")
    return [FACTORIES[name](setup) for name in PRIORITY if name in names]


__all__ = [
    "AVAILABLE",
    "PRIORITY",
    "Draft",
    "DraftModelConfig",
    "NgramMapConfig",
    "NgramModConfig",
    "NgramSettings",
    "SharedState",
    "SpecSetup",
    "Strategy",
    "build_strategies",
    "parse_spec_types",
]
