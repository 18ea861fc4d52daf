"""HFBackend: KV-cache rollback, chunked evaluation, loading and the errors users see."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB_SIZE, TargetSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import CLIPVisionConfig, T5Config, ViTConfig

from specdecode import (
    DraftModelConfig,
    GenerationConfig,
    HFBackend,
    LoadOptions,
    Pipeline,
    SamplingParams,
    SpecdecodeError,
)
from specdecode.backends import common_prefix, evaluate_continuation
from specdecode.testing import make_tokenizer, save_model

SPEC = TargetSpec(seed=4, hidden=32, layers=2)
ATOL = 1e-10
GREEDY = SamplingParams(temperature=0)

token_ids = st.integers(0, VOCAB_SIZE - 1)


@pytest.fixture(scope="module")
def model(zoo):
    return zoo.target(SPEC)


def fresh_logits(model, tokenizer, ids) -> torch.Tensor:
    """Logits of every position of `ids`, computed from an empty cache in one chunk."""
    return HFBackend(model, tokenizer).evaluate(ids)


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert a.dtype == b.dtype == torch.float64
    assert torch.allclose(a, b, rtol=0, atol=ATOL), float((a - b).abs().max())


# --------------------------------------------------------------------------- evaluate / truncate


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.lists(token_ids, min_size=1, max_size=24),
    ops=st.lists(
        st.tuples(st.integers(-2, 30), st.lists(token_ids, min_size=1, max_size=8)), min_size=1, max_size=4
    ),
    n_batch=st.sampled_from([1, 3, 512]),
)
def test_truncate_then_evaluate_equals_fresh_evaluation(zoo, tokenizer, model, first, ops, n_batch):
    """Rolling the cache back to n and evaluating other tokens gives the logits a fresh
    backend computes for the same whole sequence."""
    backend = zoo.backend(model, n_batch=n_batch)
    backend.evaluate(first)
    expected_tokens = list(first)
    for n, new in ops:
        backend.truncate(n)
        expected_tokens = expected_tokens[: max(0, n)]
        assert backend.tokens == expected_tokens
        out = backend.evaluate(new)
        expected_tokens += new
        assert backend.tokens == expected_tokens
        reference = fresh_logits(model, tokenizer, expected_tokens)[-len(new) :]
        assert_close(out, reference)


def test_truncate_to_zero_then_evaluate(zoo, tokenizer, model):
    backend = zoo.backend(model)
    backend.evaluate([5, 6, 7, 8])
    backend.truncate(0)
    assert backend.tokens == []
    assert_close(backend.evaluate([9, 10]), fresh_logits(model, tokenizer, [9, 10]))


def test_truncate_past_the_end_and_negative(zoo, model):
    backend = zoo.backend(model)
    backend.evaluate([5, 6, 7])
    backend.truncate(10)
    assert backend.tokens == [5, 6, 7]
    backend.truncate(3)
    assert backend.tokens == [5, 6, 7]
    backend.truncate(-1)
    assert backend.tokens == []


@pytest.mark.parametrize("n_batch", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("logits_rows", [None, 1, 2, 5, 16, 100])
def test_chunked_evaluation_equals_one_chunk(zoo, tokenizer, model, n_batch, logits_rows):
    ids = list(range(20, 36))  # 16 tokens
    whole = fresh_logits(model, tokenizer, ids)
    backend = zoo.backend(model, n_batch=n_batch)
    out = backend.evaluate(ids, logits_rows=logits_rows)
    rows = len(ids) if logits_rows is None else min(logits_rows, len(ids))
    assert out.shape == (rows, VOCAB_SIZE)
    assert_close(out, whole[-rows:])
    assert backend.tokens == ids


def test_logits_rows_one_returns_only_the_last_row(zoo, tokenizer, model):
    ids = [11, 12, 13, 14, 15]
    backend = zoo.backend(model)
    out = backend.evaluate(ids, logits_rows=1)
    assert out.shape == (1, VOCAB_SIZE)
    assert_close(out[0], fresh_logits(model, tokenizer, ids)[-1])


def test_logits_rows_zero_returns_no_rows(zoo, model):
    """Asking for no rows is a valid request (the protocol: "the last logits_rows rows")."""
    backend = zoo.backend(model)
    out = backend.evaluate([11, 12, 13], logits_rows=0)
    assert out.shape == (0, VOCAB_SIZE)
    assert backend.tokens == [11, 12, 13]


def test_incremental_evaluation_equals_one_pass(zoo, tokenizer, model):
    ids = list(range(40, 52))
    backend = zoo.backend(model)
    rows = [backend.evaluate([t])[0] for t in ids]
    assert_close(torch.stack(rows), fresh_logits(model, tokenizer, ids))


def test_evaluate_continuation_reuses_the_cached_prefix(zoo, tokenizer, model):
    backend = zoo.backend(model)
    backend.evaluate([5, 6, 7, 8, 9])
    for ids in ([5, 6, 7, 8, 9], [5, 6, 7, 20, 21], [5, 6], [30], [5, 6, 7, 20, 21, 22, 23]):
        out = evaluate_continuation(backend, ids)
        assert out.shape == (VOCAB_SIZE,)
        assert backend.tokens == ids
        assert_close(out, fresh_logits(model, tokenizer, ids)[-1])


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1


def test_context_overflow_raises_and_leaves_the_cache_alone(zoo, tokenizer, model):
    backend = zoo.backend(model, n_ctx=8)
    backend.evaluate([3, 4, 5, 6, 7])
    with pytest.raises(SpecdecodeError, match="context full"):
        backend.evaluate([8, 9, 10, 11])
    assert backend.tokens == [3, 4, 5, 6, 7]
    out = backend.evaluate([8, 9, 10])  # exactly fills the context
    assert_close(out, fresh_logits(model, tokenizer, [3, 4, 5, 6, 7, 8, 9, 10])[-3:])
    with pytest.raises(SpecdecodeError, match="n_ctx 8"):
        backend.evaluate([11])


def test_n_ctx_defaults_to_the_model_maximum(zoo, model):
    assert zoo.backend(model).n_ctx == model.config.max_position_embeddings
    assert zoo.backend(model, n_ctx=16).n_ctx == 16


def test_bad_batch_size(zoo, model):
    with pytest.raises(SpecdecodeError, match="batch size"):
        zoo.backend(model, n_batch=0)


# --------------------------------------------------------------------------- tokenizer facts


def test_vocab_info(zoo, model):
    vocab = zoo.backend(model).vocab
    assert vocab.size == VOCAB_SIZE
    assert vocab.kind == "bpe"
    assert (vocab.bos_id, vocab.eos_id) == (0, 1)
    assert vocab.add_bos is True and vocab.add_eos is False
    assert vocab.eog_ids == frozenset({1})


def test_vocab_info_without_bos(zoo, model, no_bos_tokenizer):
    vocab = zoo.backend(model, no_bos_tokenizer).vocab
    assert vocab.add_bos is False
    assert vocab.bos_id == 0 and vocab.kind == "bpe"


def test_tokenize_detokenize_and_token_text(zoo, model, tokenizer):
    backend = zoo.backend(model)
    text = "def fill(text, width=70):\n    return '\\n'.join(wrap(text))"
    ids = backend.tokenize(text)
    assert ids[0] == 0
    assert backend.tokenize(text, add_special=False) == ids[1:]
    assert backend.detokenize(ids) == text
    assert backend.detokenize(ids, skip_special=False).startswith("<|bos|>")
    assert backend.token_text(1) == "<|eos|>"
    assert backend.token_text(ids[1]) == tokenizer.convert_ids_to_tokens(ids[1])
    assert backend.token_text(VOCAB_SIZE) == ""
    assert backend.token_text(-1) == ""


# --------------------------------------------------------------------------- loading


def test_save_then_load_round_trip(saved_model_dir, tokenizer, zoo):
    model = zoo.target(TargetSpec(seed=7, hidden=16, layers=1))
    loaded = HFBackend.load(saved_model_dir, LoadOptions(dtype="float64", n_ctx=64, n_batch=4))
    assert loaded.n_ctx == 64 and loaded.n_batch == 4
    assert loaded.name == "model"
    assert loaded.vocab == zoo.backend(model).vocab
    ids = list(range(3, 40))
    assert_close(loaded.evaluate(ids), fresh_logits(model, tokenizer, ids))
    assert loaded.tokenize("hello world") == zoo.backend(model).tokenize("hello world")


def test_load_auto_dtype_keeps_float64_and_float32_option(saved_model_dir):
    assert HFBackend.load(saved_model_dir).model.dtype == torch.float64  # auto: stored dtype, float64 kept
    loaded = HFBackend.load(str(saved_model_dir), LoadOptions(dtype="float32"))
    assert loaded.model.dtype == torch.float32
    out = loaded.evaluate([3, 4, 5])
    assert out.dtype == torch.float32 and out.shape == (3, VOCAB_SIZE)


def test_pipeline_load_generates_like_the_in_memory_model(saved_model_dir, zoo):
    model = zoo.target(TargetSpec(seed=7, hidden=16, layers=1))
    options = LoadOptions(dtype="float64")
    pipe = Pipeline.load(
        saved_model_dir,
        draft=saved_model_dir,
        target_options=options,
        draft_options=options,
        draft_config=DraftModelConfig(n_max=4, p_min=0.0),
    )
    config = GenerationConfig(n_predict=20, ignore_eos=True)
    expected = Pipeline(zoo.backend(model)).generate("def f(x):", GREEDY, config)
    result = pipe.generate("def f(x):", GREEDY, config)
    assert result.tokens == expected.tokens
    assert result.stats.totals.n_accepted == result.stats.totals.n_drafted > 0


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _replace_config(directory: Path, config) -> None:
    (directory / "config.json").unlink()
    config.save_pretrained(directory)


def load_error(path, options: LoadOptions | None = None) -> str:
    with pytest.raises(SpecdecodeError) as info:
        HFBackend.load(path, options or LoadOptions())
    return str(info.value)


def test_missing_directory(tmp_path):
    assert "not found" in load_error(tmp_path / "nope")


def test_file_instead_of_directory(saved_model_dir):
    assert "not a directory" in load_error(saved_model_dir / "config.json")


def test_directory_without_config(saved_model_dir):
    (saved_model_dir / "config.json").unlink()
    assert "config.json is missing" in load_error(saved_model_dir)


def test_empty_directory(tmp_path):
    assert "config.json is missing" in load_error(tmp_path)


@pytest.mark.parametrize("config_text", ["{not json", "{}", '{"model_type": "no_such_model_type"}'])
def test_unreadable_config(saved_model_dir, config_text):
    (saved_model_dir / "config.json").write_text(config_text)
    message = load_error(saved_model_dir)
    assert "cannot read" in message and "config.json" in message


@pytest.mark.parametrize("config", [ViTConfig(), T5Config(), CLIPVisionConfig()], ids=lambda c: c.model_type)
def test_not_a_causal_lm(saved_model_dir, config):
    _replace_config(saved_model_dir, config)
    message = load_error(saved_model_dir)
    assert "not a causal language model" in message and repr(config.model_type) in message


def test_no_weights(saved_model_dir):
    (saved_model_dir / "model.safetensors").unlink()
    assert "has no weights" in load_error(saved_model_dir)


@pytest.mark.parametrize("content", [b"", b"garbage" * 20, b"\x08\x00\x00\x00\x00\x00\x00\x00{}"])
def test_corrupt_safetensors(saved_model_dir, content):
    (saved_model_dir / "model.safetensors").write_bytes(content)
    assert "cannot read the weights" in load_error(saved_model_dir)


def test_corrupt_pytorch_bin(saved_model_dir):
    (saved_model_dir / "model.safetensors").unlink()
    (saved_model_dir / "pytorch_model.bin").write_bytes(b"not a pickle")
    assert "cannot read the weights" in load_error(saved_model_dir)


def test_weights_of_another_shape(saved_model_dir):
    config = json.loads((saved_model_dir / "config.json").read_text())
    config["hidden_size"] = 64
    (saved_model_dir / "config.json").write_text(json.dumps(config))
    assert "cannot read the weights" in load_error(saved_model_dir)


def test_checkpoint_missing_tensors_is_refused(saved_model_dir):
    """A checkpoint lacking some of the model's tensors must not load as a partly random model."""
    path = saved_model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["lm_head.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    message = load_error(saved_model_dir, LoadOptions(dtype="float64"))
    assert "lm_head.weight" in message or "weights" in message


@pytest.mark.parametrize("missing", [("tokenizer.json",), ("tokenizer.json", "tokenizer_config.json")])
def test_missing_tokenizer_files(saved_model_dir, missing):
    for name in missing:
        (saved_model_dir / name).unlink()
    assert "tokenizer" in load_error(saved_model_dir)


def test_corrupt_tokenizer_file(saved_model_dir):
    (saved_model_dir / "tokenizer.json").write_text("{garbage")
    assert "cannot load the tokenizer" in load_error(saved_model_dir)


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "foo:1"])
def test_unknown_device(saved_model_dir, device):
    assert "unknown device" in load_error(saved_model_dir, LoadOptions(device=device))


@pytest.mark.parametrize("device", ["meta", "mps", "xla"])
def test_unsupported_device(saved_model_dir, device):
    assert "unsupported device" in load_error(saved_model_dir, LoadOptions(device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu(saved_model_dir, device):
    assert "no CUDA GPU" in load_error(saved_model_dir, LoadOptions(device=device))


@pytest.mark.parametrize("dtype", ["float8", "fp32", "int8", "Float32", ""])
def test_unknown_dtype(saved_model_dir, dtype):
    message = load_error(saved_model_dir, LoadOptions(dtype=dtype))
    assert "unknown dtype" in message and "float32" in message


@pytest.mark.parametrize(
    ("options", "message"),
    [({"n_batch": 0}, "batch size"), ({"n_ctx": -5}, "context size"), ({"threads": -1}, "thread count")],
)
def test_load_options_refuse_bad_sizes(options, message):
    with pytest.raises(SpecdecodeError, match=message):
        LoadOptions(**options)


def test_pipeline_load_reports_a_bad_draft(saved_model_dir, tmp_path):
    with pytest.raises(SpecdecodeError, match="not found"):
        Pipeline.load(saved_model_dir, draft=tmp_path / "missing-draft")


# --------------------------------------------------------------------------- requests the pipeline refuses


@pytest.fixture
def small_pipe(zoo, model):
    return Pipeline(zoo.backend(model, n_ctx=32))


def test_prompt_longer_than_the_context(small_pipe):
    with pytest.raises(SpecdecodeError, match="context") as info:
        small_pipe.generate(list(range(3, 43)), GREEDY, GenerationConfig(n_predict=4))
    assert "40" in str(info.value) and "32" in str(info.value)
    assert small_pipe.target.tokens == []  # refused before any evaluation


def test_prompt_exactly_the_context(small_pipe):
    with pytest.raises(SpecdecodeError, match="context"):
        small_pipe.generate(list(range(3, 35)), GREEDY, GenerationConfig(n_predict=-1))
    assert small_pipe.target.tokens == []


def test_prompt_plus_n_predict_exceeds_the_context(small_pipe):
    with pytest.raises(SpecdecodeError, match="context size") as info:
        small_pipe.generate(list(range(3, 23)), GREEDY, GenerationConfig(n_predict=13))
    assert "n_predict (13)" in str(info.value)
    assert small_pipe.target.tokens == []
    result = small_pipe.generate(list(range(3, 23)), GREEDY, GenerationConfig(n_predict=12, ignore_eos=True))
    assert len(result.tokens) == 12


def test_prompt_too_long_with_a_draft(zoo, model):
    """The refusal comes before the draft model or the target evaluates anything."""
    target = zoo.backend(model, n_ctx=16)
    draft = zoo.backend(zoo.draft(SPEC, 0.0))
    pipe = Pipeline(target, draft)
    with pytest.raises(SpecdecodeError, match="context"):
        pipe.generate("x " * 40, GREEDY, GenerationConfig(n_predict=4))
    assert target.tokens == [] and draft.tokens == []


def test_empty_prompt(small_pipe):
    with pytest.raises(SpecdecodeError, match="empty"):
        small_pipe.generate([], GREEDY, GenerationConfig(n_predict=4))


def test_empty_text_prompt_without_bos(zoo, model, no_bos_tokenizer):
    pipe = Pipeline(zoo.backend(model, no_bos_tokenizer))
    with pytest.raises(SpecdecodeError, match="empty"):
        pipe.generate("", GREEDY, GenerationConfig(n_predict=4))


def test_empty_text_prompt_with_bos_is_just_bos(small_pipe):
    result = small_pipe.generate("", GREEDY, GenerationConfig(n_predict=3, ignore_eos=True))
    assert result.stats.n_prompt == 1 and len(result.tokens) == 3


@pytest.mark.parametrize("n_predict", [0, -2, -100])
def test_invalid_n_predict(n_predict):
    with pytest.raises(SpecdecodeError, match="n_predict"):
        GenerationConfig(n_predict=n_predict)


def test_unknown_verify_mode():
    with pytest.raises(SpecdecodeError, match="verify mode"):
        GenerationConfig(verify="typical")


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [({"n_max": 0}, "--draft-max"), ({"n_min": -1}, "--draft-min"), ({"p_min": 1.5}, "--draft-p-min")],
)
def test_invalid_draft_config(kwargs, flag):
    with pytest.raises(SpecdecodeError, match=flag):
        DraftModelConfig(**kwargs)


def test_draft_spec_type_without_a_draft(zoo, model):
    with pytest.raises(SpecdecodeError, match="draft model"):
        Pipeline(zoo.backend(model), spec_types=["draft"])


def test_n_predict_minus_one_stops_at_the_context(small_pipe):
    result = small_pipe.generate([3, 4, 5], GREEDY, GenerationConfig(n_predict=-1, ignore_eos=True))
    assert result.stats.stop_reason == "context"
    assert len(result.tokens) == 32 - 3 + 1


def test_make_tokenizer_without_bos_adds_nothing():
    tok = make_tokenizer(vocab_size=300, add_bos=False)
    assert tok("abc")["input_ids"] == tok("abc", add_special_tokens=False)["input_ids"]


def test_save_model_writes_a_loadable_directory(tmp_path, zoo, tokenizer):
    directory = save_model(tmp_path / "m", zoo.target(SPEC), tokenizer)
    assert (directory / "config.json").is_file()
    assert any(directory.glob("*.safetensors"))
    assert HFBackend.load(directory).vocab.size == VOCAB_SIZE
