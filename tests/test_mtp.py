"""MTP: a target's own multi-token-prediction layer, read in each layout, drafting, training.

Targets are conftest's tiny float64 Llamas saved as Hugging Face directories, with an MTP layer
added beside their weights in the layout under test: random layers for the layouts and the
refusals, and, where acceptance matters, a layer trained for a few seconds on the target's own
generations (`trained_layer`), which agrees with the target often but not always.
"""

from __future__ import annotations

import functools
import inspect
import json
import textwrap
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import (
    VOCAB_SIZE,
    cached_tokenizer,
    chi_square_pvalue,
    eagle3_corpus,
    eagle3_target,
    in_dtype,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_distribution import ALPHA, e2e_params, exact_joint

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.backends.native import NativeBackend
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.strategies.mtp_checkpoint import (
    INDEX,
    MTP_FILE,
    has_mtp,
    layer_tensors,
    load_mtp,
    stored_name,
    write_target,
)
from specdecode.strategies.mtp_head import DEEPSEEK, MIMO, MtpLayer
from specdecode.testing import make_llama, make_tokenizer, save_model
from specdecode.train.config import MtpShape
from specdecode.train.eagle3 import ttt_loss
from specdecode.train.lm import TrainConfig, sample_batch
from specdecode.train.mtp import mtp_config, new_layer, train_mtp

GREEDY = SamplingParams(temperature=0)
PROMPT = list(range(3, 20))


@functools.cache
def trained_layer(steps: int = 150) -> MtpLayer:
    """An MTP layer for `eagle3_target()` (4 layers whose next token depends mostly on the
    current one), trained with the training-time test on the target's generations."""
    target = eagle3_target()
    layer = new_layer(target, seed=0)
    loss_fn = ttt_loss(target, 2)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    tokens = eagle3_corpus()
    layer.train()
    for _ in range(steps):
        loss = loss_fn(layer, sample_batch(tokens, 8, 32, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return layer.eval().requires_grad_(False)


def random_layer(
    model, layout: str = DEEPSEEK, bias: bool = False, output_bias: bool = False, seed: int = 1
) -> MtpLayer:
    """A random MTP layer of `model`'s shape (its norms random too, so that they matter)."""
    config = replace(mtp_config(model), layout=layout, attention_bias=bias, output_bias=output_bias)
    decoder = model.get_decoder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = MtpLayer(config, decoder.embed_tokens.weight, model.lm_head.weight, decoder.norm.weight)
        with torch.no_grad():
            for value in layer.parameters():
                value.copy_(torch.randn_like(value) * (0.3 if value.ndim > 1 else 1.0) + (value.ndim == 1))
    return layer.to(torch.float64)


def save_with_layer(directory: Path, model, layer: MtpLayer, layout: str = DEEPSEEK) -> Path:
    """The target saved, and `layer` added in `layout` (MTP_FILE, num_nextn_predict_layers 1)."""
    save_model(directory, model, cached_tokenizer())
    if layout == DEEPSEEK:
        tensors = layer_tensors(layer, torch.float64)
    else:
        tensors = {
            f"model.mtp_layers.0.{stored_name(name, layout)}": value.detach().clone()
            for name, value in layer.state_dict().items()
        }
    save_file(tensors, directory / MTP_FILE)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    return directory


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> Path:
    return save_with_layer(tmp_path_factory.mktemp("mtp") / "target", eagle3_target(), trained_layer())


def plain(backend, prompt, sampling, config):
    return Pipeline(backend).generate(prompt, sampling, config)


def check_same(result, expected) -> None:
    assert result.tokens == expected.tokens
    assert result.text == expected.text
    assert result.stats.stop_reason == expected.stats.stop_reason


# --------------------------------------------------------------------------- the layer


def test_chained_steps_are_what_a_fresh_layer_computes(trained_dir):
    """KV bookkeeping: a generation's drafts (cache carried over steps, rolled back after
    rejections) equal those of a fresh strategy that reads the whole context."""
    from specdecode.strategies.mtp import MtpStrategy

    target = HFBackend.load(trained_dir)
    layer, config = load_mtp(trained_dir, target), DraftModelConfig(n_max=5, p_min=0.0)
    run = Pipeline(target, mtp=layer, draft_config=config).stream(
        PROMPT, GREEDY, GenerationConfig(n_predict=40, ignore_eos=True)
    )
    calls = []
    iterator = iter(run)
    next(iterator)
    strategy = run.chain.strategies[0]
    assert isinstance(strategy, MtpStrategy) and strategy.name == "mtp"
    original = strategy.draft

    def recording(history, last, n_max):
        draft = original(history, last, n_max)
        calls.append((list(history), last, n_max, draft.tokens))
        return draft

    strategy.draft = recording
    for _ in iterator:
        pass
    assert len(calls) > 5 and 0 < run.stats.totals.n_accepted < run.stats.totals.n_drafted
    for history, last, n_max, tokens in calls:
        fresh_target = HFBackend.load(trained_dir)
        fresh = MtpStrategy(layer, fresh_target, config)
        fresh_target.evaluate(history)
        assert fresh.draft(history, last, n_max).tokens == tokens


def test_first_step_reads_the_final_normed_state():
    """The layer's first pair reads the target's output after the final norm (what vLLM passes),
    with the embedding of the token that followed; position 0's embedding is zeroed."""
    model = eagle3_target()
    layer = random_layer(model)
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]  # after the norm
        e = model.get_input_embeddings().weight[ids[0, 1:]]
        e = e * torch.tensor([0.0, 1.0, 1.0], dtype=e.dtype)[:, None]
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(states[:-1])], dim=-1))
        positions = torch.arange(3)
        from specdecode.strategies.eagle3_head import HeadCache

        ours = layer.step(ids[0, 1:].tolist(), layer.fc(_prenorm(model, ids)[:-1]), 0, HeadCache())
        reference = layer.block(x[None], positions, _causal)[0]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)  # transformers' norm: float32


def _prenorm(model, ids: torch.Tensor) -> torch.Tensor:
    """The last layer's output before the final norm [T, H]."""
    out = {}
    handle = (
        model.get_decoder()
        .layers[-1]
        .register_forward_hook(
            lambda module, args, result: out.setdefault(
                "h", result[0] if isinstance(result, tuple) else result
            )
        )
    )
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return out["h"][0]


def _causal(q, k, v):
    from specdecode.strategies.eagle3_head import repeat_kv

    groups = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True
    )


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("p_min", [0.0, 0.75])
@pytest.mark.parametrize("n_max", [1, 3, 8])
def test_greedy_mtp_equals_plain(trained_dir, exactness_log, n_max, p_min):
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    target = HFBackend.load(trained_dir)
    expected = plain(target.fork(), PROMPT, GREEDY, config)
    pipe = Pipeline(
        target, mtp=load_mtp(trained_dir, target), draft_config=DraftModelConfig(n_max=n_max, p_min=p_min)
    )
    assert pipe.spec_types == ["mtp"]
    result = pipe.generate(PROMPT, GREEDY, config)
    check_same(result, expected)
    exactness_log.record("mtp/greedy", "trained layer", result.stats, result.stats.stop_reason)


def test_trained_layer_accepts_and_rejects(trained_dir):
    """Guards the exactness tests against vacuity: both the accept and the rollback paths run."""
    target = HFBackend.load(trained_dir)
    pipe = Pipeline(
        target, mtp=load_mtp(trained_dir, target), draft_config=DraftModelConfig(n_max=6, p_min=0.0)
    )
    totals = pipe.generate(PROMPT, GREEDY, GenerationConfig(n_predict=60, ignore_eos=True)).stats.totals
    assert 0.3 * totals.n_drafted < totals.n_accepted < totals.n_drafted


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("backend", ["hf", "native"])
def test_seeded_match_equals_plain_on_both_backends(trained_dir, exactness_log, backend, seed):
    sampling = SamplingParams(temperature=0.8, seed=seed)
    config = GenerationConfig(n_predict=30, ignore_eos=seed % 2 == 0)
    model = eagle3_target()

    def make():
        kind = NativeBackend if backend == "native" else HFBackend
        return kind(model, cached_tokenizer())

    layer = load_mtp(trained_dir, make())
    expected = plain(make(), PROMPT[seed:], sampling, config)
    result = Pipeline(make(), mtp=layer, draft_config=DraftModelConfig(n_max=4, p_min=0.0)).generate(
        PROMPT[seed:], sampling, config
    )
    check_same(result, expected)
    assert result.stats.totals.n_drafted > 0
    exactness_log.record(f"mtp/match-{backend}", "trained layer", result.stats, result.stats.stop_reason)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=30),
    n_predict=st.integers(1, 32),
    n_max=st.integers(1, 8),
    p_min=st.sampled_from([0.0, 0.75]),
    temperature=st.sampled_from([0.0, 0.8]),
    seed=st.integers(0, 2**32 - 1),
    ignore_eos=st.booleans(),
)
def test_mtp_matches_plain_generation(
    trained_dir, exactness_log, prompt, n_predict, n_max, p_min, temperature, seed, ignore_eos
):
    """Greedy, and `match` at temperature 0.8 with a seed: the same tokens as plain generation."""
    sampling = SamplingParams(temperature=temperature, seed=seed)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=ignore_eos)
    target = HFBackend(eagle3_target(), cached_tokenizer())
    expected = plain(target.fork(), prompt, sampling, config)
    layer = load_mtp(trained_dir, target)
    result = Pipeline(target, mtp=layer, draft_config=DraftModelConfig(n_max=n_max, p_min=p_min)).generate(
        prompt, sampling, config
    )
    check_same(result, expected)
    exactness_log.record(f"mtp/{'greedy' if temperature == 0 else 'match'}", "trained layer", result.stats)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_backend_in_lower_precision_equals_plain(trained_dir, exactness_log, dtype):
    """The native forward's rows are the same bits however many a pass scores, so speculation
    stays exact below float64 too (greedy and seeded `match`)."""
    model = in_dtype(eagle3_target(), dtype)
    layer = load_mtp(trained_dir, NativeBackend(model, cached_tokenizer()))
    assert layer.eh_proj.weight.dtype == dtype
    config = GenerationConfig(n_predict=30, ignore_eos=True)
    for sampling in (GREEDY, SamplingParams(temperature=0.8, seed=5)):
        expected = plain(NativeBackend(model, cached_tokenizer()), PROMPT, sampling, config)
        pipe = Pipeline(
            NativeBackend(model, cached_tokenizer()),
            mtp=layer,
            draft_config=DraftModelConfig(n_max=4, p_min=0.0),
        )
        result = pipe.generate(PROMPT, sampling, config)
        check_same(result, expected)
        assert result.stats.totals.n_drafted > 0
        kind = "greedy" if sampling.greedy else "match"
        exactness_log.record(
            f"mtp/native-{kind}", "trained layer", result.stats, dtype=str(dtype).split(".")[1]
        )


def test_tree_flags_are_taken_with_draft_mtp(trained_dir, capsys):
    common = ["generate", "-m", str(trained_dir), "-p", "def f(x):", "-n", "16", "--temp", "0", "--json"]
    expected = run_json(capsys, [*common, "--spec-type", "none"])
    tree = [
        "--spec-type",
        "draft-mtp",
        "--spec-policy",
        "classic",
        "--draft-tree-tokens",
        "6",
        "--draft-tree-topk",
        "2",
    ]
    result = run_json(capsys, [*common, *tree])
    assert result["tokens"] == expected["tokens"]
    assert result["stats"]["mean_tree_size"] > 0


@pytest.mark.parametrize("tree_tokens", [4, 10])
def test_trees_equal_plain(trained_dir, exactness_log, tree_tokens):
    config = GenerationConfig(n_predict=30, ignore_eos=True)
    target = HFBackend.load(trained_dir)
    expected = plain(target.fork(), PROMPT, GREEDY, config)
    drafting = DraftModelConfig(n_max=4, p_min=0.0, tree_tokens=tree_tokens, tree_topk=3)
    result = Pipeline(target, mtp=load_mtp(trained_dir, target), draft_config=drafting).generate(
        PROMPT, GREEDY, config
    )
    check_same(result, expected)
    assert result.stats.totals.n_accepted > 0
    exactness_log.record("mtp/tree", "trained layer", result.stats, result.stats.stop_reason)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_generate_batch_equals_alone(trained_dir, exactness_log, mode):
    sampling = GREEDY if mode == "greedy" else SamplingParams(temperature=0.9, top_k=20, seed=11)
    config = GenerationConfig(n_predict=20)
    batch = [list(range(3 + i, 18 + 2 * i)) for i in range(5)]
    layer = load_mtp(trained_dir, NativeBackend(eagle3_target(), cached_tokenizer()))

    def make() -> Pipeline:
        return Pipeline(
            NativeBackend(eagle3_target(), cached_tokenizer()),
            mtp=layer,
            draft_config=DraftModelConfig(p_min=0.0),
        )

    solo = [make().generate(p, sampling, config) for p in batch]
    batched = make()
    results = batched.generate_batch(batch, sampling, config, max_sequences=3, load_rule=False)
    passes, _ = batched._seats(3)
    assert passes is not None and passes.passes > 0  # the layer's steps were shared
    for ours, expected in zip(results, solo, strict=True):
        assert ours.tokens == expected.tokens
        assert not any(strategy.n_failed for strategy in ours.stats.strategies)
        exactness_log.record(f"batch/mtp-{mode}", "native", ours.stats, ours.stats.stop_reason)
    assert sum(r.stats.totals.n_drafted for r in results) > 0


@pytest.mark.slow
def test_rejection_sampling_keeps_the_targets_distribution(one_thread, exactness_log):
    """verify="rejection" at temperature 1 with the layer drafting by sampling: over 2500 seeds
    the first three tokens follow the target's exact joint distribution (alpha 0.001)."""
    tokenizer = make_tokenizer(vocab_size=270)
    target = make_llama(len(tokenizer), hidden=16, layers=1, heads=2, kv_heads=1, init_std=0.3, seed=0)
    layer = new_layer(target, seed=5)
    prompt = tokenizer("def f(x):")["input_ids"]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ids = torch.tensor([prompt] * 64)
        for _ in range(3):
            probs = torch.softmax(target(input_ids=ids).logits[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    loss_fn, optimizer = ttt_loss(target, 2), torch.optim.Adam(layer.parameters(), lr=1e-2)
    for _ in range(100):
        loss = loss_fn(layer, ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    layer.eval().requires_grad_(False)
    pipe = Pipeline(
        HFBackend(target, tokenizer, n_ctx=64), mtp=layer, draft_config=DraftModelConfig(n_max=3, p_min=0.0)
    )
    seeds, counts, drafted, accepted = 2500, Counter(), 0, 0
    for seed in range(seeds):
        result = pipe.generate(prompt, e2e_params(seed), GenerationConfig(n_predict=4, verify="rejection"))
        counts[tuple(result.tokens[:3])] += 1
        drafted += result.stats.totals.n_drafted
        accepted += result.stats.totals.n_accepted
    assert chi_square_pvalue(counts, exact_joint(target, tokenizer, prompt, 3, e2e_params())) > ALPHA
    exactness_log.record_distribution("mtp chain, end to end", seeds)
    assert drafted >= seeds * 2 and 0.1 < accepted / drafted < 0.95, accepted / drafted


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- layouts and refusals


@pytest.mark.parametrize(
    ("layout", "bias", "output_bias"),
    [(DEEPSEEK, False, False), (DEEPSEEK, True, True), (MIMO, False, False), (MIMO, True, False)],
)
def test_each_layout_loads_and_drafts_what_it_stores(tmp_path, exactness_log, layout, bias, output_bias):
    """A random layer saved in the layout (with Qwen2's q/k/v biases, Llama's four) loads to the
    same weights, drafts, and generation stays plain generation."""
    model = eagle3_target()
    layer = random_layer(model, layout, bias, output_bias)
    directory = save_with_layer(tmp_path / "t", model, layer, layout)
    assert has_mtp(directory)
    target = HFBackend.load(directory)
    loaded = load_mtp(directory, target)
    assert (loaded.config.layout, loaded.config.attention_bias, loaded.config.output_bias) == (
        layout,
        bias,
        output_bias,
    )
    for name, value in layer.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    expected = plain(target.fork(), PROMPT, GREEDY, config)
    result = Pipeline(target, mtp=loaded, draft_config=DraftModelConfig(n_max=3, p_min=0.0)).generate(
        PROMPT, GREEDY, config
    )
    check_same(result, expected)
    assert result.stats.totals.n_drafted > 0
    exactness_log.record(f"mtp/{layout}", "random layer", result.stats, result.stats.stop_reason)


def test_mimo_layout_concatenates_hidden_first_and_chains_the_normed_state():
    """The two layouts differ only in [e ; h] order and in which state is chained on."""
    model = eagle3_target()
    deepseek = random_layer(model, DEEPSEEK)
    mimo = random_layer(model, MIMO)
    mimo.load_state_dict(deepseek.state_dict())
    h = mimo.eh_proj.weight.shape[0]
    with torch.no_grad():  # swap the halves so that [h ; e] meets the same weights
        mimo.eh_proj.weight.copy_(
            torch.cat([deepseek.eh_proj.weight[:, h:], deepseek.eh_proj.weight[:, :h]], 1)
        )
    from specdecode.strategies.eagle3_head import HeadCache

    g = torch.randn(3, h, dtype=torch.float64)
    ours = mimo.step([5, 6, 7], g, 0, HeadCache())
    reference = deepseek.step([5, 6, 7], g, 0, HeadCache())
    torch.testing.assert_close(ours, deepseek.norm(reference))
    torch.testing.assert_close(mimo.logits(ours), deepseek.logits(reference))


def test_sharded_target_with_the_layer_in_its_index(tmp_path):
    """A sharded target (model.safetensors.index.json): write_target lists the layer there, and
    the layer is read through the index."""
    model = eagle3_target()
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    cached_tokenizer().save_pretrained(sharded)
    assert (sharded / INDEX).is_file()
    out = write_target(trained_layer(), sharded, tmp_path / "out", torch.float64)
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    assert weight_map["model.layers.4.eh_proj.weight"] == MTP_FILE
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    target = HFBackend.load(out)
    layer = load_mtp(out, target)
    config = GenerationConfig(n_predict=20, ignore_eos=True)
    expected = plain(target.fork(), PROMPT, GREEDY, config)
    check_same(Pipeline(target, mtp=layer).generate(PROMPT, GREEDY, config), expected)


def test_a_target_without_mtp_layers_is_refused(tmp_path):
    directory = save_model(tmp_path / "t", eagle3_target(), cached_tokenizer())
    assert not has_mtp(directory)
    with pytest.raises(SpecdecodeError, match=r"has no MTP layers .*`specdecode train mtp` adds one"):
        load_mtp(directory, HFBackend.load(directory))
    with pytest.raises(SpecdecodeError, match="needs the target's own MTP layers"):
        Pipeline(HFBackend.load(directory), spec_types=["draft-mtp"])


def _edited(tmp_path: Path, trained_dir: Path, edit) -> Path:
    directory = tmp_path / "edited"
    directory.mkdir()
    for path in trained_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    tensors = load_file(directory / MTP_FILE)
    edit(tensors)
    save_file(tensors, directory / MTP_FILE)
    return directory


@pytest.mark.parametrize(
    ("edit", "message", "architecture"),
    [
        (
            lambda t: t.update({"model.layers.4.eh_proj.weight": torch.zeros(32, 32)}),
            r"eh_proj.weight has shape",
            True,
        ),
        (
            lambda t: t.pop("model.layers.4.mlp.up_proj.weight"),
            r"tensors missing: model.layers.4.mlp.up_proj",
            True,
        ),
        (
            lambda t: t.update({"model.layers.4.mlp.experts.0.up_proj.weight": torch.zeros(4, 4)}),
            r"block architecture is not supported \(it has mlp.experts.",
            False,
        ),
        (
            lambda t: t.update({"model.layers.4.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(4, 4)}),
            r"block architecture is not supported .*MLA",
            False,
        ),
        (
            lambda t: t.update({"model.layers.4.self_attn.q_norm.weight": torch.ones(8)}),
            r"not supported \(it has self_attn.q_norm.weight: the MTP strategy runs dense",
            False,
        ),
        (
            lambda t: [t.clear(), t.update({"mtp.fc.weight": torch.zeros(32, 64)})],
            r"Qwen3-Next's layout.* does not implement",
            False,
        ),
    ],
)
def test_layers_that_cannot_run_are_refused(tmp_path, trained_dir, edit, message, architecture):
    """has_mtp (which bench asks) sees the layout and the block's kind, not the shapes."""
    directory = _edited(tmp_path, trained_dir, edit)
    with pytest.raises(SpecdecodeError, match=message):
        load_mtp(directory, HFBackend.load(directory))
    assert has_mtp(directory) == architecture


def test_a_layer_of_another_shape_is_refused(tmp_path, trained_dir):
    directory = _edited(tmp_path, trained_dir, lambda t: None)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    with pytest.raises(SpecdecodeError, match="has no MTP layers"):  # layer 3 is the target's own
        load_mtp(directory, HFBackend.load(trained_dir))


# --------------------------------------------------------------------------- API and command line


def test_load_with_spec_types_and_speculative_config(trained_dir, exactness_log):
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    expected = Pipeline.load(trained_dir).generate(PROMPT, GREEDY, config)
    for kwargs in (
        {"spec_types": ["mtp"]},
        {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}},
        {"speculative_config": {"method": "deepseek_mtp"}},
    ):
        pipe = Pipeline.load(trained_dir, **kwargs)
        assert pipe.mtp is not None and pipe.spec_types == ["mtp"]
        result = pipe.generate(PROMPT, GREEDY, config)
        check_same(result, expected)
        exactness_log.record("mtp/load", "trained layer", result.stats, result.stats.stop_reason)
    assert (
        Pipeline.load(
            trained_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 3}
        ).draft_config.n_max
        == 3
    )
    with pytest.raises(SpecdecodeError, match="takes no 'model'"):
        Pipeline.load(trained_dir, speculative_config={"method": "mtp", "model": str(trained_dir)})


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_draft_mtp_is_plain_output(trained_dir, capsys, fixed_costs):
    """Under the default (adaptive) policy, priced by fixed costs (see test_eagle3)."""
    common = ["generate", "-m", str(trained_dir), "-p", "def f(x):", "-n", "24", "--temp", "0", "--json"]
    expected = run_json(capsys, [*common, "--spec-type", "none"])
    result = run_json(capsys, [*common, "--spec-type", "draft-mtp", "--spec-draft-p-min", "0"])
    assert [s["name"] for s in result["stats"]["strategies"]] == ["mtp"]
    assert result["tokens"] == expected["tokens"]
    assert result["stats"]["totals"]["n_drafted"] > 0


def test_draft_mtp_without_layers_is_one_error_line(tmp_path, capsys):
    directory = save_model(tmp_path / "t", eagle3_target(), cached_tokenizer())
    assert main(["generate", "-m", str(directory), "-p", "x", "-n", "2", "--spec-type", "draft-mtp"]) == 2
    *phases, error = capsys.readouterr().err.splitlines()
    assert error.startswith("error: MTP layers of") and "no MTP layers" in error
    assert all(line.startswith("specdecode: ") for line in phases)


# --------------------------------------------------------------------------- training


def tiny_config(steps: int, **changes) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        batch_size=4,
        seq_len=24,
        lr=5e-3,
        warmup_steps=1,
        device="cpu",
        precision="fp32",
        checkpoint_every=2,
        calibration_windows=0,
        **changes,
    )


def test_train_mtp_writes_a_target_that_drafts_and_resumes(tmp_path, exactness_log):
    target_dir = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    tokens = eagle3_corpus()
    out = train_mtp(tokens, target_dir, tmp_path / "out", MtpShape(unroll=2), tiny_config(4), progress=False)
    log = json.loads((out / "train_log.json").read_text())
    assert len(log["losses"]) == 4
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again = train_mtp(
        tokens, target_dir, tmp_path / "out", MtpShape(unroll=2), tiny_config(6), progress=False
    )
    assert json.loads((again / "train_log.json").read_text())["resumed_from"] == 4
    target = HFBackend.load(out)
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    result = Pipeline(
        target, mtp=load_mtp(out, target), draft_config=DraftModelConfig(n_max=3, p_min=0.0)
    ).generate(PROMPT, GREEDY, config)
    check_same(result, plain(target.fork(), PROMPT, GREEDY, config))
    assert result.stats.totals.n_drafted > 0
    exactness_log.record("mtp/trained-by-command", "4-step layer", result.stats, result.stats.stop_reason)
    with pytest.raises(SpecdecodeError, match="--out must differ from --target"):
        train_mtp(tokens, target_dir, target_dir, MtpShape(), tiny_config(1), progress=False)


def test_train_mtp_is_deterministic(tmp_path):
    target_dir = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    outs = [
        train_mtp(eagle3_corpus(), target_dir, tmp_path / name, MtpShape(2), tiny_config(2), progress=False)
        for name in ("a", "b")
    ]
    first, second = (load_file(out / MTP_FILE) for out in outs)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_train_mtp_command(tmp_path, capsys):
    target_dir = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    data = tmp_path / "data.py"
    data.write_text(inspect.getsource(textwrap) * 2)
    out = tmp_path / "out"
    argv = ["train", "mtp", "--target", str(target_dir), "--out", str(out), "--data", str(data)]
    argv += ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--unroll", "2"]
    argv += ["--precision", "fp32", "--device", "cpu", "--warmup-steps", "1", "--calibration-windows", "2"]
    assert main(argv) == 0
    assert "target with an MTP layer ->" in capsys.readouterr().err
    assert "calibration" in json.loads((out / "train_log.json").read_text())
    assert has_mtp(out) and load_mtp(out, HFBackend.load(out)).config.n_layers == 4
    assert main([*argv[:-2], "--unroll", "0"]) == 2
    assert "unroll must be >= 1" in capsys.readouterr().err


def test_bench_lists_mtp_systems_when_the_target_has_a_layer(trained_dir, tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "-m", str(trained_dir), "-n", "8", "--no-hf", "--prompts-per-task", "1"]
    argv += ["--runs", "1", "--sweep", "0", "--tasks", "completion", "--out", str(out), "--no-plots"]
    argv += ["--systems", "plain,mtp,ngram-simple+mtp"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert {"mtp", "ngram-simple,mtp"} <= set(results["systems"])
    for row in results["rows"]:
        assert row["exact_match_rate"] == 1.0, row
