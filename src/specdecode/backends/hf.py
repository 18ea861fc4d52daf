"""PyTorch + Hugging Face transformers backend: a local model directory, a DynamicCache."""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Sequence
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

from specdecode.backends import VocabInfo, WholeChunks, check_cache_room
from specdecode.backends.hidden import HiddenRecorder, HiddenRows, recording
from specdecode.backends.options import LoadOptions as LoadOptions  # re-exported: the tools read it here
from specdecode.backends.tree import PendingTree, check_tree_room
from specdecode.config import DTYPE_NAMES
from specdecode.errors import SpecdecodeError

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class HFBackend:
    """A transformers causal LM with a rollback-able KV cache (see `specdecode.backends.Backend`)."""

    # Whether "auto" may pick bfloat16 on a CPU: only for a forward whose rows are invariant to
    # the number of rows in a pass (transformers' kernels are not, and in half precision the
    # difference can change a greedy token).
    half_precision_on_cpu = False
    # Why the weights run in another dtype than the stored one, for a command to say (see `load`).
    dtype_note: str | None = None
    # Which backend `--backend auto` chose for a directory and why, where llama.cpp's was a
    # candidate (see `specdecode.backends.hf_gguf`), for a command to say.
    backend_note: str | None = None

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
        self._fresh = WholeChunks(n_batch)
        self._cache = DynamicCache(config=model.config)
        self._cache_keyword = cache_keyword(model)
        self._recorder: HiddenRows | None = None  # set by capture_hidden
        self._tree = PendingTree()  # nodes scored by evaluate_tree, not yet committed
        self._tree_rows: HiddenRows | None = None  # their hidden-state rows, when recording
        self._tree_support: str | None = None  # why this model cannot score trees ("" if it can)
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
        backend = cls(
            model,
            tokenizer,
            n_ctx=options.n_ctx,
            n_batch=options.n_batch,
            threads=options.threads,
            name=directory.name,
            **cls.pass_options(options),
        )
        # Where "auto" would have kept bfloat16 but for this CPU (other backends run float32 on
        # every CPU): a user expecting the stored dtype is told why not.
        cpu_decided = options.dtype == "auto" and device.type == "cpu" and cls.half_precision_on_cpu
        if cpu_decided and _stored_dtype(config) == torch.bfloat16 and dtype == torch.float32:
            backend.dtype_note = (
                f"{directory.name}: this CPU has no bf16 units, so its bfloat16 weights run in float32 "
                "(faster here)"
            )
        return backend

    @classmethod
    def pass_options(cls, options: LoadOptions) -> dict:
        """Construction options of this backend class that `options` decides."""
        return {}

    def fork(self) -> HFBackend:
        """A backend over the same weights with its own empty KV cache and its own copy of the
        tokenizer (fast tokenizers must not be used from two threads at once): what lets
        generations run in parallel threads without loading the model twice."""
        return type(self)(self.model, copy.deepcopy(self.tokenizer), **self._options())

    def _options(self) -> dict:
        """The construction options a fork repeats."""
        return {"n_ctx": self.n_ctx, "n_batch": self.n_batch, "threads": self.threads, "name": self.name}

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
        self._tree_rows = self._new_recorder(layer_ids) if layer_ids else None

    def _new_recorder(self, layer_ids: Sequence[int]) -> HiddenRows:
        return HiddenRecorder(self.model, layer_ids, self.hidden_size)

    def hidden_states(self, start: int, end: int) -> torch.Tensor:
        if self._recorder is None:
            raise SpecdecodeError(f"{self.name}: hidden states were not captured (call capture_hidden first)")
        assert 0 <= start <= end <= len(self._tokens), (start, end, len(self._tokens))
        return self._recorder.rows(start, end)

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def output_embeddings(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

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
        check_cache_room(self.name, len(self._tokens), total, self.n_ctx)
        self._drop_tree()
        wanted = total if logits_rows is None else min(logits_rows, total)
        first_wanted = total - wanted
        rows: list[torch.Tensor] = []
        self._use_threads()
        for start in range(0, total, self.n_batch):
            end = min(start + self.n_batch, total)
            keep = end - max(start, first_wanted)
            position = len(self._tokens)
            logits = self._forward(ids[start:end], max(keep, 1))  # [1, max(keep,1), V]
            self._fresh.scored(position, end - start)
            if keep > 0:
                rows.append(logits[0, -keep:])
        if not rows:
            return torch.empty(0, self.vocab.size)
        out = torch.cat(rows) if len(rows) > 1 else rows[0]
        return out if out.dtype == torch.float64 else out.float().cpu()

    def reusable_prefix(self, cached: int, prompt_length: int | None = None) -> int:
        """How many of the first `cached` positions a new prompt (of any length) may keep: the
        whole chunks a fresh context would have scored in the same passes (transformers' kernels
        round a row by its pass's shape: a last prompt token re-scored alone differs from the
        whole prompt's pass by about 1e-5 in float32). The prompt's other chunks then have the
        shapes they have in a fresh run, so a cached prompt gives a fresh run's bits; a prompt
        shorter than `n_batch` is scored whole each time."""
        return self._fresh.reusable(cached)

    def truncate(self, n: int) -> None:
        n = max(0, n)
        self._drop_tree()
        if n >= len(self._tokens):
            return
        self._fresh.truncate(n)
        self._crop_cache(n)
        del self._tokens[n:]
        if self._recorder is not None:
            self._recorder.truncate(n)

    @torch.inference_mode()
    def evaluate_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """See `specdecode.backends.Backend.evaluate_tree`: one forward with a 4D attention mask
        (each node sees the prefix and its ancestors) and positions prefix + depth - 1; the nodes'
        entries are appended to the cache in node order until `commit`."""
        self._check_tree_support()
        prefix = len(self._tokens)
        check_tree_room(self.name, prefix, len(self._tree), len(ids), self.n_ctx)
        nodes = self._tree.add(ids, parents)
        self._use_threads()
        depths = [self._tree.depths[node] for node in nodes]
        positions = torch.tensor([[prefix + depth - 1 for depth in depths]], device=self.device)
        visible = self._tree.visibility(nodes, prefix, self.device)
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]  # [1, 1, N, prefix + P]
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with recording(self._tree_rows):  # type: ignore[arg-type]
            logits = self._run_cached(input_ids=input_ids, position_ids=positions, attention_mask=mask)[0]
        return logits if logits.dtype == torch.float64 else logits.float().cpu()

    @torch.inference_mode()
    def commit(self, path: Sequence[int]) -> None:
        """See `specdecode.backends.Backend.commit`: the path's cache entries move up to follow
        the prefix, in order, and everything after them is cropped."""
        path = self._tree.check_path(path)
        prefix = len(self._tokens)
        if path:
            source = torch.tensor([prefix + node for node in path], device=self.device)
            for layer in self._cache.layers:
                layer.keys[:, :, prefix : prefix + len(path)] = layer.keys[:, :, source]
                layer.values[:, :, prefix : prefix + len(path)] = layer.values[:, :, source]
        self._keep_path(path)
        self._crop_cache(len(self._tokens))

    def _keep_path(self, path: list[int]) -> None:
        """The committed path's tokens and hidden rows join the prefix; the tree is forgotten."""
        if path and self._recorder is not None and self._tree_rows is not None:
            self._recorder.extend(self._tree_rows.rows(0, len(self._tree_rows))[path])
        self._tokens.extend(self._tree.tokens[node] for node in path)
        self._tree.clear()
        if self._tree_rows is not None:
            self._tree_rows.truncate(0)

    def _drop_tree(self) -> None:
        """Forget the pending nodes (a new prefix is coming)."""
        if len(self._tree):
            self._keep_path([])
            self._crop_cache(len(self._tokens))

    def _crop_cache(self, n: int) -> None:
        if n == 0:
            self._cache = DynamicCache(config=self.model.config)
        elif self._cache.get_seq_length() > n:
            self._cache.crop(n - self._cache.get_seq_length())

    def _check_tree_support(self) -> None:
        """Trees need a model whose attention takes a custom 4D mask and explicit positions, as
        transformers' decoders built on `create_causal_mask` do with eager or SDPA attention."""
        if self._tree_support is None:
            implementation = getattr(self.model.config, "_attn_implementation", None)
            decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
            try:
                source = inspect.getsource(type(decoder).forward)
            except (OSError, TypeError):
                source = ""
            if implementation not in ("eager", "sdpa"):
                self._tree_support = f"its attention implementation is {implementation!r}"
            elif "create_causal_mask(" not in source:
                self._tree_support = f"{type(decoder).__name__} does not take a custom 4D attention mask"
            elif _uses_sliding_window(self.model.config):
                self._tree_support = "it uses sliding-window attention, which a custom mask would override"
            else:
                self._tree_support = ""
        if self._tree_support:
            raise SpecdecodeError(
                f"{self.name}: token trees need the native backend here ({self._tree_support}); "
                'use a chain (the default) or the native backend (backend="native", --backend native)'
            )

    def _forward(self, chunk: Sequence[int], keep: int) -> torch.Tensor:
        input_ids = torch.tensor([list(chunk)], dtype=torch.long, device=self.device)  # [1, T]
        with recording(self._recorder):
            logits = self._run_cached(input_ids=input_ids, logits_to_keep=keep)
        self._tokens.extend(chunk)
        return logits

    def _run_cached(self, **inputs) -> torch.Tensor:
        """One forward of the model over the KV cache, which it extends; its logits."""
        out = self.model(**inputs, **{self._cache_keyword: self._cache}, use_cache=True)
        self._cache = out[self._cache_keyword]
        return out.logits

    def _use_threads(self) -> None:
        # torch's thread count is global: set it per call so target and draft each get theirs.
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name `model`'s forward takes its KV cache by, and returns it under. transformers 5.24
    renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40); earlier 5.x
    releases know only the old name, and a forward that takes **kwargs would ignore the new one,
    running without its cache. Read from the forward's signature, once per model."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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
    keyword = cache_keyword(model)
    try:
        out = model(input_ids=ids, **{keyword: DynamicCache(config=model.config)}, use_cache=True)
        cache = out.get(keyword)
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
    stored = _stored_dtype(config)
    if device.type == "cuda" or stored == torch.float64:
        return stored
    # On a CPU, half precision pays only with native bfloat16 arithmetic (AVX512-BF16, AMX):
    # half the bytes to read per token, and passes of a few rows cost little more than one.
    if stored == torch.bfloat16 and half_on_cpu and cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def _stored_dtype(config) -> torch.dtype:
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return DTYPES.get(str(stored).removeprefix("torch."), torch.float32)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16, AMX): without such units
    torch emulates bfloat16, several times slower than float32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _uses_sliding_window(config) -> bool:
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)


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
