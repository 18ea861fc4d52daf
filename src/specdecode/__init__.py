"""specdecode: speculative decoding for Hugging Face causal LMs, lossless by construction.

The names below are imported on first use: `import specdecode` runs before any of its modules
does, so an eager import here would load torch for `specdecode --help` and every mistyped flag.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name -> the module that defines it.
_HOMES = {
    "Backend": "specdecode.backends",
    "Chunk": "specdecode.generate",
    "ConstraintSpec": "specdecode.constraints",
    "Draft": "specdecode.strategies",
    "DraftModelConfig": "specdecode.config",
    "Generation": "specdecode.generate",
    "GenerationConfig": "specdecode.generate",
    "GenerationStats": "specdecode.stats",
    "HFBackend": "specdecode.backends.hf",
    "LoadOptions": "specdecode.backends.options",
    "NgramMapConfig": "specdecode.config",
    "NgramModConfig": "specdecode.config",
    "NgramSettings": "specdecode.config",
    "Pipeline": "specdecode.api",
    "Result": "specdecode.api",
    "Sampler": "specdecode.sampling",
    "SamplingParams": "specdecode.config",
    "SpecdecodeError": "specdecode.errors",
    "SpeculationVerdict": "specdecode.stats",
    "Strategy": "specdecode.strategies",
    "StrategyStats": "specdecode.stats",
    "SuffixConfig": "specdecode.config",
    "VocabInfo": "specdecode.backends",
}

if TYPE_CHECKING:  # what type checkers and editors read, since they do not run __getattr__
    from specdecode.api import Pipeline, Result
    from specdecode.backends import Backend, VocabInfo
    from specdecode.backends.hf import HFBackend
    from specdecode.backends.options import LoadOptions
    from specdecode.config import (
        DraftModelConfig,
        NgramMapConfig,
        NgramModConfig,
        NgramSettings,
        SamplingParams,
        SuffixConfig,
    )
    from specdecode.constraints import ConstraintSpec
    from specdecode.errors import SpecdecodeError
    from specdecode.generate import Chunk, Generation, GenerationConfig
    from specdecode.sampling import Sampler
    from specdecode.stats import GenerationStats, SpeculationVerdict, StrategyStats
    from specdecode.strategies import Draft, Strategy

__all__ = [
    "Backend",
    "Chunk",
    "ConstraintSpec",
    "Draft",
    "DraftModelConfig",
    "Generation",
    "GenerationConfig",
    "GenerationStats",
    "HFBackend",
    "LoadOptions",
    "NgramMapConfig",
    "NgramModConfig",
    "NgramSettings",
    "Pipeline",
    "Result",
    "Sampler",
    "SamplingParams",
    "SpecdecodeError",
    "SpeculationVerdict",
    "Strategy",
    "StrategyStats",
    "SuffixConfig",
    "VocabInfo",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
