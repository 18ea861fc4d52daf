"""GraphBackend: the GPU's native forward (one masked attention call per layer over a static KV
store shared by forks, CUDA graphs per row count), run here without graphs on the CPU.

- Agreement: float64 models of each supported family give transformers' logits to rounding,
  over the same script of passes, rollbacks and chunked prompts as the row-invariant forward,
  in both modes; trees, commits, hidden states and shared passes of several sequences too.
- Prefill: a prompt chunk is one pass of all its rows, with the LM head on its last row only,
  and agrees with transformers; a new prompt keeps only whole prefill chunks of the cache.
- The store: seats and slots grow (new forks, long contexts) without losing what is cached.
- Exactness: in fixed mode every pass runs the same shapes, so a row's bits do not depend on
  the pass, nor on the other sequences' rows beside it (attention per seat); bfloat16 greedy
  and seeded speculation equal plain generation, long prompts included.
- CUDA graphs: replayed passes equal eager ones (run where a GPU is present).
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from conftest import VOCAB_SIZE, cached_tokenizer
from test_native import FAMILIES, IDS, SCRIPT, assert_agree, bf16_draft, bf16_llama, family_model, hf

from specdecode import DraftModelConfig, GenerationConfig, LoadOptions, Pipeline, SamplingParams
from specdecode.backends import batch as batch_module
from specdecode.backends import graph as graph_module
from specdecode.backends.batch import RowGroup, evaluate_groups
from specdecode.backends.fused import LayerOps
from specdecode.backends.graph import FIXED_ROWS, GraphBackend, GraphPasses
from specdecode.backends.load import native_backend, native_kind
from specdecode.backends.native import NativeBackend
from specdecode.cli import main
from specdecode.errors import SpecdecodeError

GREEDY = SamplingParams(temperature=0)
MODES = {"fixed": FIXED_ROWS, "bucketed": None}


def graph(model, mode: str = "fixed", **kwargs) -> GraphBackend:
    return GraphBackend(model, cached_tokenizer(), fixed_rows=MODES[mode], **kwargs)


# --------------------------------------------------------------------------- agreement with transformers


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n_batch", [3, 512])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_equal_transformers(name, n_batch, mode):
    model = family_model(name)
    ours, reference = graph(model, mode, n_batch=n_batch), hf(model, n_batch=n_batch)
    for keep, ids, logits_rows in SCRIPT:
        if keep is not None:
            ours.truncate(keep)
            reference.truncate(keep)
        assert_agree(ours.evaluate(ids, logits_rows), reference.evaluate(ids, logits_rows))
        assert ours.tokens == reference.tokens


@pytest.mark.parametrize("mode", list(MODES))
def test_trees_and_commits_equal_transformers(mode):
    model = family_model("llama-gqa")
    ours, reference = graph(model, mode), hf(model)
    for backend in (ours, reference):
        backend.evaluate(IDS[:20])
    tree = ([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 3, -1])
    assert_agree(ours.evaluate_tree(*tree), reference.evaluate_tree(*tree))
    deeper = ([16, 17], [4, 6])  # a second pass extends the pending tree
    assert_agree(ours.evaluate_tree(*deeper), reference.evaluate_tree(*deeper))
    ours.commit([0, 1, 3, 4, 6])
    reference.commit([0, 1, 3, 4, 6])
    assert ours.tokens == reference.tokens
    assert_agree(ours.evaluate(IDS[30:34]), reference.evaluate(IDS[30:34]))
    # a tree dropped by a new chain leaves the prefix as it was
    assert_agree(ours.evaluate_tree(*tree), reference.evaluate_tree(*tree))
    assert_agree(ours.evaluate(IDS[40:42]), reference.evaluate(IDS[40:42]))


def test_hidden_states_equal_transformers():
    model = family_model("llama-gqa")
    ours, reference = graph(model), hf(model)
    layers = [0, 1, 2]
    for backend in (ours, reference):
        backend.capture_hidden(layers)
        backend.evaluate(IDS[:12])
        backend.evaluate_tree([5, 6, 7], [-1, 0, 0])
        backend.commit([0, 2])
    assert_agree(ours.hidden_states(0, 14), reference.hidden_states(0, 14))


@pytest.mark.parametrize("mode", list(MODES))
def test_shared_passes_give_each_sequence_its_own_logits(mode):
    model = family_model("llama-gqa")
    first = graph(model, mode)
    forks = [first, first.fork(), first.fork()]  # seats grow from one to four
    references = [hf(model) for _ in forks]
    for index, (ours, reference) in enumerate(zip(forks, references, strict=True)):
        ours.evaluate(IDS[index : index + 10 + 5 * index])
        reference.evaluate(IDS[index : index + 10 + 5 * index])
    groups = [
        RowGroup(forks[0], IDS[50:55]),
        RowGroup(forks[1], [5, 6, 7, 8], parents=[-1, 0, 0, 2]),
        RowGroup(forks[2], IDS[60:64], logits_rows=1),
    ]
    scored = evaluate_groups(groups)
    assert_agree(scored[0], references[0].evaluate(IDS[50:55]))
    assert_agree(scored[1], references[1].evaluate_tree([5, 6, 7, 8], [-1, 0, 0, 2]))
    assert_agree(scored[2], references[2].evaluate(IDS[60:64], 1))
    assert len({backend.seat for backend in forks}) == 3 and first.passes.seats >= 3


def counted_rows(monkeypatch, method: str) -> list[int]:
    """The row count of every call of a GraphPasses method whose first argument holds the rows."""
    rows: list[int] = []
    original = getattr(GraphPasses, method)

    def counting(self, first, *args):
        rows.append(first.shape[0])
        return original(self, first, *args)

    monkeypatch.setattr(GraphPasses, method, counting)
    return rows


@pytest.mark.parametrize("mode", list(MODES))
def test_a_prompt_chunk_is_one_pass_with_the_lm_head_on_its_last_row(monkeypatch, mode):
    model = family_model("llama-gqa")
    ours, reference = graph(model, mode, n_batch=64), hf(model, n_batch=64)
    passes, heads = counted_rows(monkeypatch, "_layers"), []
    lm_head = ours.weights.lm_head
    monkeypatch.setattr(ours.weights, "lm_head", lambda h: heads.append(h.shape[0]) or lm_head(h))
    prompt = (IDS * 2)[:150]
    assert_agree(ours.evaluate(prompt, 1), reference.evaluate(prompt, 1))
    assert passes == [64, 64, 22] and heads == [1, 1, 1]
    del passes[:], heads[:]
    ours.evaluate(IDS[:5])  # a verify pass: every row's logits, in the mode's rows
    assert passes == heads == [FIXED_ROWS if mode == "fixed" else 8]
    del passes[:], heads[:]
    scored = ours.evaluate_groups([RowGroup(ours, IDS[20:60], logits_rows=1)])  # a batch of one chunk
    assert_agree(scored[0], reference.evaluate(IDS[:5] + IDS[20:60], 1))
    assert passes == [40] and heads == [1]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_chunks_equal_transformers(name):
    model = family_model(name)
    ours, reference = graph(model, n_batch=48), hf(model, n_batch=48)
    prompt = (IDS * 2)[:130]  # chunks from position 0 (causal) and after it (masked)
    for backend in (ours, reference):
        backend.capture_hidden([0, 2])
    assert_agree(ours.evaluate(prompt, 1), reference.evaluate(prompt, 1))
    assert_agree(ours.evaluate(IDS[:3]), reference.evaluate(IDS[:3]))
    for backend in (ours, reference):  # a context shift: a tail read again after a kept head
        backend.truncate(20)
        backend.evaluate(prompt[60:], logits_rows=0)
    assert ours.tokens == reference.tokens
    assert_agree(ours.evaluate(IDS[5:9]), reference.evaluate(IDS[5:9]))
    assert_agree(ours.hidden_states(0, 94), reference.hidden_states(0, 94))


def test_a_new_prompt_keeps_only_whole_prefill_chunks():
    backend = graph(family_model("llama-gqa"), n_batch=16)
    backend.evaluate(IDS[:40], 1)  # prefilled in chunks of 16, 16 and 8 rows
    backend.evaluate(IDS[40:56])  # 16 rows, but a verify pass: not a fresh run's chunk
    assert backend.reusable_prefix(56) == 32
    backend.truncate(20)
    assert backend.reusable_prefix(20) == 16


def test_the_store_grows_without_losing_cached_entries(monkeypatch):
    monkeypatch.setattr(graph_module, "FIRST_SLOTS", 128)
    model = family_model("qwen2-tied")
    ours, reference = graph(model, n_ctx=256), hf(model, n_ctx=256)
    long_prompt = (IDS * 3)[:200]  # past the first seat size: slots grow
    assert_agree(ours.evaluate(long_prompt, 1), reference.evaluate(long_prompt, 1))
    late = ours.fork()  # a second seat after the first holds 200 entries
    assert_agree(ours.evaluate(IDS[:5]), reference.evaluate(IDS[:5]))
    assert late.evaluate(IDS[:3]).shape == (3, VOCAB_SIZE)
    with pytest.raises(SpecdecodeError, match="context"):
        ours.evaluate(IDS[:60])


def test_a_released_seat_is_reused():
    model = family_model("llama-gqa")
    first = graph(model)
    fork = first.fork()
    seat = fork.seat
    del fork
    assert first.fork().seat == seat


# --------------------------------------------------------------------------- exactness


def test_fixed_passes_give_a_row_the_bits_of_a_one_row_pass():
    backend = graph(bf16_llama())
    backend.evaluate(IDS[:30])
    alone = [backend.evaluate([token])[0] for token in IDS[30:47]]
    backend.truncate(30)
    together = backend.evaluate(IDS[30:47])
    assert all(torch.equal(row, together[i]) for i, row in enumerate(alone))


def test_fixed_passes_give_a_batch_rows_the_bits_of_each_sequence_alone():
    first = graph(bf16_llama())
    forks = [first, first.fork(), first.fork(), first.fork()]
    for index, fork in enumerate(forks):
        fork.evaluate(IDS[index : index + 20 + 9 * index], 1)
    groups = [
        RowGroup(forks[0], IDS[50:51]),  # a decode step
        RowGroup(forks[1], [5, 6, 7, 8], parents=[-1, 0, 0, 2]),  # a tree
        RowGroup(forks[2], IDS[60:77]),  # a verify pass: 1 + 16 rows
        RowGroup(forks[3], [9, 10, 11], parents=[-1, 0, 1]),
    ]
    alone = []
    for group in groups:
        cached = len(group.backend.tokens)
        alone.append(batch_module.score_alone(group))
        group.backend.truncate(cached)
    together = evaluate_groups(groups)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


def test_a_rows_bits_do_not_depend_on_its_seats_size(monkeypatch):
    monkeypatch.setattr(graph_module, "FIRST_SLOTS", 128)
    backend = graph(bf16_llama(), n_ctx=1024)
    backend.evaluate(IDS[:60], 1)
    before = backend.evaluate(IDS[60:65])
    backend.truncate(60)
    backend.passes.reserve(600)  # every seat grows: attention reads more (unseen) slots
    assert torch.equal(backend.evaluate(IDS[60:65]), before)


def graph_pipelines(mode: str, n_batch: int = 512, **kwargs) -> tuple[Pipeline, Pipeline]:
    """(plain, speculative) targets in `mode`; the draft's passes decide only what is proposed,
    so it runs the fewest rows (bucketed)."""
    plain = Pipeline(graph(bf16_llama(), mode, n_batch=n_batch))
    target, draft = graph(bf16_llama(), mode, n_batch=n_batch), graph(bf16_draft(), "bucketed")
    return plain, Pipeline(target, draft, **kwargs)


@pytest.mark.parametrize("n_max", [4, 16])
def test_fixed_mode_bfloat16_greedy_speculation_equals_plain(exactness_log, n_max):
    config = GenerationConfig(n_predict=32, ignore_eos=True)
    plain, spec = graph_pipelines("fixed", draft_config=DraftModelConfig(n_max=n_max, p_min=0.0))
    for prompt in ([3, 4, 5, 6], IDS[:30]):
        result = spec.generate(prompt, GREEDY, config)
        assert result.tokens == plain.generate(prompt, GREEDY, config).tokens
        assert result.stats.totals.n_accepted > 0
        exactness_log.record("graph-fixed/bfloat16", "0.1", result.stats, dtype="bfloat16")


@pytest.mark.slow
def test_compiled_layer_parts_keep_speculation_equal_to_plain(monkeypatch, exactness_log):
    """The layers' element-wise parts compiled (the GPU's default, forced here on the CPU):
    plain and speculative runs share the kernels, so their outputs stay identical."""

    class Compiled(LayerOps):
        def __init__(self, *args, compiled: bool | None = None) -> None:
            super().__init__(*args, compiled=True if compiled is None else compiled)

    monkeypatch.setattr(graph_module, "LayerOps", Compiled)
    monkeypatch.setattr(graph_module, "_ENGINES", weakref.WeakKeyDictionary())
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    plain, spec = graph_pipelines("fixed", draft_config=DraftModelConfig(n_max=6, p_min=0.0))
    assert plain.target.passes.ops.compiled
    for sampling in (GREEDY, SamplingParams(temperature=1.2, seed=4)):
        result = spec.generate(IDS[:40], sampling, config)
        assert result.tokens == plain.generate(IDS[:40], sampling, config).tokens
        exactness_log.record("graph-fixed/bfloat16-compiled", "0.1", result.stats, dtype="bfloat16")
    assert plain.target.passes.ops.compiled and plain.target.passes.ops._kernels  # no fall-back


@pytest.mark.parametrize("seed", [1, 2])
def test_fixed_mode_seeded_sampling_equals_plain(exactness_log, seed):
    sampling = SamplingParams(temperature=1.2, seed=seed)
    config = GenerationConfig(n_predict=32, ignore_eos=True)
    plain, spec = graph_pipelines(
        "fixed", spec_types=["ngram-simple", "draft"], draft_config=DraftModelConfig(n_max=8, p_min=0.0)
    )
    result = spec.generate(IDS[:20], sampling, config)
    assert result.tokens == plain.generate(IDS[:20], sampling, config).tokens
    exactness_log.record("graph-fixed/bfloat16-seeded", "0.1", result.stats, dtype="bfloat16")


@pytest.mark.parametrize("n_batch", [24, 512])
@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(temperature=1.2, seed=3)], ids=["greedy", "seeded"]
)
def test_long_prompts_prefill_alike_in_plain_and_speculative_runs(exactness_log, n_batch, sampling):
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    plain, spec = graph_pipelines(
        "fixed",
        n_batch,
        spec_types=["ngram-simple", "draft"],
        draft_config=DraftModelConfig(n_max=8, p_min=0.0),
    )
    prompt = (IDS * 2)[:100]
    result = spec.generate(prompt, sampling, config)
    assert result.tokens == plain.generate(prompt, sampling, config).tokens
    kind = "bfloat16" if sampling is GREEDY else "bfloat16-seeded"
    exactness_log.record(f"graph-fixed/{kind}-long-prompt", "0.1", result.stats, dtype="bfloat16")


@pytest.mark.parametrize(("length", "n_batch"), [(12, 512), (70, 24)])
def test_batched_generation_on_graph_passes_equals_each_alone(exactness_log, length, n_batch):
    config = GenerationConfig(n_predict=16, ignore_eos=True)
    plain, spec = graph_pipelines("fixed", n_batch, draft_config=DraftModelConfig(n_max=6, p_min=0.0))
    prompts = [(IDS * 2)[i : i + length] for i in range(0, 40, 10)]
    alone = [plain.generate(prompt, GREEDY, config).tokens for prompt in prompts]
    batched = spec.generate_batch(prompts, GREEDY, config)
    assert [result.tokens for result in batched] == alone
    for result in batched:
        exactness_log.record("graph-fixed/bfloat16-batch", "0.1", result.stats, dtype="bfloat16")


# --------------------------------------------------------------------------- CUDA graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", list(MODES))
def test_replayed_graphs_equal_eager_passes(mode):
    model = copy.deepcopy(family_model("llama-gqa")).to("cuda", torch.float32)
    ours = graph(model, mode)
    eager = graph(model, mode, n_ctx=200)  # another context size: an engine of its own
    eager.passes.use_graphs = False
    for backend in (ours, eager):
        backend.evaluate(IDS[:20])
    for step in range(3):
        assert torch.equal(
            ours.evaluate(IDS[20 + step : 21 + step]), eager.evaluate(IDS[20 + step : 21 + step])
        )
    tree = ([5, 6, 7], [-1, 0, 0])
    assert torch.equal(ours.evaluate_tree(*tree), eager.evaluate_tree(*tree))
    batches = []
    for backend in (ours, eager):  # several seats in one pass, a chain and a tree
        fork = backend.fork()
        fork.evaluate(IDS[40:49], 1)
        batches.append(evaluate_groups([RowGroup(backend, IDS[30:33]), RowGroup(fork, *tree)]))
    assert all(torch.equal(a, b) for a, b in zip(*batches, strict=True))
    assert ours.passes.graphs


# --------------------------------------------------------------------------- choosing the passes


def test_passes_are_chosen_by_option_and_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert native_kind("auto", cpu) is NativeBackend
    assert native_kind("auto", cuda) is GraphBackend
    assert native_kind("invariant", cuda) is NativeBackend
    assert native_kind("bucketed", cpu) is GraphBackend
    model = family_model("llama-gqa")
    assert native_backend(model, cached_tokenizer(), passes="bucketed").passes.fixed_rows is None
    assert native_backend(model, cached_tokenizer(), passes="fixed").passes.fixed_rows == FIXED_ROWS
    fork = native_backend(model, cached_tokenizer(), passes="bucketed").fork()
    assert isinstance(fork, GraphBackend) and fork.passes.fixed_rows is None
    with pytest.raises(SpecdecodeError, match="passes"):
        LoadOptions(passes="fast")


def test_cli_passes_flag_keeps_the_output(saved_model_dir, capsys):
    outputs = []
    for passes in ("invariant", "fixed", "bucketed"):
        args = ["generate", "-m", str(saved_model_dir), "--temp", "0", "-n", "12", "-p", "def f(x):"]
        assert main([*args, "--dtype", "float32", "--passes", passes]) == 0
        outputs.append(capsys.readouterr().out.splitlines()[0])
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize(
    ("passes", "tree_flags", "warned"),
    [
        ("fixed", [], None),
        ("fixed", ["--draft-n-parallel", "2"], "tree drafts"),
        ("bucketed", [], "power-of-two"),
    ],
)
def test_cli_says_up_front_where_graph_passes_may_leave_plain_output(
    saved_model_dir, capsys, passes, tree_flags, warned
):
    args = ["generate", "-m", str(saved_model_dir), "-md", str(saved_model_dir), "--temp", "0", "-n", "4"]
    assert main([*args, "-p", "x", "--dtype", "float32", "--passes", passes, *tree_flags]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert (warnings == []) if warned is None else (len(warnings) == 1 and warned in warnings[0])
