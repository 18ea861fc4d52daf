"""PyTorch + Hugging Face transformers backend: a local model directory, a DynamicCache."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Cache,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdecode.backends import VocabInfo
from specdecode.backends.hidden import HiddenRecorder, HiddenRows, recording
from specdecode.errors import SpecdecodeError

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class LoadOptions:
    """How to load one model. n_ctx 0 means the model's own maximum context."""

    device: str = "cpu"
    dtype: str = "auto"  # "auto": the stored dtype on a GPU, float32 on the CPU
    threads: int | None = None
    n_ctx: int = 0
    n_batch: int = 512
    backend: str = "auto"  # "auto": native for the model types it runs, else "hf" (see load_backend)

    def __post_init__(self) -> None:
        if self.n_ctx < 0:
            raise SpecdecodeError(f"the context size must be >= 0 (0: the model's own), not {self.n_ctx}")
        if self.n_batch < 1:
            raise SpecdecodeError(f"the batch size must be >= 1, not {self.n_batch}")
        if self.threads is not None and self.threads < 1:
            raise SpecdecodeError(f"the thread count must be >= 1, not {self.threads}")


class HFBackend:
    """A transformers causal LM with a rollback-able KV cache (see `specdecode.backends.Backend`)."""

    # Whether "auto" may pick bfloat16 on a CPU: only for a forward whose rows are invariant to
    # the number of rows in a pass (transformers' kernels are not, and in half precision the
    # difference can change a greedy token).
    half_precision_on_cpu = False

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        n_ctx: int = 0,
        n_batch: int = 512,
        threads: int | None = None,
        name: str = "model",
    ) -> None:
        if n_batch < 1:
            raise SpecdecodeError("batch size must be >= 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        self.n_ctx = n_ctx if n_ctx > 0 else int(getattr(model.config, "max_position_embeddings", 2048))
        self.n_batch = n_batch
        self.threads = threads
        self.vocab = _vocab_info(model, tokenizer)
        self._texts: list[str] | None = None
        self._tokens: list[int] = []
        self._cache = DynamicCache(config=model.config)
        self._recorder: HiddenRows | None = None  # set by capture_hidden
        self.n_layers = int(model.config.num_hidden_layers)
        self.hidden_size = int(model.config.hidden_size)

    @classmethod
    def load(cls, path: str | Path, options: LoadOptions = LoadOptions()) -> HFBackend:
        """Load a causal LM and its tokenizer from a local Hugging Face directory."""
        directory = check_model_directory(Path(path))
        device = _check_device(options.device)
        config = load_model_config(directory)
        tokenizer = load_tokenizer(directory)
        if options.threads:
            torch.set_num_threads(options.threads)
        dtype = _resolve_dtype(options.dtype, config, device, cls.half_precision_on_cpu)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                directory, dtype=dtype, local_files_only=True, output_loading_info=True
            )
        except Exception as exc:  # transformers raises many types for unreadable weights
            raise SpecdecodeError(f"cannot read the weights in {directory}: {exc}") from None
        if info["missing_keys"]:
            # transformers would fill them with random values; refuse instead.
            missing = sorted(info["missing_keys"])
            raise SpecdecodeError(
                f"the weights in {directory} do not fit its config: {len(missing)} tensors missing "
                f"(e.g. {', '.join(missing[:3])})"
            )
        model = model.to(device)
        check_loaded_model(model, tokenizer, directory)
        return cls(
            model,
            tokenizer,
            n_ctx=options.n_ctx,
            n_batch=options.n_batch,
            threads=options.threads,
            name=directory.name,
        )

    def fork(self) -> HFBackend:
        """A backend over the same weights with its own empty KV cache and its own copy of the
        tokenizer (fast tokenizers must not be used from two threads at once): what lets
        generations run in parallel threads without loading the model twice."""
        return type(self)(
            self.model,
            copy.deepcopy(self.tokenizer),
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            threads=self.threads,
            name=self.name,
        )

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        """See `specdecode.backends.HiddenStates`."""
        layer_ids = [int(layer) for layer in layer_ids]
        current = self._recorder.layer_ids if self._recorder is not None else []
        if layer_ids == current:
            return
        bad = [layer for layer in layer_ids if not 0 <= layer <= self.n_layers]
        if bad:
            raise SpecdecodeError(
                f"{self.name}: hidden-state layer {bad[0]} does not exist (layers 0..{self.n_layers}, "
                f"{self.n_layers} meaning the output of the last one)"
            )
        self.truncate(0)  # cached positions have no rows for the new choice
        self._recorder = self._new_recorder(layer_ids) if layer_ids else None

    def _new_recorder(self, layer_ids: Sequence[int]) -> HiddenRows:
        return HiddenRecorder(self.model, layer_ids, self.hidden_size)

    def hidden_states(self, start: int, end: int) -> torch.Tensor:
        if self._recorder is None:
            raise SpecdecodeError(f"{self.name}: hidden states were not captured (call capture_hidden first)")
        assert 0 <= start <= end <= len(self._tokens), (start, end, len(self._tokens))
        return self._recorder.rows(start, end)

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def detokenize(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
        )

    def token_text(self, token_id: int) -> str:
        if self._texts is None:
            self._texts = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return self._texts[token_id] if 0 <= token_id < len(self._texts) else ""

    @torch.inference_mode()
    def evaluate(self, ids: Sequence[int], logits_rows: int | None = None) -> torch.Tensor:
        total = len(ids)
        assert total > 0, "evaluate needs at least one token"
        if len(self._tokens) + total > self.n_ctx:
            raise SpecdecodeError(
                f"{self.name}: context full ({len(self._tokens)} + {total} tokens > n_ctx {self.n_ctx})"
            )
        wanted = total if logits_rows is None else min(logits_rows, total)
        first_wanted = total - wanted
        rows: list[torch.Tensor] = []
        self._use_threads()
        for start in range(0, total, self.n_batch):
            end = min(start + self.n_batch, total)
            keep = end - max(start, first_wanted)
            logits = self._forward(ids[start:end], max(keep, 1))  # [1, max(keep,1), V]
            if keep > 0:
                rows.append(logits[0, -keep:])
        if not rows:
            return torch.empty(0, self.vocab.size)
        out = torch.cat(rows) if len(rows) > 1 else rows[0]
        return out if out.dtype == torch.float64 else out.float().cpu()

    def truncate(self, n: int) -> None:
        n = max(0, n)
        if n >= len(self._tokens):
            return
        if n == 0:
            self._cache = DynamicCache(config=self.model.config)
        else:
            self._cache.crop(n - len(self._tokens))
        del self._tokens[n:]
        if self._recorder is not None:
            self._recorder.truncate(n)

    def _forward(self, chunk: Sequence[int], keep: int) -> torch.Tensor:
        input_ids = torch.tensor([list(chunk)], dtype=torch.long, device=self.device)  # [1, T]
        with recording(self._recorder):
            out = self.model(
                input_ids=input_ids, past_key_values=self._cache, use_cache=True, logits_to_keep=keep
            )
        self._cache = out.past_key_values
        self._tokens.extend(chunk)
        return out.logits

    def _use_threads(self) -> None:
        # torch's thread count is global: set it per call so target and draft each get theirs.
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def check_model_directory(directory: Path) -> Path:
    if not directory.exists():
        raise SpecdecodeError(f"model directory not found: {directory}")
    if not directory.is_dir():
        raise SpecdecodeError(f"not a directory: {directory} (expected a Hugging Face model directory)")
    if not (directory / "config.json").is_file():
        raise SpecdecodeError(f"{directory} is not a Hugging Face model directory: config.json is missing")
    if not any(any(directory.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise SpecdecodeError(f"{directory} has no weights (*.safetensors or pytorch_model.bin)")
    return directory


def _check_device(device: str) -> torch.device:
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise SpecdecodeError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecodeError("device cuda was asked for, but no CUDA GPU is available")
    if parsed.type not in ("cpu", "cuda"):
        raise SpecdecodeError(f"unsupported device {device!r} (use cpu, cuda or cuda:N)")
    return parsed


def load_model_config(directory: Path):
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # unreadable JSON, unknown types, and transformers' own validation
        message = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else type(exc).__name__
        raise SpecdecodeError(f"cannot read {directory / 'config.json'}: {message}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise SpecdecodeError(
            f"{directory} is not a causal language model (model_type {config.model_type!r} "
            "has no causal-LM head in transformers)"
        )
    if getattr(config, "num_hidden_layers", 1) < 1:
        raise SpecdecodeError(f"{directory} describes a model with no layers (num_hidden_layers 0)")
    return config


@torch.inference_mode()
def check_loaded_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Refuse what would fail or go wrong only mid-generation: a tokenizer with ids past the
    embedding (an IndexError on the first such id), and a model that returns no usable KV cache
    (an encoder such as BERT, which transformers also lists among causal LMs: without a cache,
    every pass after the first would see no context, and a rollback would fail)."""
    rows = int(model.get_input_embeddings().weight.shape[0])
    if len(tokenizer) > rows:
        raise SpecdecodeError(
            f"{directory}: the tokenizer has {len(tokenizer)} ids but the model's embedding only {rows} "
            f"rows (ids {rows}..{len(tokenizer) - 1} would index past it)"
        )
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    ids = torch.tensor([[first]], device=next(model.parameters()).device)
    try:
        cache = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        cache = cache.past_key_values
    except Exception as exc:  # a model that cannot even run one token with a cache
        raise SpecdecodeError(f"{directory}: the model cannot run with a KV cache ({exc})") from None
    if not isinstance(cache, Cache) or cache.get_seq_length() != 1:
        raise SpecdecodeError(
            f"{directory} is not a causal language model: it returns no usable KV cache "
            f"(model_type {model.config.model_type!r})"
        )


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local model directory (all that tools like `lookup` need of a model)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SpecdecodeError(f"model directory not found: {directory}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # missing files surface as OSError, ValueError or TypeError
        raise SpecdecodeError(f"cannot load the tokenizer in {directory}: {exc}") from None
    if isinstance(tokenizer, bool) or not hasattr(tokenizer, "decode"):
        raise SpecdecodeError(f"{directory} has no usable tokenizer files")
    return tokenizer


def _resolve_dtype(name: str, config, device: torch.device, half_on_cpu: bool) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise SpecdecodeError(f"unknown dtype {name!r} (choose from auto, {', '.join(DTYPES)})")
        return DTYPES[name]
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = DTYPES.get(str(stored).removeprefix("torch."), torch.float32)
    if device.type == "cuda" or stored == torch.float64:
        return stored
    # On a CPU, half precision pays only with native bfloat16 arithmetic (AVX512-BF16, AMX):
    # half the bytes to read per token, and passes of a few rows cost little more than one.
    if stored == torch.bfloat16 and half_on_cpu and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _vocab_info(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> VocabInfo:
    size = int(model.get_output_embeddings().weight.shape[0])
    probe_with = tokenizer("a", add_special_tokens=True)["input_ids"]
    probe_without = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = bos is not None and len(probe_with) > len(probe_without) and probe_with[0] == bos
    add_eos = eos is not None and len(probe_with) > len(probe_without) and probe_with[-1] == eos
    return VocabInfo(
        size=size,
        kind=_vocab_kind(tokenizer),
        bos_id=bos,
        eos_id=eos,
        add_bos=add_bos,
        add_eos=add_eos,
        eog_ids=frozenset(_eog_ids(model, tokenizer)),
    )


def _vocab_kind(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "unknown"
    model = json.loads(backend.to_str()).get("model", {})
    kind = model.get("type", "unknown")
    if kind == "BPE":
        return "spm" if model.get("byte_fallback") else "bpe"
    return {"Unigram": "ugm", "WordPiece": "wpm", "WordLevel": "word"}.get(kind, kind.lower())


def _eog_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    sources = [tokenizer.eos_token_id, model.config.eos_token_id]
    if model.generation_config is not None:
        sources.append(model.generation_config.eos_token_id)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(t) for t in source)
    return ids
