"""Hugging Face directories on llama.cpp's kernels (`--backend auto` on a CPU).

- A float32 Llama directory runs on llama.cpp through a GGUF file written once in the cache;
  a second load takes the same file; changed content writes a new one; an unchanged file is
  hashed once (remembered by path, size and modification time).
- bfloat16 weights are written as bfloat16: llama.cpp reads the checkpoint's own weights.
- Only where allowed: a float64 directory, an explicit dtype and `--backend native` stay on
  PyTorch, with nothing written.
- Exactness: a target (plain or speculative run alike) goes to llama.cpp only where the probe
  finds its rows invariant, and speculative output equals plain output either way; a draft
  model runs there whatever its rows. (The mechanics are tested on drafts, which go there in
  every build.)
- The command says in one line per model which backend was chosen and why.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TargetSpec, cached_tokenizer, draft_model, in_dtype, target_model

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.gguf_files import export_gguf
from specdecode.backends.hf_gguf import content_key, models_dir
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.backends.load import load_backend
from specdecode.backends.native import NativeBackend
from specdecode.backends.options import LoadOptions
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.testing import save_model

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

PROMPT = list(range(5, 17)) * 3
CONFIG = GenerationConfig(n_predict=32, ignore_eos=True)
GREEDY = SamplingParams(temperature=0)
OPTIONS = LoadOptions(threads=1, n_ctx=256)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def pair(tmp_path):
    """The test pair as float32 Hugging Face directories."""
    tokenizer = cached_tokenizer()
    spec = TargetSpec()
    return (
        save_model(tmp_path / "target", in_dtype(target_model(spec), torch.float32), tokenizer),
        save_model(tmp_path / "draft", in_dtype(draft_model(spec, 0.02), torch.float32), tokenizer),
    )


def written() -> list[str]:
    return sorted(p.name for p in models_dir().glob("*.gguf"))


def test_a_directory_runs_on_llama_cpp_through_one_cached_file(pair):
    target, _ = pair
    first = load_backend(target, OPTIONS, "draft")
    assert isinstance(first, LlamaCppBackend) and first.name == "target"
    assert "written once to" in first.backend_note and "--backend native" in first.backend_note
    (name,) = written()
    assert name.endswith(".f32.gguf")
    stamp = (models_dir() / name).stat().st_mtime_ns
    second = load_backend(target, OPTIONS, "draft")
    assert "kept in" in second.backend_note and written() == [name]
    assert (models_dir() / name).stat().st_mtime_ns == stamp
    # the exact vocabulary, and the directory's logits to llama.cpp's float16 KV cache (within 2%
    # of their range on these tiny sharp models, as tests/test_llama_cpp.py finds for any file)
    native = load_backend(target, LoadOptions(backend="native", threads=1))
    assert second.vocab == native.vocab and second.tokenize("def f(x):") == native.tokenize("def f(x):")
    got, expected = second.evaluate(PROMPT), native.evaluate(PROMPT).float()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.allclose(got, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)


def test_changed_content_writes_a_new_file_and_a_touched_one_does_not(pair, tmp_path):
    target, _ = pair
    key = content_key(target)
    weights = target / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert content_key(target) == key  # hashed again: same content
    hashes = json.loads((models_dir() / "file-hashes.json").read_text())
    assert hashes[str(weights.resolve())][:2] == [weights.stat().st_size, weights.stat().st_mtime_ns]
    load_backend(target, OPTIONS, "draft")
    save_model(target, in_dtype(target_model(TargetSpec(seed=3)), torch.float32), cached_tokenizer())
    assert content_key(target) != key
    changed = load_backend(target, OPTIONS, "draft")
    assert "written once to" in changed.backend_note and len(written()) == 2


def test_bfloat16_weights_are_written_as_bfloat16(tmp_path):
    model = in_dtype(target_model(TargetSpec(seed=7, hidden=16, layers=1)), torch.bfloat16)
    directory = save_model(tmp_path / "bf16", model, cached_tokenizer())
    backend = load_backend(directory, OPTIONS, "draft")
    assert isinstance(backend, LlamaCppBackend) and "bf16 GGUF" in backend.backend_note
    reader = gguf.GGUFReader(models_dir() / written()[0])
    weight = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert weight.tensor_type == gguf.GGMLQuantizationType.BF16
    stored = model.model.layers[0].mlp.up_proj.weight.detach()
    raw = torch.frombuffer(bytearray(weight.data.tobytes()), dtype=torch.bfloat16).reshape(stored.shape)
    assert torch.equal(raw, stored)


def test_pytorch_keeps_what_llama_cpp_cannot_run_or_was_not_asked_for(pair, tmp_path, saved_model_dir):
    target, _ = pair
    for backend in (
        load_backend(saved_model_dir, OPTIONS, "draft"),  # float64 weights
        load_backend(target, LoadOptions(dtype="float32"), "plain"),
        load_backend(target, LoadOptions(backend="native"), "plain"),
        load_backend(target, LoadOptions(passes="invariant"), "plain"),
    ):
        assert isinstance(backend, NativeBackend) and backend.backend_note is None
    assert written() == []
    with pytest.raises(SpecdecodeError, match="cannot run this directory: weights stored in float64"):
        load_backend(saved_model_dir, LoadOptions(backend="llama.cpp"))


def test_speculation_equals_plain_with_the_directories_on_auto(pair, exactness_log, tmp_path):
    target, draft = pair
    plain = Pipeline.load(target, target_options=OPTIONS)
    speculative = Pipeline.load(target, draft, target_options=OPTIONS, draft_options=OPTIONS)
    assert isinstance(speculative.draft, LlamaCppBackend)  # a draft's rows decide nothing
    probe = LlamaCppBackend.load(export_gguf(target, tmp_path / "probe.gguf", "f32"), OPTIONS)
    # the target on llama.cpp only where its rows are invariant, else on PyTorch, saying why;
    # the same backend for a plain run as for a speculative one; its copy kept only if used
    for pipeline in (plain, speculative):
        assert isinstance(pipeline.target, LlamaCppBackend) == probe.invariant
        assert probe.invariant or "multi-row passes" in pipeline.target.backend_note
    kept = [name for name in written() if name.startswith(content_key(target)[:40])]
    assert len(kept) == probe.invariant
    expected = plain.generate(PROMPT, GREEDY, CONFIG)
    result = speculative.generate(PROMPT, GREEDY, CONFIG)
    assert result.tokens == expected.tokens and result.stats.totals.n_accepted > 0
    exactness_log.record("hf-gguf-auto/draft-greedy", "draft", result.stats, result.stats.stop_reason, "f32")


def test_the_command_says_which_backend_it_chose(pair, capsys):
    target, draft = pair
    args = ["generate", "-m", str(target), "-md", str(draft), "-p", "def f(x):", "-n", "4", "-t", "1"]
    assert main(args) == 0
    err = capsys.readouterr().err.replace("\n      ", " ")  # a note's wrapped lines, as one
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    (draft_note,) = [line for line in notes if line.startswith("note: draft:")]
    assert "llama.cpp's kernels" in draft_note and ".f32.gguf" in draft_note
    assert len([line for line in notes if line.startswith("note: target:")]) == 1
    assert main([*args, "--backend", "native"]) == 0
    assert "llama.cpp" not in capsys.readouterr().err


def test_a_tokenizer_llama_cpp_reads_otherwise_keeps_pytorch(pair):
    """A normalizer (here lowercasing) is not in the GGUF: llama.cpp would tokenize otherwise."""
    target, _ = pair
    spec_file = target / "tokenizer.json"
    spec = json.loads(spec_file.read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    spec_file.write_text(json.dumps(spec))
    for _ in range(2):  # found when written, then remembered
        backend = load_backend(target, OPTIONS, "draft")
        assert isinstance(backend, NativeBackend)
        assert "tokenizes a sample text otherwise" in backend.backend_note
    assert written() == [] and len(list(models_dir().glob("*.tokenizer-differs"))) == 1
    with pytest.raises(SpecdecodeError, match="tokenizes a sample text otherwise"):
        load_backend(target, LoadOptions(backend="llama.cpp"))


def test_bench_keeps_the_draft_beside_a_target_on_pytorch_for_hugging_face(pair):
    """bench --dtype: the target runs on PyTorch, and so must the draft Hugging Face's assisted
    generation shares; a model on llama.cpp is refused by the HF systems with the flag to use."""
    from argparse import Namespace

    from specdecode.bench.command import load_models
    from specdecode.bench.systems import HFSystem

    target, draft = pair
    args = Namespace(model=target, model_draft=draft, model_eagle3=None, quick=True, systems=None)
    on_torch, its_draft, _ = load_models(args, LoadOptions(dtype="float32", threads=1), OPTIONS)
    assert isinstance(on_torch, NativeBackend) and isinstance(its_draft, NativeBackend)
    assert written() == []
    HFSystem("hf-assisted", on_torch, its_draft)
    on_llama = load_backend(draft, OPTIONS, "draft")
    with pytest.raises(SpecdecodeError, match=r"draft runs on llama.cpp \(--backend native"):
        HFSystem("hf-assisted", on_torch, on_llama)
