"""What every section of the GPU check reads (`Run`), the backends and random-weight models it
measures, and the timing and comparing helpers the sections share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from specdecode.backends import Backend
from specdecode.backends.load import native_backend
from specdecode.compare.gpu_report import Report
from specdecode.compare.gpu_setup import LLAMA3_ROPE, N_CTX, SEED, Shape, Sizes
from specdecode.generate import Generation
from specdecode.strategies.dflash_head import DFlashConfig, DFlashHead
from specdecode.strategies.dflash_head import default_layer_ids as dflash_layer_ids
from specdecode.strategies.eagle3_head import Eagle3Config, Eagle3Head
from specdecode.strategies.eagle3_layouts import default_layer_ids
from specdecode.strategies.mtp_head import MtpConfig, MtpLayer


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
    bandwidth: float | None = None  # bytes/s that MBU is put against (set by the speed section)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shape_share(self, shape: Shape, budget: float | None) -> float | None:
        """The seconds of a section's budget spent by the end of this shape's part: an equal
        share per shape, plus what earlier shapes left. Only the most important parts of a
        section may run past it (None: no limit)."""
        if budget is None:
            return None
        return budget * (self.shapes.index(shape) + 1) / len(self.shapes)


@dataclass(frozen=True)
class Timing:
    """One timed generation of a batch-1 decode: its tokens, its seconds and those to its first
    token (the prompt's pass and the token it gives), so that decoding is timed apart."""

    tokens: list[int]
    seconds: float
    first: float
    idle: float | None = None  # the share of the seconds the GPU idled (None: not measured)

    @property
    def decode_rate(self) -> float:
        """Tokens after the first over the seconds after it."""
        return (len(self.tokens) - 1) / (self.seconds - self.first)


class Clock:
    """Times one generation against the device: from now to the first token, and to the end.
    Every system is timed the same way: from the call to the first token on the host, and to
    the last."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.first: float | None = None
        run.sync()
        self.start = time.perf_counter()

    def first_token(self) -> None:
        """The first token is out (only the first call counts)."""
        if self.first is None:
            self.run.sync()
            self.first = time.perf_counter() - self.start

    def stop(self, tokens: list[int], idle: float | None = None) -> Timing:
        self.run.sync()
        seconds = time.perf_counter() - self.start
        if self.first is None:
            raise RuntimeError("the generation gave no first token to time")
        return Timing(tokens, seconds, self.first, idle)


def make_backend(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, mode: str, name: str, n_ctx: int = N_CTX
) -> Backend:
    return native_backend(model, tokenizer, passes=mode, n_ctx=n_ctx, name=name)


def busy_seconds(backend: Backend) -> float | None:
    """GPU seconds of the backend's passes since its last reset (None: it does not measure them)."""
    measure = getattr(backend, "busy_seconds", None)
    seconds = measure() if measure is not None else None
    return seconds if seconds else None


def reset_busy(backend: Backend) -> None:
    reset = getattr(backend, "reset_busy", None)
    if reset is not None:
        reset()


def engines(backends: Sequence[Backend]) -> list[Backend]:
    """One backend per engine: forks share one, whose GPU time is counted once."""
    return list({getattr(backend, "pass_key", id(backend)): backend for backend in backends}.values())


def start_gpu_timing(backends: Sequence[Backend]) -> None:
    for backend in engines(backends):
        reset_busy(backend)


def gpu_seconds(backends: Sequence[Backend]) -> float | None:
    """The GPU seconds of the engines' passes since `start_gpu_timing` (None: one does not measure them)."""
    busy = [busy_seconds(backend) for backend in engines(backends)]
    return None if None in busy else sum(busy)  # type: ignore[arg-type]


def truncate_all(backends: Sequence[Backend], length: int) -> None:
    for backend in backends:
        backend.truncate(length)


def timed_generation(
    run: Run, backends: Sequence[Backend], start: Generation | Callable[[], Generation]
) -> tuple[Generation, Timing]:
    """A generation of ours iterated to its end, timed as every batch-1 figure is: to its first
    token and to its last (from the call that makes it, where `start` is one), with the share
    of them the GPU idled in the backends' passes."""
    start_gpu_timing(backends)
    clock = Clock(run)
    generation = start if isinstance(start, Generation) else start()
    for _ in generation:
        clock.first_token()
    timing = clock.stop(list(generation.tokens))
    busy = gpu_seconds(backends)
    return generation, replace(timing, idle=None if busy is None else 1.0 - busy / timing.seconds)


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
    with random_weights(device):
        model = LlamaForCausalLM(llama_config(shape))
    return model.eval()


@contextmanager
def random_weights(device: torch.device) -> Iterator[None]:
    """Modules made inside get seeded random bfloat16 weights, made on `device` itself."""
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


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


HEAD_DRAFT_VOCAB = 32000  # published EAGLE-3 heads of Llama 3 draft from 32k ids
# Published DFlash drafters of 8B targets (z-lab's): 5 layers over 5 target layers, blocks of 16.
DFLASH_LAYERS = 5
DFLASH_BLOCK = 16


def random_head(shape: Shape, model: PreTrainedModel, device: torch.device) -> Eagle3Head:
    """A random EAGLE-3 head of the shape published for a target of `shape`: one decoder layer
    of the target's width over three of its layers' inputs, a 32k draft vocabulary mapped into
    the target's (d2t), the target's embeddings shared. A target of fewer than 6 layers (the
    tiny one) is read at its first, middle and last layer inputs."""
    layers = default_layer_ids(shape.layers) if shape.layers >= 6 else (0, shape.layers // 2, shape.layers)
    config = Eagle3Config(
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        target_hidden_size=shape.hidden,
        target_layer_ids=layers,
        vocab_size=shape.vocab,
        draft_vocab_size=min(HEAD_DRAFT_VOCAB, shape.vocab // 2),
        rope_theta=500000.0,
    )
    with random_weights(device):
        head = Eagle3Head(config, model.get_input_embeddings().weight)
    return head.eval()


def random_dflash(shape: Shape, model: PreTrainedModel, device: torch.device) -> DFlashHead:
    """A random DFlash drafter of the published 8B drafters' shape: DFLASH_LAYERS decoder layers
    of the target's width over as many target layers (z-lab's spacing), blocks of DFLASH_BLOCK,
    the target's rotary scaling, embeddings and output head."""
    config = DFlashConfig(
        hidden_size=shape.hidden,
        num_hidden_layers=DFLASH_LAYERS,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        target_layer_ids=dflash_layer_ids(shape.layers, DFLASH_LAYERS),
        block_size=DFLASH_BLOCK,
        mask_token_id=shape.vocab - 1,
        vocab_size=shape.vocab,
        max_position_embeddings=N_CTX,
        rope_theta=LLAMA3_ROPE["rope_theta"],
        rope_scaling={key: value for key, value in LLAMA3_ROPE.items() if key != "rope_theta"},
    )
    with random_weights(device):
        head = DFlashHead(config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return head.eval()


def random_mtp(shape: Shape, model: PreTrainedModel, device: torch.device) -> MtpLayer:
    """A random MTP layer for a target of `shape`: one decoder layer of its shape, reading its
    final hidden state, with its embeddings, output head and final norm."""
    config = MtpConfig(
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        n_layers=shape.layers,
        rope_theta=500000.0,
    )
    embeddings = model.get_input_embeddings().weight
    with random_weights(device):
        layer = MtpLayer(config, embeddings, model.get_output_embeddings().weight, model.model.norm.weight)
    return layer.eval()
