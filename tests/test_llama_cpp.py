"""The llama.cpp backend: a GGUF file on llama.cpp's kernels through llama-cpp-python's C API.

- The GGUF's own vocabulary gives the Hugging Face tokenizer's ids, text and facts.
- Passes: logits close to the native float32 forward; rollback; tree rows equal to passes over
  their paths, committed paths equal to a linear evaluation of them.
- Exactness on the same backend: speculative output equals plain output (greedy and seeded
  `match`) for a draft model's chain and tree and for an n-gram pool.
- Row-invariance: the probe's verdict agrees with a direct comparison of multi-row and
  one-row passes (f32 and Q8_0 files, which differ in the default build), leaves the cache
  alone, and the CLI warns when speculation runs over rows that are not invariant.
- Every strategy that runs here (and the adaptive policy), greedy, on every GGUF type whose
  rows the probe finds invariant in this build: speculative output equals plain output.
- The commands pick it for GGUF files (`auto`) or when asked; bad input exits with 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import TargetSpec, cached_tokenizer, draft_model, target_model

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.hf import LoadOptions
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.backends.llama_lib import TILED_SWITCH
from specdecode.backends.llama_model import MAX_SEQUENCES, LlamaContext, LlamaModel
from specdecode.backends.llama_probe import PROBE_PASSES, WIDE_PASSES
from specdecode.backends.load import load_backend
from specdecode.cli import main
from specdecode.drafts import path_to
from specdecode.errors import SpecdecodeError
from specdecode.sampling import Sampler, distribution
from specdecode.strategies import NgramMapConfig, NgramModConfig, NgramSettings
from specdecode.testing import save_model

llama_cpp = pytest.importorskip("llama_cpp")

TEXT = "def wrap(text, width=70):\n    <|eos|> return [line for line in text]"
PROMPT = list(range(5, 17)) * 3
LLAMA = LoadOptions(backend="llama.cpp", threads=1, n_ctx=256)


def backend(gguf_files, role: str = "target", fmt: str = "") -> LlamaCppBackend:
    return load_backend(gguf_files[f"{role}{fmt}.gguf"], LLAMA)


def test_the_ggufs_vocabulary_is_the_tokenizers(gguf_files):
    ours, theirs = backend(gguf_files), load_backend(gguf_files["target"], LoadOptions(dtype="float32"))
    assert isinstance(ours, LlamaCppBackend)
    assert ours.vocab == theirs.vocab
    for add_special in (True, False):
        assert ours.tokenize(TEXT, add_special) == theirs.tokenize(TEXT, add_special)
    ids = theirs.tokenize(TEXT)
    for skip in (True, False):
        assert ours.detokenize(ids, skip) == theirs.detokenize(ids, skip)
    assert [ours.token_text(i) for i in range(0, 320, 7)] == [theirs.token_text(i) for i in range(0, 320, 7)]


def test_logits_are_close_to_the_native_forward_and_roll_back(gguf_files):
    ours, theirs = backend(gguf_files), load_backend(gguf_files["target"], LoadOptions(dtype="float32"))
    expected = theirs.evaluate(PROMPT)
    got = ours.evaluate(PROMPT)
    assert got.shape == expected.shape
    # llama.cpp keeps its KV cache in float16 by default, and these tiny sharp models amplify
    # it: the same choices, logits within 2% of their range.
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.allclose(got, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)
    ours.truncate(len(PROMPT) - 3)
    assert ours.tokens == PROMPT[:-3]
    again = ours.evaluate(PROMPT[-3:])
    assert torch.equal(again, got[-3:])


@pytest.mark.parametrize(
    "parents, tokens, first",
    [
        ([-1, 0, 1, 2], [40, 41, 42, 43], 4),  # a chain
        ([-1, -1, 0, 0, 1, 2, 5], [40, 50, 41, 51, 60, 42, 43], 3),  # branches, two passes
        ([-1, 0, 0, 1, 1, 2, 2], [40, 41, 42, 43, 44, 45, 46], 1),
    ],
)
def test_tree_rows_equal_passes_over_their_paths(gguf_files, parents, tokens, first):
    ours = backend(gguf_files)
    ours.evaluate(PROMPT)
    rows = torch.cat(
        [ours.evaluate_tree(tokens[:first], parents[:first])]
        + ([ours.evaluate_tree(tokens[first:], parents[first:])] if first < len(tokens) else [])
    )
    assert ours.tokens == PROMPT
    linear = backend(gguf_files)
    for node in range(len(tokens)):
        linear.truncate(0)
        linear.evaluate(PROMPT)
        path = path_to(parents, node)
        row = linear.evaluate([tokens[step] for step in path])[-1]
        assert torch.allclose(rows[node], row, atol=1e-4 * row.abs().max().item(), rtol=0), node
    path = path_to(parents, len(tokens) - 1)
    ours.commit(path)
    assert ours.tokens == PROMPT + [tokens[n] for n in path]
    linear.truncate(len(PROMPT))
    linear.evaluate([tokens[n] for n in path])
    got, expected = ours.evaluate([7, 8]), linear.evaluate([7, 8])
    # The path's keys and values came from passes of other shapes (float16 cache): to rounding.
    assert torch.allclose(got, expected, atol=1e-3 * expected.abs().max().item(), rtol=0)


def test_trees_past_the_sequences_are_refused(gguf_files):
    ours = backend(gguf_files)
    ours.evaluate(PROMPT)
    with pytest.raises(SpecdecodeError, match="does not fit"):
        ours.evaluate_tree(list(range(3, 3 + MAX_SEQUENCES)), [-1] * MAX_SEQUENCES)


def test_q8_0_rows_are_batch_invariant_and_a_committed_tree_is_plain_history(gguf_files):
    """Q8_0 quantizes each activation row alone, so llama.cpp gives a row the same bits in any
    pass; a committed tree path is then exactly what plain generation would have cached."""
    ours, linear = backend(gguf_files, fmt="-q8_0"), backend(gguf_files, fmt="-q8_0")
    together = ours.evaluate(PROMPT)
    alone = torch.cat([linear.evaluate([token]) for token in PROMPT])
    assert torch.equal(together, alone)
    ours.evaluate_tree([40, 50, 41, 42], [-1, -1, 0, 2])
    ours.evaluate_tree([43, 51], [3, 1])
    ours.commit([0, 2, 3, 4])
    assert ours.tokens == [*PROMPT, 40, 41, 42, 43]
    for token in (40, 41, 42, 43):
        linear.evaluate([token])
    assert torch.equal(ours.evaluate([7, 8]), torch.cat([linear.evaluate([7]), linear.evaluate([8])]))


STRATEGIES = {
    "draft": (["draft"], DraftModelConfig()),
    "draft-tree": (["draft"], DraftModelConfig(n_max=6, p_min=0.0, p_split=0.05, n_parallel=3)),
    "ngram-mod": (["ngram-mod"], DraftModelConfig()),
}


@pytest.mark.parametrize("fmt", ["", "-q8_0"])
@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_on_llama_cpp_equals_plain(gguf_files, exactness_log, name, temperature, fmt):
    spec_types, draft_config = STRATEGIES[name]
    sampling = SamplingParams(temperature=temperature, seed=5)
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    expected = Pipeline(backend(gguf_files, fmt=fmt), spec_types=[]).generate(PROMPT, sampling, config)
    pipeline = Pipeline(
        backend(gguf_files, fmt=fmt),
        backend(gguf_files, "draft", fmt),
        spec_types=spec_types,
        draft_config=draft_config,
        ngram=NgramSettings(mod=NgramModConfig(1, 1, 8)),
    )
    result = pipeline.generate(PROMPT, sampling, config)
    assert result.tokens == expected.tokens
    # a target whose rows differ even in two-row passes drafts nothing (see the row cap)
    assert result.stats.totals.n_drafted > 0 or temperature > 0 or pipeline.target.row_cap == 1
    mode = "greedy" if temperature == 0 else "match"
    exactness_log.record(
        f"gguf-llama.cpp/{name}-{mode}", name, result.stats, result.stats.stop_reason, fmt[1:] or "f32"
    )


TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
K_QUANTS = ("q4_k", "q6_k")  # blocks of 256: written from a pair 256 wide, which they fit


@pytest.fixture(scope="module")
def all_types(gguf_files, tmp_path_factory) -> dict[str, object]:
    """The test pair in every GGUF type the export writes, by file name. The k-quants come from
    a pair 256 wide: llama.cpp's quantizer keeps a matrix whose rows do not fill its 256-wide
    blocks in Q5_0/Q8_0, and the test pair's 32-wide rows would never reach a k-quant kernel."""
    from specdecode.backends.gguf_files import export_gguf

    root = tmp_path_factory.mktemp("gguf-types")
    wide = TargetSpec(hidden=256)
    pairs = {
        "target": (
            gguf_files["target"],
            save_model(root / "wide-target", target_model(wide), cached_tokenizer()),
        ),
        "draft": (
            gguf_files["draft"],
            save_model(root / "wide-draft", draft_model(wide, 0.02), cached_tokenizer()),
        ),
    }
    files = dict(gguf_files)
    for role, (narrow, wide_dir) in pairs.items():
        for fmt in TYPES[1:]:
            if f"{role}-{fmt}.gguf" not in files:
                source = wide_dir if fmt in K_QUANTS else narrow
                files[f"{role}-{fmt}.gguf"] = export_gguf(source, root / f"{role}-{fmt}.gguf", fmt)
    return files


def passes_agree(ours: LlamaCppBackend, ids: list[int], sizes: tuple[int, ...]) -> bool:
    """Whether passes of each size over `ids` (after its first token) give every row the bits
    of one-row passes: the direct comparison the probe stands in for."""
    ours.truncate(0)
    ours.evaluate(ids[:1])
    alone = torch.cat([ours.evaluate([token]) for token in ids[1:]])
    agree, start = True, 1
    for k in sizes:
        ours.truncate(start)
        agree &= torch.equal(ours.evaluate(ids[start : start + k]), alone[start - 1 : start - 1 + k])
        start += k
    ours.truncate(0)
    return agree


@pytest.mark.parametrize("fmt", ["", "-q8_0"])
def test_the_invariance_probe_agrees_with_a_direct_comparison(gguf_files, fmt):
    ours = backend(gguf_files, fmt=fmt)
    expected = ours.evaluate(PROMPT)
    verdict = ours.invariant
    assert ours.tokens == PROMPT  # the probe ran in a context of its own
    unprobed = backend(gguf_files, fmt=fmt)
    assert torch.equal(unprobed.evaluate(PROMPT), expected)
    assert torch.equal(ours.evaluate([7]), unprobed.evaluate([7]))
    probe = ours.model.probe
    assert probe.rows > 0 and probe.same_argmax == probe.rows
    assert verdict == (ours.model.invariant_rows >= max(PROBE_PASSES))
    # Other text, other pass sizes, the same verdict on the sizes it vouches for.
    text = ours.tokenize(TEXT * 2)
    vouched = ours.model.invariant_rows >= 12
    assert passes_agree(backend(gguf_files, fmt=fmt), text, (2, 3, 6, 8, 12)) == vouched


def test_the_invariance_verdicts_of_this_build_differ_by_type(gguf_files):
    """Q8_0 quantizes each activation row alone: its weight products are invariant in any
    build, but llama.cpp's flash attention on the CPU takes tiles of 64 query rows from passes
    of 64 rows on, which round otherwise: the probe caps passes below them. f32 goes through
    llamafile's sgemm for multi-row passes unless llama.cpp was built without it: the probe
    says which, and the two verdicts show it can answer both ways."""
    q8_0 = backend(gguf_files, fmt="-q8_0")
    assert q8_0.invariant and 17 <= q8_0.row_cap == q8_0.model.invariant_rows < 64
    f32 = backend(gguf_files)
    llamafile = "LLAMAFILE = 1" in llama_cpp.llama_print_system_info().decode()
    assert f32.invariant == (not llamafile)
    if not f32.invariant:
        assert f32.row_cap == max(1, f32.model.invariant_rows)
        assert f32.row_variance_warning(trees=False) is None
        fast = load_backend(
            gguf_files["target.gguf"], LoadOptions(backend="llama.cpp", threads=1, passes="bucketed")
        )
        assert fast.row_cap is None
        assert "differently in passes of several rows" in fast.row_variance_warning(trees=False)


def test_the_cli_says_when_drafts_are_capped_or_exactness_given_up(gguf_files, capsys):
    target = backend(gguf_files)
    invariant = target.invariant
    # --passes bucketed warns unless the probe vouched for the widest passes it may run
    # (an invariant target is vouched for up to 63 rows, where flash attention's tiles begin)
    vouched = target.model.invariant_rows >= max(WIDE_PASSES)
    args = ["generate", "-m", str(gguf_files["target.gguf"]), "-md", str(gguf_files["draft.gguf"]), "-t", "1"]
    assert main([*args, "--temp", "0", "-n", "4", "-p", "def wrap(", "-nr"]) == 0
    err = capsys.readouterr().err
    capped = "note: drafts held to" in err or "note: nothing is drafted" in err
    assert capped == (not invariant)
    assert "--passes bucketed" in err or not capped
    assert "warning" not in err
    assert main([*args, "--temp", "0", "-n", "4", "-p", "def wrap(", "--passes", "bucketed"]) == 0
    err = capsys.readouterr().err
    assert ("warning: llama.cpp rounds" in err) == (not vouched) and "note: drafts held" not in err
    assert main([*args, "--spec-type", "none", "--temp", "0", "-n", "4", "-p", "def wrap("]) == 0
    assert "llama.cpp" not in capsys.readouterr().err  # plain generation: nothing to say
    assert main([*args, "--temp", "0", "-n", "4", "-p", "def wrap(", "--passes", "fixed"]) == 2
    assert "passes 'fixed' (--passes fixed) is the native backend's" in capsys.readouterr().err


def test_the_probes_verdict_is_kept_per_model_file_and_options(all_types, tmp_path, monkeypatch):
    """The probe runs once per file, repacking, threads and build: a second start reads it."""
    monkeypatch.delenv("SPECDECODE_NO_PASS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = all_types["target-q4_k.gguf"]
    first = load_backend(path, LLAMA)
    verdict = (first.invariant, first.model.probe, first.model.invariant_rows)

    def probe_again(self):
        raise AssertionError("the probe ran again")

    monkeypatch.setattr(LlamaCppBackend, "probe_invariance", probe_again)
    second = load_backend(path, LLAMA)
    assert (second.invariant, second.model.probe, second.model.invariant_rows) == verdict
    unpacked = LoadOptions(backend="llama.cpp", threads=1, n_ctx=256, repack=False)
    with pytest.raises(AssertionError, match="ran again"):  # another key: other weight layouts
        assert load_backend(path, unpacked).invariant


WIDE_PROBE = """
import sys
from specdecode.backends.load import load_backend
from specdecode.backends.options import LoadOptions
ours = load_backend(sys.argv[1], LoadOptions(backend="llama.cpp", threads=1, n_ctx=256, repack=False))
print(ours.invariant, ours.model.invariant_rows)
"""


def test_k_quant_rows_vary_past_seven_only_through_ggmls_tiled_product(all_types):
    """What kept a K-quant file's rows from agreeing beyond passes of 7 rows (weights in the
    file's layout) is ggml's tiled product, which takes passes of 8 rows and more: switched
    off, as the backend does, every probed pass agrees. ggml reads the switch once per process."""
    path = str(all_types["target-q4_k.gguf"])
    unpacked = load_backend(path, LoadOptions(backend="llama.cpp", threads=1, n_ctx=256, repack=False))
    assert os.environ[TILED_SWITCH] == "0"  # the backend's default (the tests' environment sets none)
    assert unpacked.row_cap == 63  # every probed pass below flash attention's tiles agrees
    tiled = subprocess.run(
        [sys.executable, "-c", WIDE_PROBE, path],
        env={**os.environ, TILED_SWITCH: "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert tiled.stdout.split() == ["False", "7"]


def test_no_repack_keeps_the_files_layout(gguf_files):
    ours = load_backend(
        gguf_files["target-q8_0.gguf"], LoadOptions(backend="llama.cpp", threads=1, repack=False)
    )
    assert not ours.model.repack
    assert torch.equal(ours.evaluate(PROMPT), backend(gguf_files, fmt="-q8_0").evaluate(PROMPT))


SMALL_NGRAMS = NgramSettings(  # keys of one token: these models' text seldom repeats longer ones
    simple=NgramMapConfig(size_n=1, size_m=4),
    map_k=NgramMapConfig(size_n=1, size_m=4),
    map_k4v=NgramMapConfig(size_n=1, size_m=4),
    mod=NgramModConfig(1, 1, 8),
)
EVERY_STRATEGY = {
    "ngram-simple": (["ngram-simple"], DraftModelConfig(), "classic"),
    "ngram-map-k": (["ngram-map-k"], DraftModelConfig(), "classic"),
    "ngram-map-k4v": (["ngram-map-k4v"], DraftModelConfig(), "classic"),
    "ngram-mod": (["ngram-mod"], DraftModelConfig(), "classic"),
    "ngram-cache": (["ngram-cache"], DraftModelConfig(), "classic"),
    "draft": (["draft"], DraftModelConfig(p_min=0.0), "classic"),
    "draft-tree": (["draft"], DraftModelConfig(n_max=6, p_min=0.0, p_split=0.05, n_parallel=3), "classic"),
    "ngram-simple,draft": (["ngram-simple", "draft"], DraftModelConfig(p_min=0.0), "classic"),
    "draft@adaptive": (["draft"], DraftModelConfig(), "adaptive"),
}


@pytest.mark.parametrize("fmt", TYPES)
@pytest.mark.parametrize("name", EVERY_STRATEGY)
def test_every_strategy_equals_plain_on_every_gguf_type(all_types, exactness_log, monkeypatch, name, fmt):
    """Exact by default: where the probe finds a type's rows bit-identical only in passes of up
    to some size, drafts are kept to it, and every pass after the prompt stays within it."""
    target = backend(all_types, fmt="" if fmt == "f32" else f"-{fmt}")
    spec_types, draft_config, policy = EVERY_STRATEGY[name]
    sampling, config = SamplingParams(temperature=0), GenerationConfig(n_predict=40, ignore_eos=True)
    # The prompt, its continuation and the prompt again: n-grams that recur for the strategies.
    plain = Pipeline(target, spec_types=[])
    prompt = [*PROMPT, *plain.generate(PROMPT, sampling, config).tokens[:24], *PROMPT]
    expected = plain.generate(prompt, sampling, config)
    draft = backend(all_types, "draft", "" if fmt == "f32" else f"-{fmt}") if "draft" in spec_types else None
    pipeline = Pipeline(
        target,
        draft,
        spec_types=spec_types,
        draft_config=draft_config,
        ngram=SMALL_NGRAMS,
        spec_policy=policy,
    )
    passes: list[int] = []
    decode = target._decode
    monkeypatch.setattr(target, "_decode", lambda rows: passes.append(rows) or decode(rows))
    result = pipeline.generate(prompt, sampling, config)
    assert result.tokens == expected.tokens
    # the prompt's pass (what the cached prompt leaves of it), then passes within the cap
    assert passes[0] <= len(prompt) and max(passes[1:]) <= (target.row_cap or len(prompt))
    # a type whose rows differ even in two-row passes (f32, f16, bf16 through llamafile's
    # sgemm) drafts nothing; the others draft (ngram-cache finds little here on some types, and
    # the adaptive policy drafts as the timings it measured say)
    drafted = result.stats.totals.n_drafted
    assert drafted == 0 if target.row_cap == 1 else drafted > 0 or name in ("ngram-cache", "draft@adaptive")
    exactness_log.record(f"gguf-llama.cpp/{name}-greedy", name, result.stats, result.stats.stop_reason, fmt)


NEAR_THE_END = LoadOptions(backend="llama.cpp", threads=1, n_ctx=512)
LONG_DRAFTS = NgramSettings(mod=NgramModConfig(1, 1, 64))  # ngram-mod's longest drafts: passes of 65 rows


@pytest.mark.parametrize("fmt", TYPES)
def test_speculation_near_the_end_of_the_context_equals_plain_on_every_gguf_type(
    all_types, exactness_log, monkeypatch, fmt
):
    """With the cache filled to the end of the context, and verify passes as long as ngram-mod
    makes them (65 rows, past the 64 query rows of llama.cpp's flash-attention tiles): the probe
    passes at cache lengths up to n_ctx and at those sizes, every pass after the prompt is one
    it vouched for, and the output is plain output."""
    suffix = "" if fmt == "f32" else f"-{fmt}"
    target = load_backend(all_types[f"target{suffix}.gguf"], NEAR_THE_END)
    prompt = (PROMPT * 12)[:400]
    sampling, config = SamplingParams(temperature=0), GenerationConfig(n_predict=111, ignore_eos=True)
    expected = Pipeline(target, spec_types=[]).generate(prompt, sampling, config).tokens
    passes: list[int] = []
    decode = target._decode
    monkeypatch.setattr(target, "_decode", lambda rows: passes.append(rows) or decode(rows))
    for name in ("ngram-mod", "draft"):
        draft = load_backend(all_types[f"draft{suffix}.gguf"], NEAR_THE_END) if name == "draft" else None
        pipeline = Pipeline(
            target, draft, spec_types=[name], draft_config=DraftModelConfig(p_min=0.0), ngram=LONG_DRAFTS
        )
        passes.clear()
        result = pipeline.generate(prompt, sampling, config)
        assert result.tokens == expected
        assert passes[0] <= len(prompt) and max(passes[1:]) <= target.vouched_rows
        stats = result.stats
        exactness_log.record(f"gguf-llama.cpp/{name}-near-n_ctx", name, stats, stats.stop_reason, fmt)


def test_two_threads_keep_drafting_exact_near_the_end_of_the_context(gguf_files):
    """With two threads llama.cpp splits the attention of a one-row pass over 512 cells or more
    between them, which rounds otherwise than a pass of several rows: one-row passes get a
    second row, so the probe still vouches for passes below flash attention's 64-row tiles at
    every length, and drafting stays on and exact."""
    two = replace(NEAR_THE_END, threads=2)
    target = load_backend(gguf_files["target-q8_0.gguf"], two)
    assert 17 <= target.row_cap < 64
    prompt = (PROMPT * 12)[:400]
    sampling, config = SamplingParams(temperature=0), GenerationConfig(n_predict=111, ignore_eos=True)
    expected = Pipeline(target, spec_types=[]).generate(prompt, sampling, config).tokens
    result = Pipeline(target, spec_types=["ngram-mod"], ngram=LONG_DRAFTS).generate(prompt, sampling, config)
    assert result.tokens == expected and result.stats.totals.n_drafted > 0


def test_two_threads_fill_the_context_to_its_last_cell(gguf_files):
    """A one-row pass's second row takes a cell of its own: the context keeps one for it, so a
    generation with two threads still runs until every one of its n_ctx cells holds a token."""
    target = load_backend(gguf_files["target-q8_0.gguf"], replace(NEAR_THE_END, threads=2))
    assert target.n_ctx == NEAR_THE_END.n_ctx
    prompt = (PROMPT * 12)[:400]
    sampling, config = SamplingParams(temperature=0), GenerationConfig(n_predict=-1, ignore_eos=True)
    expected = Pipeline(target, spec_types=[]).generate(prompt, sampling, config)
    result = Pipeline(target, spec_types=["ngram-mod"], ngram=LONG_DRAFTS).generate(prompt, sampling, config)
    assert expected.stats.stop_reason == result.stats.stop_reason == "context"
    assert result.tokens == expected.tokens and len(prompt) + len(expected.tokens) == NEAR_THE_END.n_ctx + 1


def test_a_fork_shares_the_weights_and_not_the_cache(gguf_files):
    ours = backend(gguf_files)
    expected = ours.evaluate(PROMPT)
    fork = ours.fork()
    assert fork.model is ours.model and fork.tokens == []
    assert torch.equal(fork.evaluate(PROMPT), expected)
    assert ours.tokens == PROMPT


def test_generate_picks_llama_cpp_for_gguf_files(gguf_files, capsys):
    runs = {}
    for spec in ("none", "draft"):
        args = [  # Q8_0: rows bit-identical in every build, so the drafts are not capped
            "generate",
            "-m",
            str(gguf_files["target-q8_0.gguf"]),
            "-md",
            str(gguf_files["draft-q8_0.gguf"]),
            "-t",
            "1",
        ]
        args += ["--spec-type", spec, "--temp", "0", "-n", "24", "--ignore-eos", "-p", "def wrap(", "--json"]
        args += ["--spec-policy", "classic"]  # drafts whatever the pass timings (adaptive: as they say)
        assert main(args) == 0
        runs[spec] = json.loads(capsys.readouterr().out)
    assert runs["draft"]["tokens"] == runs["none"]["tokens"]
    assert runs["draft"]["stats"]["totals"]["n_drafted"] > 0


def test_llama_cpp_refuses_what_it_cannot_run(gguf_files, tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert main(["generate", "--backend", "llama.cpp", "-m", str(bad), "-p", "x", "-n", "2"]) == 2
    assert "llama.cpp cannot load" in capsys.readouterr().err
    if not llama_cpp.llama_supports_gpu_offload():  # a CPU build
        assert (
            main(["generate", "-m", str(gguf_files["target.gguf"]), "-ngl", "4", "-p", "x", "-n", "2"]) == 2
        )
        assert "no GPU" in capsys.readouterr().err
    assert (
        main(["generate", "-m", str(gguf_files["target.gguf"]), "--dtype", "float64", "-p", "x", "-n", "2"])
        == 2
    )
    assert "file's own weight types" in capsys.readouterr().err


def test_serve_answers_from_gguf_files(gguf_files):
    """The server's slots fork the backend; its text routes use the file's own vocabulary."""
    from fastapi.testclient import TestClient

    from specdecode.server import ServerSettings, create_app

    pipeline = Pipeline(backend(gguf_files), backend(gguf_files, "draft"), spec_types=["draft"])
    plain = Pipeline(backend(gguf_files), spec_types=[]).generate(
        "def wrap(", SamplingParams(temperature=0), GenerationConfig(n_predict=12)
    )
    with TestClient(create_app(pipeline, ServerSettings(model_id="gguf", parallel=2))) as client:
        body = {"prompt": "def wrap(", "max_tokens": 12, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["choices"][0]["text"] == plain.text
        tokens = client.post("/tokenize", json={"content": TEXT}).json()["tokens"]
        assert tokens == backend(gguf_files).tokenize(TEXT, add_special=False)


def test_bench_runs_every_system_on_gguf_files(gguf_files, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["bench", "-m", str(gguf_files["target.gguf"]), "-md", str(gguf_files["draft.gguf"])]
    argv += ["--prompts-per-task", "1", "--runs", "1", "--sweep", "0"]  # every system, once
    assert main([*argv, "-n", "12", "-t", "1", "--no-plots", "--tasks", "completion", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert not any(name.startswith("hf-") for name in results["systems"])  # transformers' generate: no
    assert {"plain", "draft", "ngram-mod", "draft-tree"} <= set(results["systems"])
    assert all(row["exact_match_rate"] == 1.0 for row in results["rows"])
    assert main([*argv, "--systems", "plain,hf-plain", "--out", str(out)]) == 2
    assert "needs models in PyTorch" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_generation_draws_what_a_loop_over_the_whole_vocabulary_draws(
    gguf_files, exactness_log, temperature
):
    """Plain generation (numpy's argmax, draws among the top-k cut) against the bare loop it
    replaces: every pass's row read over the whole vocabulary (PyTorch's argmax; inverse CDF over
    the [V] distribution), the same seed's draws."""
    sampling = SamplingParams(temperature=temperature, top_k=40, top_p=0.95, min_p=0.05, seed=5)
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    result = Pipeline(backend(gguf_files), spec_types=[]).generate(PROMPT, sampling, config)
    ours, draws, tokens = backend(gguf_files), Sampler(sampling), []
    row = ours.evaluate(PROMPT)[-1]
    while len(tokens) < config.n_predict:
        if sampling.greedy:
            tokens.append(int(torch.argmax(row)))
        else:
            cumulative = torch.cumsum(distribution(row, sampling, [*PROMPT, *tokens]), 0)
            target = torch.tensor([draws.uniform() * float(cumulative[-1])], dtype=torch.float64)
            tokens.append(int(torch.searchsorted(cumulative, target, right=True)))
        row = ours.evaluate(tokens[-1:])[-1]
    assert result.tokens == tokens
    mode = "greedy" if temperature == 0 else "match"
    exactness_log.record(
        f"gguf-llama.cpp/whole-vocabulary-{mode}", "none", result.stats, result.stats.stop_reason, "f32"
    )


def test_a_gguf_file_on_llama_cpp_starts_without_transformers(gguf_files):
    """transformers' imports cost seconds of CPU that llama.cpp's path does not need; the
    sampler's PyTorch work keeps to the threads asked for."""
    code = f"""
import contextlib, io, json, sys, torch
from specdecode.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    status = main(["generate", "-m", {str(gguf_files["target.gguf"])!r}, "--backend", "llama.cpp", "-t", "1",
                   "--spec-type", "none", "--temp", "0.8", "-n", "4", "-p", "def wrap("])
print(json.dumps([status, "transformers" in sys.modules, torch.get_num_threads()]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [0, False, 1]


def test_a_llama_cpp_target_alone_generates_plainly_without_running_the_row_probe(gguf_files):
    """The adaptive default drafts with the n-gram chain only where no row probe must run
    first: on llama.cpp that check costs tens of seconds at a model's first start, which a run
    that asked for no drafting does not pay."""
    target = backend(gguf_files)
    assert Pipeline(target, spec_policy="adaptive").spec_types == []
    assert target.model.probe is None  # not probed to decide
    asked = Pipeline(target, spec_types=["ngram-mod"], spec_policy="adaptive")
    assert asked.spec_types == ["ngram-mod"]


def test_a_model_outlives_its_contexts_whatever_order_they_are_collected_in(gguf_files):
    """Garbage in a reference cycle is finalized in no set order: a model finalized before its
    context keeps its weights until that context is freed (llama_free reads them)."""
    model = LlamaModel(gguf_files["target.gguf"], gpu_layers=0)
    context = LlamaContext(model, "target", 64, 8, 1)
    model.__del__()  # the collector reaches the model first
    assert model.pointer is not None and model.contexts == 1
    context.__del__()
    assert model.pointer is None and model.contexts == 0
