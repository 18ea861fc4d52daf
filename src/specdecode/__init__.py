"""specdecode: speculative decoding for Hugging Face causal LMs, lossless by construction."""

from specdecode.api import Pipeline, Result
from specdecode.backends import Backend, VocabInfo
from specdecode.backends.hf import HFBackend, LoadOptions
from specdecode.constraints import ConstraintSpec
from specdecode.errors import SpecdecodeError
from specdecode.generate import Chunk, Generation, GenerationConfig
from specdecode.sampling import Sampler, SamplingParams
from specdecode.stats import GenerationStats, StrategyStats
from specdecode.strategies import Draft, DraftModelConfig, Strategy

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
    "Pipeline",
    "Result",
    "Sampler",
    "SamplingParams",
    "SpecdecodeError",
    "Strategy",
    "StrategyStats",
    "VocabInfo",
]
