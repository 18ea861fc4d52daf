"""NativeBackend: the lean Llama-family forward against transformers', row-invariance in
bfloat16 (what keeps speculative output equal to plain output there), and how loading picks it.

Agreement tests run float64 models of the three supported families through both forwards and
compare every logit; the native forward does what transformers' does in the same order of
precision (the norm in float32, the rotary angles from the model's own module), so they agree
to rounding. Row-invariance tests run a model whose MLP is wide enough that, on common CPUs, one
product of the down projection gives a row other bits in a pass of several rows (in bfloat16),
and one row gets other bits than several (a GEMV against a GEMM, in float32 and float64); the
probe that finds such products is also checked against stand-in kernels, on any CPU.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB_SIZE, cached_tokenizer, eagle3_head, eagle3_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, LoadOptions, Pipeline, SamplingParams
from specdecode.backends.invariant import (
    INVARIANT_ROWS,
    ONE_PRODUCT,
    ROW_BY_ROW,
    Plan,
    Projection,
    _pack,
    invariance_plan,
)
from specdecode.backends.load import load_backend
from specdecode.backends.native import NativeBackend
from specdecode.backends.native_weights import native_unsupported
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.strategies import NgramMapConfig, NgramModConfig, NgramSettings
from specdecode.testing import make_llama, perturbed_copy, save_model

GREEDY = SamplingParams(temperature=0)
RTOL = 1e-9
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}

# --------------------------------------------------------------------------- models

COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.5,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}
# name -> (model class, config class, overrides): each family, with the variations real models use
FAMILIES = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, {}),
    "llama-mha-biased-linear-rope": (
        LlamaForCausalLM,
        LlamaConfig,
        {"num_key_value_heads": 4, "attention_bias": True, "rope_scaling": {"type": "linear", "factor": 2.0}},
    ),
    "mistral-head-dim": (MistralForCausalLM, MistralConfig, {"sliding_window": None, "head_dim": 16}),
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config, {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


@functools.cache
def family_model(name: str) -> PreTrainedModel:
    """A seeded random float64 model of one family (see FAMILIES)."""
    model_class, config_class, overrides = FAMILIES[name]
    config = config_class(**{**COMMON, **overrides})
    assert native_unsupported(config) is None, name
    torch.manual_seed(0)
    return model_class(config).to(torch.float64).eval()


@functools.cache
def wide_llama(dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """A Llama with a 1536-wide MLP: its down projection sums over K = 1536, where a single
    product is not row-invariant on common CPUs (so slices, bands of rows or rows get used)."""
    model = make_llama(
        VOCAB_SIZE, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=1536, init_std=0.5, seed=2
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper: drafts get accepted often, not always
    return model.to(dtype)


def bf16_llama() -> LlamaForCausalLM:
    return wide_llama(torch.bfloat16)


@functools.cache
def bf16_draft() -> LlamaForCausalLM:
    return perturbed_copy(bf16_llama(), 0.1)


def native(model: PreTrainedModel, **kwargs) -> NativeBackend:
    return NativeBackend(model, cached_tokenizer(), **kwargs)


def hf(model: PreTrainedModel, **kwargs) -> HFBackend:
    return HFBackend(model, cached_tokenizer(), **kwargs)


def assert_agree(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    if reference.numel() == 0:
        return
    assert ours.dtype == reference.dtype == torch.float64
    scale = float(reference.abs().max())
    torch.testing.assert_close(ours, reference, rtol=RTOL, atol=RTOL * scale)


# --------------------------------------------------------------------------- agreement with transformers

IDS = [(37 * i + 11) % (VOCAB_SIZE - 3) + 3 for i in range(80)]
# (truncate to n, then evaluate these ids with this logits_rows); None: no truncation
SCRIPT = [
    (None, IDS[:70], None),  # the prompt: chunks of n_batch, the cache grows past its first 64
    (None, IDS[70:71], None),  # single-token steps
    (None, IDS[71:72], 1),
    (None, IDS[72:77], None),  # a multi-token step
    (66, IDS[5:9], None),  # rollback, then other tokens at the same positions
    (69, IDS[20:26], 2),  # rollback inside the last step; only the last rows' logits
    (None, IDS[30:33], 0),  # no rows asked for
    (200, IDS[40:41], None),  # past the end: nothing to forget
    (0, IDS[50:57], None),  # an empty cache
    (-1, IDS[60:62], 1),
    (1, IDS[:3], 5),  # more rows asked for than tokens given
]


@pytest.mark.parametrize("n_batch", [3, 512])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_equal_transformers(name, n_batch):
    model = family_model(name)
    ours, reference = native(model, n_batch=n_batch), hf(model, n_batch=n_batch)
    for keep, ids, logits_rows in SCRIPT:
        if keep is not None:
            ours.truncate(keep)
            reference.truncate(keep)
            assert ours.tokens == reference.tokens
        assert_agree(ours.evaluate(ids, logits_rows), reference.evaluate(ids, logits_rows))
        assert ours.tokens == reference.tokens


@settings(max_examples=20, **SETTINGS)
@given(
    name=st.sampled_from(list(FAMILIES)),
    first=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24),
    ops=st.lists(
        st.tuples(st.integers(-2, 30), st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8)),
        min_size=1,
        max_size=4,
    ),
    n_batch=st.sampled_from([1, 3, 512]),
)
def test_truncate_then_evaluate_equals_transformers(name, first, ops, n_batch):
    model = family_model(name)
    ours, reference = native(model, n_batch=n_batch), hf(model, n_batch=n_batch)
    assert_agree(ours.evaluate(first), reference.evaluate(first))
    for keep, ids in ops:
        ours.truncate(keep)
        reference.truncate(keep)
        assert_agree(ours.evaluate(ids), reference.evaluate(ids))
        assert ours.tokens == reference.tokens


def test_context_limit_is_the_cache_capacity():
    """The cache never grows past n_ctx, and a pass that would overflow leaves it alone."""
    model = family_model("llama-gqa")
    ours, reference = native(model, n_ctx=70), hf(model, n_ctx=70)
    ours.evaluate(IDS[:64])
    reference.evaluate(IDS[:64])
    with pytest.raises(SpecdecodeError, match="context full"):
        ours.evaluate(IDS[:7])
    assert ours.tokens == IDS[:64]
    assert_agree(ours.evaluate(IDS[64:70]), reference.evaluate(IDS[64:70]))
    assert ours._kv.capacity == 70
    with pytest.raises(SpecdecodeError, match="n_ctx 70"):
        ours.evaluate([5])


# --------------------------------------------------------------------------- hidden states


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-tied"])
def test_hidden_states_equal_transformers(name):
    """The rows the native forward records equal the hooks' rows, the last layer's output
    (id n_layers) included, across chunks, steps and rollbacks."""
    model = family_model(name)
    ours, reference = native(model, n_batch=4), hf(model, n_batch=4)
    layers = [0, 1, model.config.num_hidden_layers]
    for backend in (ours, reference):
        backend.evaluate(IDS[:5])
        backend.capture_hidden(layers)
        assert backend.tokens == []  # a new choice of layers starts the cache over
    for keep, ids, _ in SCRIPT[:6]:
        if keep is not None:
            ours.truncate(keep)
            reference.truncate(keep)
        ours.evaluate(ids)
        reference.evaluate(ids)
        n = len(ours.tokens)
        rows = ours.hidden_states(0, n)
        assert rows.shape == (n, 3 * model.config.hidden_size)
        assert_agree(rows, reference.hidden_states(0, n))
        assert_agree(ours.hidden_states(n - 3, n - 1), rows[n - 3 : n - 1])
    ours.capture_hidden([])
    with pytest.raises(SpecdecodeError, match="not captured"):
        ours.hidden_states(0, 1)


# --------------------------------------------------------------------------- forks


def test_forks_share_the_weights_and_own_their_caches():
    model = family_model("mistral-head-dim")
    first = native(model, n_batch=4)
    second = first.fork()
    assert type(second) is NativeBackend
    assert second.model is first.model and second.weights is first.weights
    assert second.weights.layers[0].qkv.weight is first.weights.layers[0].qkv.weight
    assert second._kv is not first._kv
    # the modules hold views of the fused weight: one copy of the weights in memory
    attention = model.model.layers[0].self_attn
    fused = first.weights.layers[0].qkv.weight
    assert attention.q_proj.weight.data_ptr() == fused.data_ptr()
    alone_first, alone_second = native(model), native(model)
    steps = [(IDS[:9], IDS[40:52]), (IDS[9:10], IDS[52:55]), (IDS[10:14], IDS[55:56])]
    for ids_first, ids_second in steps:
        assert_agree(first.evaluate(ids_first), alone_first.evaluate(ids_first))
        assert_agree(second.evaluate(ids_second), alone_second.evaluate(ids_second))
    first.truncate(3)
    alone_first.truncate(3)
    assert_agree(first.evaluate(IDS[20:25]), alone_first.evaluate(IDS[20:25]))
    assert_agree(second.evaluate(IDS[25:27]), alone_second.evaluate(IDS[25:27]))
    assert second.tokens == IDS[40:56] + IDS[25:27]


# --------------------------------------------------------------------------- row-invariance

INVARIANT_DTYPES = [torch.bfloat16, torch.float32, torch.float64]


def test_weights_of_every_dtype_are_probed_once_per_shape():
    for model in (family_model("llama-gqa"), bf16_llama()):
        backend = native(model)
        assert backend.invariant
        plans = backend.weights.plans
        # qkv, out, gate_up, down, lm_head: five shapes, each probed once for both layers
        assert len(plans) == 5
        assert all(isinstance(plan, Plan) for plan in plans.values())
        assert native(model).weights.plans is plans  # a second backend re-uses the probes
        logits_dtype = torch.float64 if model.dtype == torch.float64 else torch.float32
        assert backend.evaluate(IDS[:3]).dtype == logits_dtype


@pytest.mark.parametrize("dtype", INVARIANT_DTYPES)
@pytest.mark.parametrize("cached", [1, 21, 50])
def test_passes_are_row_invariant(dtype, cached):
    """M tokens in one pass get bit for bit the logits they get one at a time."""
    backend = native(wide_llama(dtype))
    prefix = IDS[:cached]
    backend.evaluate(prefix)
    for m in range(1, 18):
        ids = [(41 * i + 13 * m + cached) % (VOCAB_SIZE - 3) + 3 for i in range(m)]
        together = backend.evaluate(ids)
        backend.truncate(len(prefix))
        alone = torch.cat([backend.evaluate([token]) for token in ids])
        backend.truncate(len(prefix))
        assert torch.equal(together, alone), m


PLANS = [ROW_BY_ROW, Plan(2), Plan(4), Plan(1, 3, 4), Plan(2, 2, 5), Plan(1, 16, INVARIANT_ROWS)]
PLANS += [
    Plan(packed=True),
    Plan(2, packed=True),
    Plan(1, 2, INVARIANT_ROWS, packed=True),
    Plan(4, 3, 5, packed=True),
]


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_projection_plans_compute_the_same_product(plan, dtype):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator).to(dtype)
    if plan.packed and _pack(weight) is None:
        pytest.skip("this torch has no oneDNN packed product")
    bias = torch.randn(48, generator=generator).to(dtype)
    x = torch.randn(17, 64, generator=generator).to(dtype)
    tolerance = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    for with_bias in (None, bias):
        projection = Projection(weight, with_bias, plan)
        expected = F.linear(x.double(), weight.double(), None if with_bias is None else with_bias.double())
        for rows in (1, 2, 5, 9, 17):
            out = projection(x[:rows])
            assert out.dtype == dtype and out.shape == (rows, 48)
            torch.testing.assert_close(out.double(), expected[:rows], **tolerance)


@pytest.mark.parametrize("dtype", INVARIANT_DTYPES)
def test_attention_gives_each_query_row_its_one_row_bits(dtype):
    """In float32 at least (attention's precision) any difference of a batched kernel shows in
    the bits, which a bfloat16 model's logits would mostly round away."""
    backend = native(wide_llama(dtype))
    weights = backend.weights
    generator = torch.Generator().manual_seed(4)
    start, n = 23, 17
    like = {"generator": generator, "dtype": backend._kv.dtype}
    keys, values = (torch.randn(weights.n_kv_heads, start + n, weights.head_dim, **like) for _ in range(2))
    q = torch.randn(weights.n_heads, n, weights.head_dim, **like)
    together = backend._attend(q, keys, values, start)
    alone = torch.cat(
        [
            backend._attend(q[:, i : i + 1], keys[:, : start + i + 1], values[:, : start + i + 1], start + i)
            for i in range(n)
        ],
        dim=1,
    )
    assert together.shape == q.shape
    assert torch.equal(together, alone)


def reordering_linear(max_k: int | None, rows: tuple[int, int] = (2, INVARIANT_ROWS)):
    """A stand-in for F.linear that sums over K in float32, in reverse order in passes of
    rows[0] to rows[1] rows when K > max_k (None: never): a kernel that blocks K only for
    some batch sizes."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        terms = x.float()[:, None, :] * weight.float()[None]  # bfloat16 products are exact
        if max_k is not None and rows[0] <= x.shape[0] <= rows[1] and x.shape[1] > max_k:
            terms = terms.flip(-1)
        out = terms.sum(-1)
        return (out if bias is None else out + bias.float()).to(x.dtype)

    return linear


@pytest.mark.parametrize(
    ("max_k", "rows", "plan", "packed_plan"),
    [
        (None, (2, INVARIANT_ROWS), ONE_PRODUCT, Plan(min_rows=2, packed=True)),
        # BLAS: slices of 384, one order at any row count; packed: a padded row costs less
        (512, (2, INVARIANT_ROWS), Plan(slices=4), Plan(min_rows=2, packed=True)),
        # one order from 2 rows on: one row is padded
        (0, (2, INVARIANT_ROWS), Plan(min_rows=2), Plan(min_rows=2, packed=True)),
        # as MKL's float32 GEMV and small GEMM
        (0, (1, 15), Plan(min_rows=1, max_rows=15), Plan(min_rows=2, max_rows=15, packed=True)),
        # longer passes are split
        (0, (16, INVARIANT_ROWS), Plan(min_rows=1, max_rows=15), Plan(min_rows=2, max_rows=15, packed=True)),
        # a GEMV that sums in another order than any GEMM
        (0, (1, 1), Plan(min_rows=2), Plan(min_rows=2, packed=True)),
    ],
)
@pytest.mark.parametrize("kernel", ["blas", "packed"])
def test_invariance_plan_sees_any_change_of_summation_order(
    monkeypatch, max_k, rows, plan, packed_plan, kernel
):
    """A change of order that random probes show in about one output in ten thousand is found
    every time: one product where the order never changes, the widest slices that keep it,
    else the cheapest band of row counts that sums in one order; by the packed kernel where
    there is one, which it prefers (and never runs on one row alone)."""
    import specdecode.backends.invariant as module

    linear = reordering_linear(max_k, rows)
    monkeypatch.setattr(module, "F", SimpleNamespace(linear=linear, pad=F.pad))
    if kernel == "packed":
        monkeypatch.setattr(module, "_pack", torch.Tensor.contiguous)
        monkeypatch.setattr(module, "_packed_linear", linear)
    else:
        monkeypatch.setattr(module, "_pack", lambda weight: None)
    expected = packed_plan if kernel == "packed" else plan
    weight = torch.randn(32, 1536, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert invariance_plan(weight, None) == expected
    assert invariance_plan(weight, torch.ones(32, dtype=torch.bfloat16)) == expected


def test_plans_cost_what_their_products_cost():
    assert ROW_BY_ROW.cost() > Plan(min_rows=16).cost() > Plan(max_rows=15, min_rows=2).cost()
    assert Plan(min_rows=3).cost() < Plan(min_rows=2, max_rows=2).cost()
    assert ONE_PRODUCT.cost() < Plan(min_rows=2).cost() < Plan(slices=2, min_rows=2).cost()
    # a packed product's rows cost little beside its fixed cost: padding beats slicing
    assert Plan(min_rows=2, packed=True).cost() < Plan(slices=2, packed=True).cost()


@pytest.mark.parametrize("dtype", INVARIANT_DTYPES)
def test_every_projection_of_the_model_is_row_invariant(dtype):
    """Whatever the probes chose, the model's projections give inputs other than the probe's
    the same bits in any pass size (on random inputs a change in the order of summation shows
    in about one output in ten thousand, hence several inputs of many rows)."""
    weights = native(wide_llama(dtype)).weights
    projections = [p for layer in weights.layers for p in (layer.qkv, layer.out, layer.gate_up, layer.down)]
    generator = torch.Generator().manual_seed(3)
    for projection in [*projections, weights.lm_head]:
        for _ in range(3):
            x = torch.randn(INVARIANT_ROWS, projection.weight.shape[1], generator=generator)
            x = x.to(dtype)
            alone = torch.cat([projection(row) for row in x.split(1)])
            for rows in (2, 5, 15, 16, 17, 33, INVARIANT_ROWS):
                assert torch.equal(projection(x[:rows]), alone[:rows]), (projection.weight.shape, rows)


def bf16_pipelines(spec_types: list[str] | None = None, **kwargs) -> tuple[Pipeline, Pipeline]:
    """(plain, speculative) over bfloat16 native backends; the draft model when "draft" is used."""
    with_draft = spec_types is None or "draft" in spec_types
    draft = native(bf16_draft()) if with_draft else None
    speculative = Pipeline(native(bf16_llama()), draft, spec_types=spec_types, **kwargs)
    return Pipeline(native(bf16_llama())), speculative


BF16_PROMPTS = ([3, 4, 5, 6], IDS[:30], "def fill(text, width=70):\n")


@pytest.mark.parametrize("n_max", [1, 4, 16])
def test_bfloat16_greedy_speculation_equals_plain(exactness_log, n_max):
    config = GenerationConfig(n_predict=32, ignore_eos=True)
    plain, spec = bf16_pipelines(draft_config=DraftModelConfig(n_max=n_max, p_min=0.0))
    drafted = accepted = 0
    for prompt in BF16_PROMPTS:
        expected = plain.generate(prompt, GREEDY, config)
        result = spec.generate(prompt, GREEDY, config)
        assert result.tokens == expected.tokens
        assert result.text == expected.text
        drafted += result.stats.totals.n_drafted
        accepted += result.stats.totals.n_accepted
        exactness_log.record("native/bfloat16", "0.1", result.stats, dtype="bfloat16")
    # both paths run: accepted drafts (multi-row passes) and rejected ones (rollbacks)
    assert 0 < accepted < drafted


@pytest.mark.parametrize(
    ("types", "ngram"),
    [
        (["ngram-simple", "draft"], NgramSettings(simple=NgramMapConfig(size_n=1, size_m=40))),
        (["ngram-mod"], NgramSettings(mod=NgramModConfig(n_match=1, n_min=1, n_max=64))),
    ],
)
def test_bfloat16_long_ngram_drafts_equal_plain(exactness_log, types, ngram):
    """n-gram drafts of tens of tokens (keyed on the last token alone, so that this chaotic
    model's output finds matches): verify passes of up to 65 rows stay invariant."""
    config = GenerationConfig(n_predict=48, ignore_eos=True)
    plain, spec = bf16_pipelines(types, ngram=ngram, draft_config=DraftModelConfig(n_max=8, p_min=0.0))
    prompt = IDS[:40]
    result = spec.generate(prompt, GREEDY, config)
    assert result.tokens == plain.generate(prompt, GREEDY, config).tokens
    exactness_log.record("native/bfloat16", ",".join(types), result.stats, dtype="bfloat16")
    ngram_stats = next(s for s in result.stats.strategies if s.name == types[0])
    assert ngram_stats.n_gen_drafts > 0 and ngram_stats.n_gen_tokens > 4 * ngram_stats.n_gen_drafts


ISSUE_PROMPT = [3 + (37 * i) % 300 for i in range(12)]


# Pinned: found by searching seeds against the float32 forward before passes were row-invariant
# in every dtype. There the verify pass (a GEMM) gave the second generated token's row other bits
# than plain generation's one-row pass (a GEMV), and at temperature 1.7 the draw fell between
# the two distributions: speculative output left plain output at the second token.
@pytest.mark.parametrize("seed", [8746, 38969, 50164])
def test_float32_seeded_sampling_in_a_chain_equals_plain(exactness_log, seed):
    sampling = SamplingParams(temperature=1.7, seed=seed, presence_penalty=0.5, top_k=0, top_p=1.0, min_p=0.0)
    config = GenerationConfig(n_predict=48, ignore_eos=True)
    target = wide_llama(torch.float32)
    expected = Pipeline(native(target)).generate(ISSUE_PROMPT, sampling, config)
    pipe = Pipeline(
        native(target),
        native(f32_draft()),
        spec_types=["ngram-map-k", "ngram-cache", "draft"],
        draft_config=DraftModelConfig(n_max=8, p_min=0.0),
    )
    result = pipe.generate(ISSUE_PROMPT, sampling, config)
    assert result.tokens == expected.tokens
    assert result.stats.totals.n_drafted > 0
    exactness_log.record("native/float32-pinned", "0.1", result.stats, dtype="float32")


@functools.cache
def f32_draft() -> LlamaForCausalLM:
    return perturbed_copy(wide_llama(torch.float32), 0.1)


# --------------------------------------------------------------------------- EAGLE-3


@pytest.mark.parametrize("n_max", [2, 6])
def test_eagle3_on_a_native_target_drafts_what_it_drafts_on_transformers(n_max):
    """The head reads the native forward's hidden rows: output is plain output, and the drafts
    (accepted or rolled back) are the ones the head makes over transformers' rows."""
    target, head = eagle3_target(), eagle3_head()
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    draft_config = DraftModelConfig(n_max=n_max, p_min=0.0)
    prompt = list(range(3, 20))
    expected = Pipeline(native(target)).generate(prompt, GREEDY, config)
    ours = Pipeline(native(target), eagle3=head, draft_config=draft_config).generate(prompt, GREEDY, config)
    reference = Pipeline(hf(target), eagle3=head, draft_config=draft_config).generate(prompt, GREEDY, config)
    assert ours.tokens == expected.tokens == reference.tokens
    assert 0 < ours.stats.totals.n_accepted < ours.stats.totals.n_drafted
    assert ours.stats.totals.n_drafted == reference.stats.totals.n_drafted
    assert ours.stats.totals.n_accepted == reference.stats.totals.n_accepted


# --------------------------------------------------------------------------- choosing a backend


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Saved directories: a float64 Llama, a perturbed draft of it, a tiny GPT-2 (a causal LM
    the native forward does not run) and a Llama stored in bfloat16."""
    root = tmp_path_factory.mktemp("native-models")
    tokenizer = cached_tokenizer()
    llama = family_model("llama-gqa")
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB_SIZE, n_embd=16, n_layer=1, n_head=2, n_positions=128, bos_token_id=0)
    )
    small_bf16 = make_llama(VOCAB_SIZE, hidden=16, layers=1, heads=2, kv_heads=1, dtype=torch.bfloat16)
    return {
        "llama": save_model(root / "llama", llama, tokenizer),
        "draft": save_model(root / "draft", perturbed_copy(llama, 0.02), tokenizer),
        "gpt2": save_model(root / "gpt2", gpt2.eval(), tokenizer),
        "bf16": save_model(root / "bf16", small_bf16, tokenizer),
    }


def test_auto_picks_native_for_llama_and_transformers_otherwise(saved):
    chosen = load_backend(saved["llama"])
    assert type(chosen) is NativeBackend
    assert chosen.model.dtype == torch.float64
    assert_agree(chosen.evaluate(IDS[:9]), hf(family_model("llama-gqa")).evaluate(IDS[:9]))
    assert type(load_backend(saved["gpt2"])) is HFBackend
    assert type(load_backend(saved["llama"], LoadOptions(backend="hf"))) is HFBackend
    assert type(load_backend(saved["llama"], LoadOptions(backend="native"))) is NativeBackend


def test_native_refuses_other_models_and_unknown_backends(saved):
    with pytest.raises(SpecdecodeError, match="native backend cannot run this model: model_type 'gpt2'"):
        load_backend(saved["gpt2"], LoadOptions(backend="native"))
    with pytest.raises(SpecdecodeError, match="unknown backend 'tpu'"):
        load_backend(saved["llama"], LoadOptions(backend="tpu"))
    with pytest.raises(SpecdecodeError, match="native backend cannot run this model"):
        native(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_embd=16, n_layer=1, n_head=2)))


def test_auto_dtype_is_bfloat16_only_for_native_on_a_bf16_cpu(saved):
    assert json.loads((saved["bf16"] / "config.json").read_text())["dtype"] == "bfloat16"
    ours = load_backend(saved["bf16"], LoadOptions(backend="native"))  # auto may take llama.cpp
    assert type(ours) is NativeBackend
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert ours.model.dtype == torch.bfloat16 and ours.invariant
    else:
        assert ours.model.dtype == torch.float32
    assert load_backend(saved["bf16"], LoadOptions(backend="hf")).model.dtype == torch.float32
    assert (
        load_backend(saved["bf16"], LoadOptions(backend="native", dtype="float32")).model.dtype
        == torch.float32
    )


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (LlamaConfig(hidden_act="gelu"), "activation 'gelu'"),
        (LlamaConfig(mlp_bias=True), "MLP biases"),
        (LlamaConfig(pretraining_tp=2), "pretraining_tp"),
        (MistralConfig(sliding_window=4096), "sliding-window"),
        (Qwen2Config(use_sliding_window=True, sliding_window=64), "sliding-window"),
        (LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
        (GPT2Config(), "model_type 'gpt2'"),
    ],
)
def test_native_unsupported_names_the_reason(config, reason):
    found = native_unsupported(config)
    assert found is not None and reason in found


@pytest.mark.parametrize(
    "config",
    [LlamaConfig(), MistralConfig(sliding_window=None), Qwen2Config(), LlamaConfig(attention_bias=True)],
)
def test_native_unsupported_accepts_plain_models(config):
    assert native_unsupported(config) is None


# --------------------------------------------------------------------------- command line


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("flag", "chosen"), [("hf", HFBackend), ("native", NativeBackend), ("auto", NativeBackend)]
)
def test_cli_backend_flag_picks_the_forward_and_keeps_the_output(saved, capsys, monkeypatch, flag, chosen):
    import specdecode.api

    loaded: list[type] = []

    def recording_load(path, options, use, **keywords):
        backend = load_backend(path, options, use, **keywords)
        loaded.append(type(backend))
        return backend

    common = ["-m", str(saved["llama"]), "-p", "def f(x):", "-n", "16", "--temp", "0", "--ignore-eos"]
    plain = run_json(capsys, *common, "--backend", "hf", "--spec-type", "none")
    monkeypatch.setattr(specdecode.api, "load_backend", recording_load)
    result = run_json(
        capsys,
        *common,
        "--backend",
        flag,
        "-md",
        str(saved["draft"]),
        "--draft-p-min",
        "0",
        "--spec-policy",
        "classic",
    )
    assert loaded == [chosen, chosen]  # the target and the draft
    assert result["tokens"] == plain["tokens"]
    assert result["stats"]["totals"]["n_drafted"] > 0


def test_cli_native_backend_on_another_model_is_one_error_line(saved, capsys):
    argv = ["generate", "-m", str(saved["gpt2"]), "-p", "x", "-n", "2", "--backend", "native"]
    assert main(argv) == 2
    *phases, error = capsys.readouterr().err.splitlines()
    assert error.startswith("error: ") and "native backend cannot run this model" in error
    assert all(line.startswith("specdecode: ") for line in phases)  # the start-up phases before it
    with pytest.raises(SystemExit):
        main(["generate", "-m", str(saved["llama"]), "-p", "x", "--backend", "onnx"])
