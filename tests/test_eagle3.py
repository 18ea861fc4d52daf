"""EAGLE-3: hidden-state capture, the head and its training-time test, loading, drafting, training.

Targets are the tiny float64 Llamas of conftest, with 4 layers so that the head can read
three distinct layers including the last one's output (id == n_layers). Heads are random
(`new_head`) or trained for a few seconds on the target's own generations (`trained_head`),
which makes them agree with the target often but not always.
"""

from __future__ import annotations

import copy
import inspect
import json
import shutil
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    EAGLE3_LAYERS,
    VOCAB_SIZE,
    TargetSpec,
    cached_tokenizer,
    eagle3_corpus,
    eagle3_head,
    eagle3_target,
    target_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.backends import hidden_state_source
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.strategies import NgramMapConfig, NgramSettings
from specdecode.strategies.eagle3 import Eagle3Strategy
from specdecode.strategies.eagle3_checkpoint import load_head, save_head
from specdecode.strategies.eagle3_head import HeadCache, read_target, unrolled_states
from specdecode.testing import perturbed_copy, save_model
from specdecode.train import eagle3 as eagle3_train
from specdecode.train import lm
from specdecode.train.calibrate_eagle3 import agreement_sample, apply_scale, calibrate_head
from specdecode.train.eagle3 import (
    GENERATED_FILE,
    NEW_TOKENS,
    PREFIX_TOKENS,
    HeadShape,
    calibrate_saved_head,
    draft_vocabulary,
    generate_sequences,
    new_head,
    train_eagle3,
    ttt_loss,
)
from specdecode.train.lm import TrainConfig

GREEDY = SamplingParams(temperature=0)
LAYERS = EAGLE3_LAYERS
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


# --------------------------------------------------------------------------- hidden states


def reference_features(model, ids: list[int], layers=LAYERS) -> torch.Tensor:
    """One plain forward pass with output_hidden_states: entry l is the input of layer l, and
    the last entry is the output *after* the final norm, so layer n_layers is undone from it."""
    with torch.no_grad():
        states = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[layer][0] for layer in layers], dim=-1)


def normed_last(model, rows: torch.Tensor) -> torch.Tensor:
    """Our rows with the final norm applied to the n_layers block (what output_hidden_states gives)."""
    hidden = model.config.hidden_size
    with torch.no_grad():
        return torch.cat([rows[:, : 2 * hidden], model.model.norm(rows[:, 2 * hidden :])], dim=-1)


@settings(max_examples=15, **SETTINGS)
@given(
    n_batch=st.integers(1, 9),
    ops=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=5),
)
def test_captured_features_equal_a_full_forward_pass(zoo, n_batch, ops):
    """Chunked evaluation, truncation and re-evaluation keep every row equal to the row a
    single full pass computes at that position."""
    model = eagle3_target()
    backend = zoo.backend(model, n_batch=n_batch)
    backend.capture_hidden(LAYERS)
    rng = np.random.default_rng(len(ops) * 100 + n_batch)
    for keep, count in ops:
        backend.truncate(keep)
        backend.evaluate(rng.integers(3, VOCAB_SIZE, count).tolist())
    ids = backend.tokens
    rows = backend.hidden_states(0, len(ids))
    assert rows.shape == (len(ids), 3 * 32)
    torch.testing.assert_close(normed_last(model, rows), reference_features(model, ids), rtol=0, atol=1e-10)
    # and a slice is the same rows
    torch.testing.assert_close(backend.hidden_states(1, len(ids)), rows[1:])


def test_capture_costs_nothing_until_asked_and_empties_the_cache_on_change(zoo):
    model = target_model(TargetSpec(seed=5, hidden=16, layers=2))
    backend = zoo.backend(model)
    backend.evaluate([3, 4, 5])
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)  # no hooks at all
    with pytest.raises(SpecdecodeError, match="not captured"):
        backend.hidden_states(0, 1)
    backend.capture_hidden([0, 2])
    assert backend.tokens == []  # earlier positions have no rows: the cache starts over
    backend.evaluate([3, 4, 5])
    backend.capture_hidden([0, 2])  # the same choice keeps the cache
    assert backend.tokens == [3, 4, 5]
    with pytest.raises(SpecdecodeError, match="layer 3 does not exist"):
        backend.capture_hidden([0, 3])


def test_forks_record_only_their_own_passes(zoo):
    """Two backends over one model: each one's rows come from its own forward passes."""
    model = eagle3_target()
    a = zoo.backend(model)
    a.capture_hidden(LAYERS)
    b = a.fork()
    b.capture_hidden(LAYERS)
    plain = a.fork()  # records nothing
    a.evaluate([3, 4, 5, 6])
    b.evaluate([7, 8])
    plain.evaluate([9, 9, 9])
    torch.testing.assert_close(
        normed_last(model, a.hidden_states(0, 4)), reference_features(model, [3, 4, 5, 6])
    )
    torch.testing.assert_close(normed_last(model, b.hidden_states(0, 2)), reference_features(model, [7, 8]))


def test_backends_without_hidden_states_are_refused():
    class Minimal:
        vocab = None
        n_ctx = 8

    with pytest.raises(SpecdecodeError, match="needs the target's hidden states, which Minimal cannot"):
        hidden_state_source(Minimal(), "--spec-type eagle3")


# --------------------------------------------------------------------------- the head


def drafting_states(head, feats: torch.Tensor, ids: list[int], n: int, steps: int) -> list[torch.Tensor]:
    """What drafting computes after the verified prefix ids[:n] + [ids[n]] when the drafted tokens
    are ids[n+1], ids[n+2], ...: the pre-norm state of the seed pair and of each later step."""
    cache = HeadCache()
    g = head.fc(feats[:n])
    h = head.step(ids[1 : n + 1], g, 0, cache)[-1]
    states = [h]
    for j in range(1, steps):
        h = head.step([ids[n + j]], h[None], n + j - 1, cache)[-1]
        states.append(h)
    return states


def test_training_time_test_unrolls_exactly_what_drafting_computes():
    """Unroll step j at position p (the training mask, the shifted own states) equals the j-th
    drafting step after the verified prefix ending at p - j, for every p and j."""
    target = eagle3_target()
    head = new_head(target, HeadShape(4, 2, 48, 100, 4, LAYERS), torch.arange(100) * 3, seed=3)
    ids = np.random.default_rng(0).integers(3, VOCAB_SIZE, 14).tolist()
    with torch.no_grad():
        batch = torch.tensor([ids])
        _, feats = read_target(target, LAYERS, batch)  # [1, T, F]: pairs 0..T-1, all drafting reads here
        unrolled = [h[0] for h in unrolled_states(head, batch[:, 1:], head.fc(feats), 4)]
        for n in range(1, len(ids) - 4):
            states = drafting_states(head, feats[0], ids, n, 4)
            for j, state in enumerate(states):
                torch.testing.assert_close(unrolled[j][n - 1 + j], state, rtol=0, atol=1e-10)


def test_draft_vocabulary_is_the_most_frequent_ids():
    tokens = np.array([5, 5, 5, 9, 9, 2, 7, 7, 7, 7, 1])
    assert draft_vocabulary(tokens, 10, 3).tolist() == [5, 7, 9]
    assert draft_vocabulary(tokens, 10, 4).tolist() == [1, 5, 7, 9]  # tie 1/2: the lower id
    assert draft_vocabulary(tokens, 10, 10).tolist() == list(range(10))


def test_ttt_loss_weights_every_unroll_step():
    """More unroll steps add the later steps' (larger) losses: the loss changes with unroll."""
    target = eagle3_target()
    head = new_head(target, HeadShape(4, 2, 48, 100, 1, LAYERS), torch.arange(100) * 3, seed=3)
    batch = torch.randint(3, VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        one = float(ttt_loss(target, 1)(head, batch))
        three = float(ttt_loss(target, 3)(head, batch))
    assert np.isfinite(one) and np.isfinite(three) and one != three


# --------------------------------------------------------------------------- drafting


def eagle3_pipeline(zoo, head, **kwargs) -> Pipeline:
    return Pipeline(zoo.backend(eagle3_target()), eagle3=head, **kwargs)


def plain(zoo, prompt, sampling, config):
    return Pipeline(zoo.backend(eagle3_target())).generate(prompt, sampling, config)


def check_same(result, expected) -> None:
    assert result.tokens == expected.tokens
    assert result.text == expected.text
    assert result.stats.stop_reason == expected.stats.stop_reason


@pytest.mark.parametrize("p_min", [0.0, 0.75])
@pytest.mark.parametrize("n_max", [1, 2, 5, 16])
def test_greedy_eagle3_equals_plain(zoo, exactness_log, n_max, p_min):
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    prompt = list(range(3, 20))
    expected = plain(zoo, prompt, GREEDY, config)
    pipe = eagle3_pipeline(zoo, eagle3_head(), draft_config=DraftModelConfig(n_max=n_max, p_min=p_min))
    assert pipe.spec_types == ["eagle3"]
    result = pipe.generate(prompt, GREEDY, config)
    check_same(result, expected)
    exactness_log.record("eagle3/greedy", "trained head", result.stats, result.stats.stop_reason)


def test_trained_head_accepts_and_rejects(zoo):
    """Guards the exactness tests against vacuity: the tiny head's drafts are often but not
    always what the target generates, so both the accept and the rollback paths run."""
    config = GenerationConfig(n_predict=60, ignore_eos=True)
    pipe = eagle3_pipeline(zoo, eagle3_head(), draft_config=DraftModelConfig(n_max=6, p_min=0.0))
    totals = pipe.generate(list(range(3, 20)), GREEDY, config).stats.totals
    assert 0.3 * totals.n_drafted < totals.n_accepted < totals.n_drafted
    assert pipe.generate(list(range(40, 50)), GREEDY, config).stats.tokens_per_pass > 1.5


@settings(max_examples=15, **SETTINGS)
@given(
    prompt=st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=30),
    n_predict=st.integers(1, 32),
    n_max=st.integers(1, 8),
    p_min=st.sampled_from([0.0, 0.75]),
    temperature=st.sampled_from([0.0, 0.8]),
    seed=st.integers(0, 2**32 - 1),
    ignore_eos=st.booleans(),
)
def test_eagle3_matches_plain_generation(
    zoo, exactness_log, prompt, n_predict, n_max, p_min, temperature, seed, ignore_eos
):
    """Greedy, and `match` at temperature 0.8 with a seed: the same tokens as plain generation."""
    sampling = SamplingParams(temperature=temperature, seed=seed)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=ignore_eos)
    expected = plain(zoo, prompt, sampling, config)
    pipe = eagle3_pipeline(zoo, eagle3_head(), draft_config=DraftModelConfig(n_max=n_max, p_min=p_min))
    result = pipe.generate(prompt, sampling, config)
    check_same(result, expected)
    exactness_log.record(f"eagle3/{'greedy' if temperature == 0 else 'match'}", "trained head", result.stats)


def test_cache_is_reused_across_generations_and_rolled_back(zoo):
    """A second generation sharing a prefix with the first, and one diverging early, give plain
    generation's tokens with the same pipeline (head cache and target feature rows re-used)."""
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    pipe = eagle3_pipeline(zoo, eagle3_head(), draft_config=DraftModelConfig(n_max=4, p_min=0.0))
    for prompt in ([5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 40], [5, 6, 40]):
        check_same(pipe.generate(prompt, GREEDY, config), plain(zoo, prompt, GREEDY, config))


def test_reused_head_cache_drafts_what_a_fresh_head_drafts(zoo):
    """KV bookkeeping: every draft of a generation (head cache carried over steps, rolled back
    after rejections) equals the draft of a fresh strategy that processes the whole context."""
    from specdecode.strategies.eagle3 import Eagle3Strategy

    head, config = eagle3_head(), DraftModelConfig(n_max=5, p_min=0.0)
    pipe = eagle3_pipeline(zoo, head, draft_config=config)
    run = pipe.stream(list(range(3, 15)), GREEDY, GenerationConfig(n_predict=40, ignore_eos=True))
    calls = []
    iterator = iter(run)
    next(iterator)
    strategy = run.chain.strategies[0]
    original = strategy.draft

    def recording(history, last, n_max):
        draft = original(history, last, n_max)
        calls.append((list(history), last, n_max, draft.tokens))
        return draft

    strategy.draft = recording
    for _ in iterator:
        pass
    assert len(calls) > 5 and run.stats.totals.n_accepted < run.stats.totals.n_drafted
    for history, last, n_max, tokens in calls:
        fresh_target = zoo.backend(eagle3_target())
        fresh = Eagle3Strategy(head, fresh_target, config)
        fresh_target.evaluate(history)
        assert fresh.draft(history, last, n_max).tokens == tokens


@pytest.mark.parametrize(
    "types", [["ngram-simple", "eagle3"], ["draft", "eagle3"], ["ngram-simple", "draft", "eagle3"]]
)
def test_eagle3_in_chains_is_exact(zoo, exactness_log, types):
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    config = GenerationConfig(n_predict=48, ignore_eos=True)
    expected = plain(zoo, prompt, GREEDY, config)
    target = zoo.backend(eagle3_target())
    draft = zoo.backend(perturbed_copy(eagle3_target(), 1.0))
    pipe = Pipeline(
        target,
        draft if "draft" in types else None,
        eagle3=eagle3_head(),
        spec_types=types,
        draft_config=DraftModelConfig(n_max=5, p_min=0.75),
        ngram=NgramSettings(simple=NgramMapConfig(size_n=2, size_m=3)),
    )
    result = pipe.generate(prompt, GREEDY, config)
    assert result.tokens == expected.tokens
    by_name = {s.name: s for s in result.stats.strategies}
    assert by_name["eagle3"].n_gen_drafts > 0
    assert sum(s.n_gen_drafts for s in result.stats.strategies if s.name != "eagle3") > 0
    exactness_log.record("eagle3/chain", ",".join(types), result.stats)


def test_rejection_drafts_by_sampling_and_reports_probabilities(zoo):
    """verify="rejection" at temperature > 0: the head samples its drafts and returns [K, V]
    distributions that are zero outside the draft vocabulary."""
    head = eagle3_head()
    pipe = eagle3_pipeline(zoo, head, draft_config=DraftModelConfig(n_max=4, p_min=0.0))
    sampling = SamplingParams(temperature=1.0, seed=3)
    run = pipe.stream([5, 6, 7, 8], sampling, GenerationConfig(n_predict=4, verify="rejection"))
    iterator = iter(run)
    next(iterator)  # the first token: prompt evaluated, chain begun
    strategy = run.chain.strategies[0]
    draft = strategy.draft(run.target.tokens, run.tokens[-1], 4)
    assert draft.probs is not None and draft.probs.shape == (len(draft.tokens), VOCAB_SIZE)
    outside = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    outside[head.d2t] = False
    assert float(draft.probs[:, outside].abs().sum()) == 0.0
    torch.testing.assert_close(draft.probs.sum(1), torch.ones(len(draft.tokens), dtype=torch.float64))
    assert all(float(draft.probs[i, t]) > 0 for i, t in enumerate(draft.tokens))


def test_pipeline_refuses_eagle3_without_a_head(zoo):
    with pytest.raises(SpecdecodeError, match="needs an EAGLE-3 head"):
        Pipeline(zoo.backend(eagle3_target()), spec_types=["eagle3"])


# --------------------------------------------------------------------------- files


@pytest.fixture
def head_dir(tmp_path):
    """A trained head saved in the published layout (bf16)."""
    return save_head(eagle3_head(), tmp_path / "head")


def test_saved_layout_is_the_published_one(head_dir):
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert config["draft_vocab_size"] == 200 and config["vocab_size"] == VOCAB_SIZE
    tensors = load_file(head_dir / "model.safetensors")
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(
        tensors
    )
    assert "embed_tokens.weight" not in tensors  # shared with the target
    assert tensors["fc.weight"].dtype == torch.bfloat16
    ids = torch.arange(200) + tensors["d2t"]  # offsets on disk
    assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), ids)


def test_loaded_head_drafts_like_the_saved_one(zoo, head_dir):
    target = zoo.backend(eagle3_target())
    loaded = load_head(head_dir, target)
    assert loaded.fc.weight.dtype == torch.float64  # the target's
    original = eagle3_head()
    torch.testing.assert_close(loaded.fc.weight, original.fc.weight.to(torch.bfloat16).double())
    assert torch.equal(loaded.d2t, original.d2t)
    config = GenerationConfig(n_predict=30, ignore_eos=True)
    result = Pipeline(target, eagle3=loaded).generate(list(range(3, 20)), GREEDY, config)
    check_same(result, plain(zoo, list(range(3, 20)), GREEDY, config))
    assert result.stats.totals.n_accepted > 0


def rewrite(head_dir, config_changes=None, drop=(), change=None):
    if config_changes:
        path = head_dir / "config.json"
        config = json.loads(path.read_text())
        for key, value in config_changes.items():
            if isinstance(value, dict):
                config[key] = {**config.get(key, {}), **value}
            else:
                config[key] = value
        path.write_text(json.dumps(config))
    tensors = load_file(head_dir / "model.safetensors")
    for name in drop:
        del tensors[name]
    for name, value in (change or {}).items():
        tensors[name] = value
    save_file(tensors, head_dir / "model.safetensors")
    return head_dir


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"config_changes": {"target_hidden_size": 48}}, "hidden size 48, the target's is 32"),
        (
            {"config_changes": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}}},
            "layers 0..4",
        ),
        (
            {"config_changes": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2]}}},
            "fc.weight has shape",
        ),
        ({"config_changes": {"vocab_size": 400}}, "vocabulary has 400 ids, the target's 320"),
        (
            {"drop": ["midlayer.hidden_norm.weight", "d2t"]},
            "missing from model.safetensors: d2t, midlayer.hidden_norm",
        ),
        ({"change": {"d2t": torch.full((200,), 500)}}, "outside the target's vocabulary"),
        ({"change": {"lm_head.weight": torch.zeros(100, 32)}}, r"lm_head.weight has shape \(100, 32\)"),
        ({"config_changes": {"hidden_size": None}}, "config.json lacks"),
    ],
)
def test_heads_that_do_not_fit_the_target_are_refused(zoo, head_dir, edit, message):
    rewrite(head_dir, **edit)
    with pytest.raises(SpecdecodeError, match=message):
        load_head(head_dir, zoo.backend(eagle3_target()))


def test_unreadable_or_absent_heads_are_refused(zoo, tmp_path, head_dir):
    target = zoo.backend(eagle3_target())
    with pytest.raises(SpecdecodeError, match=r"expected a directory with config\.json"):
        load_head(tmp_path / "nothing", target)
    (head_dir / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpecdecodeError, match="cannot read it"):
        load_head(head_dir, target)


def test_a_head_for_another_target_is_refused(zoo, head_dir):
    other = zoo.backend(target_model(TargetSpec(seed=0, hidden=16, layers=4)))
    with pytest.raises(SpecdecodeError, match="hidden size 32, the target's is 16"):
        load_head(head_dir, other)


def test_default_layer_ids_and_own_embeddings(zoo, tmp_path):
    """A head naming no layers reads [2, L // 2, L - 3]; one with embed_tokens uses its own."""
    spec8 = TargetSpec(seed=4, hidden=16, layers=8)
    target = zoo.backend(target_model(spec8))
    head = new_head(target_model(spec8), HeadShape(4, 2, 32, VOCAB_SIZE, 1), torch.arange(VOCAB_SIZE), 0)
    directory = save_head(head, tmp_path / "h")
    embeddings = torch.randn(VOCAB_SIZE, 16, dtype=torch.float64)
    config = json.loads((directory / "config.json").read_text())
    del config["eagle_config"]
    (directory / "config.json").write_text(json.dumps(config))
    rewrite(directory, change={"embed_tokens.weight": embeddings}, drop=["d2t", "t2d"])
    loaded = load_head(directory, target)
    assert loaded.config.target_layer_ids == (2, 4, 5)
    assert not loaded.shares_embeddings
    torch.testing.assert_close(loaded.embed_tokens.weight, embeddings)


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trainable(tmp_path_factory):
    """A saved float64 target and a token corpus of its own generations."""
    root = tmp_path_factory.mktemp("eagle3-train")
    target_dir = save_model(root / "target", eagle3_target(), cached_tokenizer())
    return target_dir, eagle3_corpus()


TINY_SHAPE = HeadShape(heads=4, kv_heads=2, intermediate=48, draft_vocab=150, unroll=3, layer_ids=LAYERS)


def tiny_config(steps: int) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        batch_size=4,
        seq_len=24,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=2,
        device="cpu",
        checkpoint_every=4,
        precision="fp32",
    )


def test_training_lowers_the_loss_writes_a_head_and_resumes(zoo, trainable, tmp_path, monkeypatch):
    target_dir, tokens = trainable
    out = train_eagle3(tokens, target_dir, tmp_path / "a", TINY_SHAPE, tiny_config(12), progress=False)
    log = json.loads((out / "train_log.json").read_text())
    losses = log["losses"]
    assert len(losses) == 12 and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    # it loads for the (float64) target and drafts, losslessly (at p_min 0: after 12 steps the head
    # agrees with the target at 5% of positions, and calibrated it is never confident enough for 0.75)
    target = zoo.backend(eagle3_target())
    head = load_head(out, target)
    assert head.config.draft_vocab_size == 150
    config = GenerationConfig(n_predict=20, ignore_eos=True)
    pipe = Pipeline(target, eagle3=head, draft_config=DraftModelConfig(p_min=0.0))
    result = pipe.generate([5, 6, 7], GREEDY, config)
    check_same(result, plain(zoo, [5, 6, 7], GREEDY, config))
    assert result.stats.totals.n_drafted > 0
    # interrupted at step 10 (after the checkpoint of step 8) and resumed: the same weights
    real = lm._batch_for_step

    def interrupt_at_step_10(tokens, config, step):
        if step == 10:
            raise KeyboardInterrupt
        return real(tokens, config, step)

    monkeypatch.setattr(lm, "_batch_for_step", interrupt_at_step_10)
    with pytest.raises(KeyboardInterrupt):
        train_eagle3(tokens, target_dir, tmp_path / "b", TINY_SHAPE, tiny_config(12), progress=False)
    monkeypatch.setattr(lm, "_batch_for_step", real)
    resumed = train_eagle3(tokens, target_dir, tmp_path / "b", TINY_SHAPE, tiny_config(12), progress=False)
    resumed_log = json.loads((resumed / "train_log.json").read_text())
    assert resumed_log["resumed_from"] == 8 and resumed_log["losses"] == losses
    weights, expected = load_file(resumed / "model.safetensors"), load_file(out / "model.safetensors")
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name
    # a different shape does not resume a run it did not make
    other = HeadShape(heads=2, kv_heads=1, intermediate=48, draft_vocab=150, unroll=3, layer_ids=LAYERS)
    with pytest.raises(SpecdecodeError, match="different run"):
        train_eagle3(tokens, target_dir, tmp_path / "b", other, tiny_config(16), progress=False)


def windows_of(stream: np.ndarray, length: int) -> set[tuple[int, ...]]:
    return {tuple(row) for row in np.lib.stride_tricks.sliding_window_view(stream, length).tolist()}


def test_self_distillation_trains_on_the_targets_greedy_continuations(trainable, tmp_path, monkeypatch):
    target_dir, tokens = trainable
    target = eagle3_target()
    out = tmp_path / "head"
    batches = []
    real = lm._batch_for_step

    def record(tokens, config, step):
        batches.append(real(tokens, config, step))
        return batches[-1]

    monkeypatch.setattr(lm, "_batch_for_step", record)
    train_eagle3(tokens, target_dir, out, TINY_SHAPE, tiny_config(4), progress=False, generated_tokens=400)
    sequences = np.load(out / GENERATED_FILE)
    assert sequences.shape == (3, PREFIX_TOKENS + NEW_TOKENS)  # ceil(400 / 192) sequences
    # each is a cut of the corpus, then what the target chooses greedily after every prefix of it
    corpus_prefixes = windows_of(tokens, PREFIX_TOKENS)
    assert all(tuple(row[:PREFIX_TOKENS].tolist()) in corpus_prefixes for row in sequences)
    with torch.no_grad():
        greedy = target(input_ids=torch.from_numpy(sequences.astype(np.int64))).logits.argmax(-1)
    continuations = torch.from_numpy(sequences[:, PREFIX_TOKENS:]).long()
    assert torch.equal(greedy[:, PREFIX_TOKENS - 1 : -1], continuations)
    # training read windows of the generated sequences, not of the corpus
    generated = windows_of(sequences.reshape(-1), tiny_config(4).seq_len + 1)
    assert len(batches) == 4 and all(tuple(row) in generated for batch in batches for row in batch.tolist())
    head = load_head(out, HFBackend.load(target_dir))
    assert torch.equal(head.d2t, draft_vocabulary(sequences.reshape(-1), VOCAB_SIZE, TINY_SHAPE.draft_vocab))
    # seeded: the same sequences again, others under another seed; kept, so not generated again
    assert np.array_equal(generate_sequences(target, tokens, 400, seed=0, progress=False), sequences)
    assert not np.array_equal(generate_sequences(target, tokens, 400, seed=1, progress=False), sequences)

    def refuse(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(eagle3_train, "generate_sequences", refuse)
    train_eagle3(tokens, target_dir, out, TINY_SHAPE, tiny_config(6), progress=False, generated_tokens=400)
    assert json.loads((out / "train_log.json").read_text())["resumed_from"] == 4
    with pytest.raises(SpecdecodeError, match="use another output directory"):  # 3 sequences, not 4
        train_eagle3(tokens, target_dir, out, TINY_SHAPE, tiny_config(6), generated_tokens=600)


def test_negative_generated_token_counts_are_refused(trainable, tmp_path):
    target_dir, tokens = trainable
    with pytest.raises(SpecdecodeError, match="generated_tokens must be >= 0"):
        train_eagle3(tokens, target_dir, tmp_path, TINY_SHAPE, tiny_config(4), generated_tokens=-1)


# --------------------------------------------------------------------------- calibration


def first_drafts(zoo, head, contexts: list[list[int]], n_max: int) -> list[list[int]]:
    """The greedy draft (p_min 0) after each context, from a fresh target and strategy."""
    drafts = []
    for ids in contexts:
        target = zoo.backend(eagle3_target())
        strategy = Eagle3Strategy(head, target, DraftModelConfig(n_max=n_max, p_min=0.0))
        target.evaluate(ids[:-1])
        drafts.append(strategy.draft(ids[:-1], ids[-1], n_max).tokens)
    return drafts


def test_calibration_scales_the_logits_and_keeps_every_greedy_draft(zoo):
    """The test head is nearly calibrated already (β about 1.04): made four times less confident,
    it is scaled back up."""
    head = copy.deepcopy(eagle3_head())
    apply_scale(head, 0.25)
    tokens = eagle3_corpus()
    contexts = [tokens[start : start + 12].tolist() for start in range(0, 800, 50)]
    drafts = first_drafts(zoo, head, contexts, 5)
    states = torch.randn(30, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits = head.logits(states)
    record = calibrate_head(eagle3_target(), head, tokens, n_windows=4, seq_len=24, unroll=3, seed=0)
    assert 3 < record["scale"] < 5.5
    torch.testing.assert_close(head.logits(states), record["scale"] * logits)
    assert first_drafts(zoo, head, contexts, 5) == drafts
    assert [step["positions"] for step in record["steps"]] == [4 * 24, 4 * 23, 4 * 22]
    assert record["positions"] == 4 * (24 + 23 + 22)
    # maximum likelihood pulls the mean confidence towards the observed agreement rate
    before = abs(record["mean_confidence_before"] - record["agreement"])
    assert abs(record["mean_confidence_after"] - record["agreement"]) < before


def test_step_0_events_are_the_first_drafts_against_the_target(zoo):
    """Pair p of a window is the seed of a draft after the window's first p + 2 tokens: its event
    is whether that draft's first token is the target's greedy next token, and its top logit is
    the draft's."""
    head, target = eagle3_head(), eagle3_target()
    window = torch.from_numpy(eagle3_corpus()[:21].astype(np.int64))
    top, agree, steps = agreement_sample(target, head, window[None], unroll=1)
    assert len(agree) == 20 and not steps.any()
    contexts = [window[: p + 2].tolist() for p in range(20)]
    with torch.no_grad():
        greedy = target(input_ids=window[None]).logits[0, 1:].argmax(-1).tolist()  # after tokens 0..p+1
    drafts = first_drafts(zoo, head, contexts, 1)
    assert agree.tolist() == [draft == [choice] for draft, choice in zip(drafts, greedy, strict=True)]
    assert 0 < agree.sum() < len(agree)
    assert top.shape == (20, 10) and torch.all(top[:, :-1] >= top[:, 1:])


def test_train_eagle3_calibrates_and_records_it(trainable, tmp_path):
    target_dir, tokens = trainable
    config = replace(tiny_config(4), calibration_windows=3)
    out = train_eagle3(tokens, target_dir, tmp_path / "a", TINY_SHAPE, config, progress=False)
    calibration = json.loads((out / "train_log.json").read_text())["calibration"]
    assert calibration["scale"] > 0 and len(calibration["steps"]) == TINY_SHAPE.unroll
    assert calibration["positions"] == 3 * (24 + 23 + 22)
    assert {"agreement", "mean_confidence_before", "mean_confidence_after"} <= set(calibration)
    plain_run = train_eagle3(
        tokens, target_dir, tmp_path / "b", TINY_SHAPE, replace(config, calibration_windows=0), progress=False
    )
    assert "calibration" not in json.loads((plain_run / "train_log.json").read_text())
    # the same training, so only the final norm differs, by the fitted scale (bf16 on disk)
    assert_only_norm_scaled(out, plain_run, calibration["scale"])


# --------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """The target saved as a Hugging Face directory, with a trained head beside it."""
    root = tmp_path_factory.mktemp("eagle3-cli")
    target = save_model(root / "target", eagle3_target(), cached_tokenizer())
    return target, save_head(eagle3_head(), root / "head")


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_me_enables_eagle3_and_output_is_plain_output(saved_pair, capsys, fixed_costs):
    """-me alone runs the head under the default (adaptive) policy, priced by fixed costs:
    timed on a busy machine, a draft step of these tiny models can cost what a target pass
    does, and the policy would rightly draft nothing."""
    target, head = saved_pair
    common = ["generate", "-m", str(target), "-p", "def f(x):", "-n", "24", "--temp", "0", "--json"]
    expected = run_json(capsys, [*common, "--spec-type", "none"])
    result = run_json(capsys, [*common, "-me", str(head)])
    assert [s["name"] for s in result["stats"]["strategies"]] == ["eagle3"]
    assert result["tokens"] == expected["tokens"]
    assert result["stats"]["totals"]["n_drafted"] > 0
    chained = run_json(capsys, [*common, "-me", str(head), "--spec-type", "ngram-simple,eagle3"])
    assert [s["name"] for s in chained["stats"]["strategies"]] == ["ngram-simple", "eagle3"]
    assert chained["tokens"] == expected["tokens"]


def test_tree_topk_is_taken_with_a_head_and_refused_without(saved_pair, capsys):
    """--draft-tree-topk, given (even at its default), needs an EAGLE-3 head to shape."""
    target, head = saved_pair
    argv = ["generate", "-m", str(target), "-p", "x", "-n", "2", "--temp", "0", "--draft-tree-topk", "4"]
    assert main([*argv, "-me", str(head)]) == 0
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("error: --draft-tree-topk 4 shapes an EAGLE-3 head's trees")


def test_eagle3_without_a_head_or_with_a_bad_one_is_one_error_line(saved_pair, tmp_path, capsys):
    target, _ = saved_pair
    argv = ["generate", "-m", str(target), "-p", "x", "-n", "2", "--spec-type", "eagle3"]
    assert main(argv) == 2
    assert "needs an EAGLE-3 head: eagle3= (-me DIR)" in capsys.readouterr().err
    assert main([*argv, "-me", str(tmp_path)]) == 2
    *phases, error = capsys.readouterr().err.splitlines()
    assert error.startswith("error: EAGLE-3 head") and "config.json" in error
    assert all(line.startswith("specdecode: ") for line in phases)  # the start-up phases before it


def test_train_eagle3_command_writes_a_loadable_head(saved_pair, tmp_path, capsys):
    target, _ = saved_pair
    data = tmp_path / "data.py"
    data.write_text(inspect.getsource(textwrap) * 2)
    out = tmp_path / "head"
    argv = ["train", "eagle3", "--target", str(target), "--out", str(out), "--data", str(data)]
    argv += ["--layer-ids", "0,2,4", "--heads", "4", "--kv-heads", "2", "--intermediate", "32"]
    argv += ["--draft-vocab", "100", "--unroll", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "16"]
    argv += ["--precision", "fp32", "--device", "cpu", "--warmup-steps", "1"]
    assert main(argv) == 0
    assert "EAGLE-3 head ->" in capsys.readouterr().err
    head = load_head(out, HFBackend.load(target))
    assert head.config.target_layer_ids == (0, 2, 4) and head.config.draft_vocab_size == 100
    assert main([*argv[:-2], "--layer-ids", "0,x"]) == 2
    capsys.readouterr()
    assert main([*argv, "--generated-tokens", "-5"]) == 2
    assert capsys.readouterr().err.startswith("error: generated_tokens must be >= 0")


def test_calibrate_only_rescales_a_saved_head_in_place(saved_pair, tmp_path, capsys):
    target, head = saved_pair
    out = shutil.copytree(head, tmp_path / "head")
    data = tmp_path / "data.py"
    data.write_text(inspect.getsource(textwrap) * 2)
    argv = ["train", "eagle3", "--calibrate-only", "--target", str(target), "--out", str(out)]
    argv += ["--data", str(data), "--calibration-windows", "3", "--seq-len", "16", "--unroll", "2"]
    record = run_json(capsys, [*argv, "--device", "cpu"])
    assert [step["positions"] for step in record["steps"]] == [3 * 16, 3 * 15]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no corpus cache
    assert (out / "config.json").read_text() == (head / "config.json").read_text()
    assert_only_norm_scaled(out, head, record["scale"])


def test_calibrate_only_refuses_a_missing_head_before_reading_a_corpus(saved_pair, tmp_path, capsys):
    target, head = saved_pair

    def corpus(tokenizer):
        raise AssertionError("the corpus is read only for a head that loads")

    with pytest.raises(
        SpecdecodeError, match=r"EAGLE-3 head .*nothing: expected a directory with config\.json"
    ):
        calibrate_saved_head(target, tmp_path / "nothing", corpus, 2, tiny_config(1))
    argv = ["train", "eagle3", "--calibrate-only", "--target", str(target), "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: EAGLE-3 head") and "config.json" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "nothing").exists()
    assert main([*argv, "--out", str(head), "--calibration-windows", "0"]) == 2
    assert "calibration_windows >= 1" in capsys.readouterr().err


def test_bench_lists_eagle3_systems_with_a_head(saved_pair, tmp_path):
    target, head = saved_pair
    out = tmp_path / "bench"
    argv = ["bench", "-m", str(target), "-me", str(head), "-n", "8", "--no-hf"]
    argv += ["--prompts-per-task", "1", "--runs", "1", "--sweep", "0"]  # every system, once
    argv += ["--tasks", "completion", "--out", str(out), "--no-plots"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert {"eagle3", "ngram-simple,eagle3"} <= set(results["systems"])
    assert "draft" not in results["systems"]
    for row in results["rows"]:
        assert row["exact_match_rate"] == 1.0, row


def assert_only_norm_scaled(calibrated_dir: Path, original_dir: Path, scale: float) -> None:
    """The calibrated head's file equals the original's but for norm.weight, scaled by `scale`
    (to bf16 precision)."""
    calibrated = load_file(calibrated_dir / "model.safetensors")
    original = load_file(original_dir / "model.safetensors")
    for name, value in original.items():
        if name != "norm.weight":
            assert torch.equal(calibrated[name], value), name
    torch.testing.assert_close(
        calibrated["norm.weight"].double(), scale * original["norm.weight"].double(), rtol=2**-7, atol=0
    )
