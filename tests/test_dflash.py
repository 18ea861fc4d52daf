"""DFlash: the drafter's files, one-pass block drafting (chains and trees), exactness, the command.

The target is conftest's 4-layer float64 Llama; drafters read the inputs of its layers 1 and 3.
`dflash_head()` is trained for a few seconds (it agrees with the target now and then), random
drafters (`random_head`) test the plumbing where acceptance does not matter.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import (
    DFLASH_LAYERS,
    VOCAB_SIZE,
    cached_tokenizer,
    chi_square_pvalue,
    cpu_policy,
    dflash_head,
    eagle3_corpus,
    eagle3_target,
)
from safetensors.torch import load_file, save_file

from specdecode import (
    ConstraintSpec,
    DraftModelConfig,
    GenerationConfig,
    HFBackend,
    Pipeline,
    Sampler,
    SamplingParams,
)
from specdecode.backends.native import NativeBackend
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.sampling import distribution
from specdecode.strategies.dflash import DFlashStrategy
from specdecode.strategies.dflash_checkpoint import load_head, save_head
from specdecode.strategies.dflash_head import ContextCache, DFlashConfig, DFlashHead
from specdecode.testing import save_model
from specdecode.verdicts import _configured
from specdecode.verify import verify_rejection

GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=11)
TEMP1 = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
MASK = VOCAB_SIZE - 1
ALPHA = 0.001


def random_head(seed: int = 0, block_size: int = 5, layer_ids=DFLASH_LAYERS, layers: int = 2) -> DFlashHead:
    model = eagle3_target()
    config = DFlashConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        target_layer_ids=tuple(layer_ids),
        block_size=block_size,
        mask_token_id=MASK,
        vocab_size=VOCAB_SIZE,
        head_dim=8,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = DFlashHead(config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return head.double().eval().requires_grad_(False)


def contexts(count: int = 3, length: int = 14) -> list[list[int]]:
    """Windows of the target's own generations, where the trained drafter is sometimes right."""
    tokens = eagle3_corpus()
    return [tokens[start : start + length].tolist() for start in range(0, 200 * count, 200)]


def strategy_after(
    zoo, ids: list[int], config: DraftModelConfig, head=None, sampler: Sampler | None = None
) -> DFlashStrategy:
    """A fresh strategy whose target has evaluated ids[:-1] (ids[-1] is `last`)."""
    target = zoo.backend(eagle3_target())
    strategy = DFlashStrategy(head if head is not None else dflash_head(), target, config, sampler)
    target.evaluate(ids[:-1])
    return strategy


def block_after(strategy: DFlashStrategy, ids: list[int]) -> torch.Tensor:
    """The block's logits after ids, computed from scratch."""
    cache = ContextCache(strategy.head.config.num_hidden_layers)
    with torch.inference_mode():
        strategy.head.extend_context(strategy.target.hidden_states(0, len(ids) - 1), cache)
        return strategy.head.block(ids[-1], cache)


# --------------------------------------------------------------------------- drafting


def test_a_draft_is_one_block_pass_whatever_its_length(zoo):
    """Context rows are projected once per position; the block runs each layer once per draft,
    for one token or for B - 1."""
    ids = contexts(1)[0]
    calls = []
    for n_max in (1, 2, 4):
        strategy = strategy_after(zoo, ids, DraftModelConfig(n_max=n_max, p_min=0.0))
        hook = strategy.head.layers[0].register_forward_hook(lambda *args: calls.append(1))
        try:
            draft = strategy.draft(ids[:-1], ids[-1], 16)
        finally:
            hook.remove()
        assert len(draft.tokens) == n_max and len(calls) == 1
        calls.clear()


def test_chains_are_the_blocks_argmax_within_n_max_and_the_block(zoo):
    for ids in contexts():
        strategy = strategy_after(zoo, ids, DraftModelConfig(n_max=16, p_min=0.0))
        block = block_after(strategy, ids)
        assert block.shape == (4, VOCAB_SIZE)
        draft = strategy.draft(ids[:-1], ids[-1], 16)
        assert draft.tokens == block.argmax(-1).tolist()  # min(n_max, B - 1) = 4
        assert strategy.draft(ids[:-1], ids[-1], 2).tokens == draft.tokens[:2]
        assert draft.probs is None and len(draft.confidences) == 4


def test_p_min_cuts_and_n_min_drops(zoo):
    ids = contexts(1)[0]
    strategy = strategy_after(zoo, ids, DraftModelConfig(n_max=4, p_min=0.0))
    full = strategy.draft(ids[:-1], ids[-1], 4)
    cut = min(full.confidences[1:]) + 1e-9  # some later token falls below it
    kept = next(i for i, c in enumerate(full.confidences) if c < cut)
    strategy.config = DraftModelConfig(n_max=4, p_min=cut)
    assert strategy.draft(ids[:-1], ids[-1], 4).tokens == full.tokens[:kept]
    strategy.config, strategy.n_min = DraftModelConfig(n_max=4, p_min=cut, n_min=kept + 1), kept + 1
    assert strategy.draft(ids[:-1], ids[-1], 4).tokens == []


def test_the_context_is_kept_by_common_prefix_and_drafts_as_a_fresh_one(zoo):
    """After a rollback to a shorter shared prefix and new tokens, only the new positions are
    added, and the block is the one a drafter that read everything from scratch computes."""
    ids = contexts(1)[0]
    config = DraftModelConfig(n_max=4, p_min=0.0)
    target = zoo.backend(eagle3_target())
    strategy = DFlashStrategy(dflash_head(), target, config)
    target.evaluate(ids[:-1])
    strategy.draft(ids[:-1], ids[-1], 4)
    assert strategy.cache.n == len(ids) - 1
    other = [*ids[:8], 7, 9, 11]
    target.truncate(8)
    target.evaluate(other[8:-1])
    added = []
    extend = strategy.head.extend_context
    strategy.head.extend_context = lambda features, cache: (
        added.append(len(features)),
        extend(features, cache),
    )
    try:
        draft = strategy.draft(other[:-1], other[-1], 4)
    finally:
        del strategy.head.extend_context
    assert added == [len(other) - 1 - 8]
    fresh = strategy_after(zoo, other, config)
    assert draft.tokens == fresh.draft(other[:-1], other[-1], 4).tokens
    with torch.inference_mode():
        kept = strategy.head.block(other[-1], strategy.cache)  # over the rows kept and added
    torch.testing.assert_close(kept, block_after(fresh, other), rtol=0, atol=1e-12)


def tree_paths(draft) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for token, parent in zip(draft.tokens, draft.parents, strict=True):
        out.append((*(out[parent] if parent >= 0 else ()), token))
    return out


def reference_tree(log_probs: torch.Tensor, budget: int, topk: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2's expansion over the block's rows by brute force: path -> log score of the kept
    nodes (children of any node at depth d - 1 are the top-k of row d - 1)."""
    scores: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[int, ...]] = [()]
    depth_max = log_probs.shape[0]
    for depth in range(1, depth_max + 1):
        top = torch.topk(log_probs[depth - 1], topk)
        level = {
            (*parent, token): scores.get(parent, 0.0) + value
            for parent in frontier
            for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        }
        scores.update(level)
        floor = sorted(scores.values(), reverse=True)[budget - 1] if len(scores) >= budget else -float("inf")
        frontier = [
            path for path in sorted(level, key=level.__getitem__, reverse=True)[:topk] if level[path] > floor
        ]
    kept = sorted(scores, key=lambda path: (-scores[path], len(path)))[:budget]
    return {path: scores[path] for path in kept}


@pytest.mark.parametrize(("tree_tokens", "topk"), [(6, 2), (10, 3), (3, 4)])
def test_trees_are_eagle2_expansions_over_the_blocks_rows(zoo, tree_tokens, topk):
    """A node at depth d takes its children from block row d - 1 whatever its path; the nodes
    kept are the best by the product of probabilities along their path, best first."""
    for ids in contexts():
        config = DraftModelConfig(n_max=4, p_min=0.0, tree_tokens=tree_tokens, tree_topk=topk)
        strategy = strategy_after(zoo, ids, config)
        log_probs = torch.log_softmax(block_after(strategy, ids).double(), -1)
        draft = strategy.draft(ids[:-1], ids[-1], 4)
        expected = reference_tree(log_probs, tree_tokens, topk)
        paths = tree_paths(draft)
        assert set(paths) == set(expected)
        scores = [expected[path] for path in paths]
        assert scores == sorted(scores, reverse=True)
        for got, path in zip(draft.confidences, paths, strict=True):
            rank = torch.topk(log_probs[len(path) - 1], topk).indices.tolist().index(path[-1])
            assert got == pytest.approx(float(torch.topk(log_probs[len(path) - 1], topk).values[rank].exp()))


def test_tree_of_one_child_per_node_is_the_chain(zoo):
    ids = contexts(1)[0]
    chain = strategy_after(zoo, ids, DraftModelConfig(n_max=4, p_min=0.0)).draft(ids[:-1], ids[-1], 4)
    tree_config = DraftModelConfig(n_max=4, p_min=0.0, tree_tokens=4, tree_topk=1)
    tree = strategy_after(zoo, ids, tree_config).draft(ids[:-1], ids[-1], 4)
    assert tree.tokens == chain.tokens and tree.parents == [-1, 0, 1, 2]


def test_rejection_drafts_sample_each_position_from_its_own_row(zoo):
    ids = contexts(1)[0]
    sampler = Sampler(replace(TEMP1, seed=3))
    strategy = strategy_after(zoo, ids, DraftModelConfig(n_max=4, p_min=0.0), sampler=sampler)
    block = block_after(strategy, ids)
    draft = strategy.draft(ids[:-1], ids[-1], 4)
    assert draft.probs.shape == (4, VOCAB_SIZE)
    for i, token in enumerate(draft.tokens):
        expected = distribution(block[i], TEMP1, [*ids, *draft.tokens[:i]])
        torch.testing.assert_close(draft.probs[i], expected, rtol=0, atol=1e-12)
        assert float(draft.probs[i, token]) > 0


def test_a_drafter_for_another_vocabulary_is_refused(zoo):
    head = random_head()
    other = zoo.backend(eagle3_target())
    other_head = DFlashHead(
        replace(head.config, vocab_size=VOCAB_SIZE + 1), head.target_embeddings, head.target_output
    )
    with pytest.raises(SpecdecodeError, match="vocabulary of 321 ids"):
        DFlashStrategy(other_head, other, DraftModelConfig())


def test_verdicts_price_no_draft_longer_than_the_block(zoo):
    """A block of 5 drafts at most 4 tokens, whatever n_max says: what a verdict prices."""
    strategy = DFlashStrategy(
        random_head(block_size=5), zoo.backend(eagle3_target()), DraftModelConfig(n_max=16)
    )
    assert _configured(strategy, 16) == 4
    shorter = DFlashStrategy(
        random_head(block_size=5), zoo.backend(eagle3_target()), DraftModelConfig(n_max=3)
    )
    assert _configured(shorter, 16) == 3


# --------------------------------------------------------------------------- rejection sampling


def first_tokens(zoo, config: DraftModelConfig, n: int, wrong: bool = False) -> tuple[dict, dict]:
    """The tokens emitted by n rejection verifications of drafts against the target's rows after
    a context (the same rows whatever was drafted: a target whose distribution at each position
    is fixed), by position, and those rows' distributions. wrong: verify against a uniform q
    instead of the rows the drafts were drawn from (for the test's power)."""
    ids = contexts(1)[0]
    strategy = strategy_after(zoo, ids, config, sampler=Sampler(replace(TEMP1, seed=1)))
    with torch.no_grad():
        root = eagle3_target()(input_ids=torch.tensor([ids])).logits[0, -1].double()
        second = eagle3_target()(input_ids=torch.tensor([[*ids, int(root.argmax())]])).logits[0, -1].double()
    rows = torch.stack([root, second, second, second, second])
    verifier = Sampler(replace(TEMP1, seed=2))
    counts: tuple[dict, dict] = ({}, {})
    for _ in range(n):
        draft = strategy.draft(ids[:-1], ids[-1], 2)
        if wrong:
            draft = replace(draft, probs=torch.full_like(draft.probs, 1.0 / VOCAB_SIZE))
        emitted = verify_rejection(draft, rows[: len(draft.tokens) + 1], verifier, ids, frozenset()).emitted
        for position, token in enumerate(emitted[:2]):
            counts[position][token] = counts[position].get(token, 0) + 1
    p = [distribution(row, TEMP1, ids) for row in (root, second)]
    return counts, tuple({t: float(q[t]) for t in range(VOCAB_SIZE)} for q in p)


@pytest.mark.parametrize("tree_tokens", [0, 4])
def test_rejection_keeps_the_targets_distribution(zoo, exactness_log, tree_tokens):
    """Chains (each position drawn from its own row of the one block) and trees (children drawn
    without replacement, scored by rank): the first two emitted tokens follow the target's
    rows, chi-square at alpha 0.001; verified against a q they were not drawn from, the same
    fit fails. (Every node's children are verified against the second row here.)"""
    config = DraftModelConfig(n_max=2, p_min=0.0, tree_tokens=tree_tokens, tree_topk=2)
    counts, expected = first_tokens(zoo, config, 2500)
    for position in (0, 1):
        pvalue = chi_square_pvalue(counts[position], expected[position])
        assert pvalue > ALPHA, (position, pvalue)
    exactness_log.record_distribution(f"dflash {'tree' if tree_tokens else 'chain'}", sum(counts[0].values()))
    wrong, _ = first_tokens(zoo, config, 1250, wrong=True)
    assert chi_square_pvalue(wrong[0], expected[0]) < ALPHA


# --------------------------------------------------------------------------- exactness


def plain(backend_kind, prompt, sampling, config, constraint=None):
    return Pipeline(backend_kind(eagle3_target(), cached_tokenizer())).generate(
        prompt, sampling, config, constraint=constraint
    )


def check_same(result, expected) -> None:
    assert result.tokens == expected.tokens
    assert result.text == expected.text
    assert result.stats.stop_reason == expected.stats.stop_reason


BACKENDS = {"hf": HFBackend, "native": NativeBackend}


@pytest.mark.parametrize("tree_tokens", [0, 6])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("kind", BACKENDS)
def test_dflash_equals_plain(exactness_log, kind, mode, tree_tokens):
    sampling = GREEDY if mode == "greedy" else SEEDED
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    make = BACKENDS[kind]
    accepted = 0
    for prompt in contexts(2, 16):
        expected = plain(make, prompt, sampling, config)
        draft_config = DraftModelConfig(n_max=4, p_min=0.0, tree_tokens=tree_tokens)
        pipe = Pipeline(
            make(eagle3_target(), cached_tokenizer()), dflash=dflash_head(), draft_config=draft_config
        )
        result = pipe.generate(prompt, sampling, config)
        check_same(result, expected)
        assert result.stats.totals.n_drafted > 0
        accepted += result.stats.totals.n_accepted
        shape = "tree" if tree_tokens else "chain"
        exactness_log.record(f"dflash/{mode}", f"trained drafter {shape} {kind}", result.stats)
    if mode == "greedy":
        assert accepted > 0


@pytest.mark.parametrize("tree_tokens", [0, 6])
def test_generate_batch_with_dflash_equals_alone(exactness_log, tree_tokens):
    """Each fork drafts over its own context rows, read from its own sequence's passes."""
    config = GenerationConfig(n_predict=20)
    batch = [list(range(3 + i, 18 + 2 * i)) for i in range(4)]
    draft_config = DraftModelConfig(p_min=0.0, n_max=4, tree_tokens=tree_tokens)

    def make() -> Pipeline:
        target = NativeBackend(eagle3_target(), cached_tokenizer())
        return Pipeline(target, dflash=dflash_head(), draft_config=draft_config)

    for mode, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
        solo = [make().generate(p, sampling, config) for p in batch]
        results = make().generate_batch(batch, sampling, config, max_sequences=3, load_rule=False)
        drafted = 0
        for ours, expected in zip(results, solo, strict=True):
            check_same(ours, expected)
            assert not any(strategy.n_failed for strategy in ours.stats.strategies)
            drafted += ours.stats.totals.n_drafted
            exactness_log.record(f"batch/dflash-{mode}", "native", ours.stats, ours.stats.stop_reason)
        assert drafted > 0


@pytest.mark.parametrize("tree_tokens", [0, 6])
def test_constrained_dflash_equals_plain(exactness_log, tree_tokens):
    """Chains masked position by position after the picks before, trees masked per node."""
    constraint = ConstraintSpec("regex", r"(x = [0-9]{1,3}\n){2,4}")
    sampling = SamplingParams(temperature=0.9, seed=5)
    config = GenerationConfig(n_predict=40)
    expected = plain(HFBackend, "def f(x):", sampling, config, constraint)
    draft_config = DraftModelConfig(p_min=0.0, n_max=4, tree_tokens=tree_tokens)
    pipe = Pipeline(
        HFBackend(eagle3_target(), cached_tokenizer()), dflash=dflash_head(), draft_config=draft_config
    )
    result = pipe.generate("def f(x):", sampling, config, constraint=constraint)
    check_same(result, expected)
    assert result.stats.totals.n_drafted > 0
    exactness_log.record("constrained/dflash", f"{'tree' if tree_tokens else 'chain'}", result.stats)


@pytest.mark.parametrize("tree_tokens", [0, 6])
def test_adaptive_policy_prices_a_block_as_one_pass_and_stays_exact(exactness_log, steady_clock, tree_tokens):
    models = cpu_policy()
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    prompt = contexts(1, 16)[0]
    pipe = Pipeline(
        HFBackend(eagle3_target(), cached_tokenizer()),
        dflash=dflash_head(),
        draft_config=DraftModelConfig(n_max=4, tree_tokens=tree_tokens),
        spec_policy="adaptive",
        policy_models=models,
    )
    result = pipe.generate(prompt, GREEDY, config)
    check_same(result, plain(HFBackend, prompt, GREEDY, config))
    exactness_log.record("dflash/adaptive", "tree" if tree_tokens else "chain", result.stats)
    costs = models.costs
    assert "dflash" in costs.one_pass and costs.step_time("dflash") == 0.0
    assert costs.draft_time("dflash", 4, 0) == costs.draft_time("dflash", 1, 0)
    assert costs.draft_time("draft", 4, 0) > costs.draft_time("draft", 1, 0)
    assert result.stats.totals.n_drafted > 0


# --------------------------------------------------------------------------- files


@pytest.fixture
def drafter_dir(tmp_path):
    return save_head(dflash_head(), tmp_path / "drafter")


def test_saved_layout_is_z_labs(drafter_dir):
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {
        "block_size": 5,
        "mask_token_id": MASK,
        "target_layer_ids": [layer - 1 for layer in DFLASH_LAYERS],  # z-lab's: outputs of layer l
    }
    tensors = load_file(drafter_dir / "model.safetensors")
    layer = {
        f"layers.0.{name}.weight"
        for name in (
            *(f"self_attn.{p}_proj" for p in "qkvo"),
            "self_attn.q_norm",
            "self_attn.k_norm",
            *(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
            "input_layernorm",
            "post_attention_layernorm",
        )
    }
    assert set(tensors) == {"fc.weight", "hidden_norm.weight", "norm.weight", *layer}
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["fc.weight"].shape == (32, 64)


def test_a_loaded_drafter_drafts_like_the_saved_one(zoo, tmp_path):
    original = dflash_head()
    directory = save_head(original, tmp_path / "exact", dtype=torch.float64)
    target = zoo.backend(eagle3_target())
    loaded = load_head(directory, target)
    assert loaded.config == original.config and loaded.dtype == torch.float64
    for name, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert "layer inputs [1, 3]" in loaded.layer_note
    ids = contexts(1)[0]
    a = strategy_after(zoo, ids, DraftModelConfig(), head=original)
    b = strategy_after(zoo, ids, DraftModelConfig(), head=loaded)
    assert torch.equal(block_after(a, ids), block_after(b, ids))


def test_older_files_with_top_level_settings_load(zoo, drafter_dir):
    path = drafter_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(config.pop("dflash_config"))
    path.write_text(json.dumps(config))
    assert load_head(drafter_dir, zoo.backend(eagle3_target())).config.target_layer_ids == DFLASH_LAYERS


def rewrite(directory, config_changes=None, drop=(), change=None):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in (config_changes or {}).items():
        if isinstance(value, dict):
            config[key] = {**config.get(key, {}), **value}
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    tensors = load_file(directory / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors.update(change or {})
    save_file(tensors, directory / "model.safetensors")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"drop": ["layers.0.mlp.up_proj.weight"]}, "missing from model.safetensors: layers.0.mlp.up_proj"),
        (
            {"change": {"norm.weight": torch.ones(16)}},
            r"norm.weight has shape \(16,\), expected \(32,\)",
        ),
        (
            {"config_changes": {"dflash_config": {"target_layer_ids": [0, 4]}}},
            r"outputs of target layers \[0, 4\], but the target has layers 0..3",
        ),
        ({"config_changes": {"dflash_config": {"mask_token_id": 320}}}, "mask_token_id 320 is not in"),
        ({"config_changes": {"architectures": ["DFlash2DraftModel"]}}, "DFlash2DraftModel is not supported"),
        ({"config_changes": {"dflash_config": {"output_multiplier": 0.2}}}, "output_multiplier"),
        (
            {
                "config_changes": {
                    "layer_types": ["sliding_attention"],
                    "is_causal": None,
                    "sliding_window": 8,
                }
            },
            "causally",
        ),
        ({"config_changes": {"hidden_size": 48}}, "hidden size 48, the target's is 32"),
        ({"config_changes": {"num_hidden_layers": None}}, "config.json lacks a usable"),
        ({"change": {"candidate_selector.weight": torch.ones(2)}}, "does not have: candidate_selector"),
        ({"config_changes": {"speculators_model_type": "dflash"}}, "speculators layout .* is not supported"),
        (
            {"config_changes": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}},
            "rope_type 'dynamic'",
        ),
    ],
)
def test_drafters_that_do_not_fit_are_refused(zoo, drafter_dir, edit, message):
    rewrite(drafter_dir, **edit)
    target = zoo.backend(eagle3_target())
    target.evaluate([3, 4, 5])
    with pytest.raises(SpecdecodeError, match=message):
        load_head(drafter_dir, target)
    assert target.tokens == [3, 4, 5]  # nothing changed on the target


def test_absent_or_unreadable_drafters_are_refused(zoo, tmp_path, drafter_dir):
    target = zoo.backend(eagle3_target())
    with pytest.raises(
        SpecdecodeError, match=r"expected a directory with config\.json and model\.safetensors"
    ):
        load_head(tmp_path / "nothing", target)
    (drafter_dir / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpecdecodeError, match=r"cannot read model\.safetensors"):
        load_head(drafter_dir, target)
    saved = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    with pytest.raises(SpecdecodeError, match="DFlash drafter directory not found"):
        Pipeline.load(saved, dflash=tmp_path / "nothing")


def test_speculative_config_method_dflash(tmp_path, drafter_dir):
    target = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    prompt = contexts(1, 16)[0]
    pipe = Pipeline.load(
        target,
        speculative_config={"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": 3},
    )
    assert pipe.spec_types == ["dflash"] and pipe.draft_config.n_max == 3
    result = pipe.generate(prompt, GREEDY, config)
    check_same(result, Pipeline.load(target).generate(prompt, GREEDY, config))
    with pytest.raises(SpecdecodeError, match="needs 'model': the DFlash drafter's directory"):
        Pipeline.load(target, speculative_config={"method": "dflash"})
    with pytest.raises(SpecdecodeError, match="needs a DFlash drafter"):
        Pipeline(HFBackend(eagle3_target(), cached_tokenizer()), spec_types=["draft-dflash"])


# --------------------------------------------------------------------------- command line


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_mdf_enables_dflash_and_output_is_plain_output(tmp_path, drafter_dir, capsys, fixed_costs):
    target = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    common = ["generate", "-m", str(target), "-p", "def f(x):", "-n", "24", "--temp", "0", "--json"]
    expected = run_json(capsys, [*common, "--spec-type", "none"])
    for extra in (["-mdf", str(drafter_dir)], ["--spec-type", "draft-dflash", "-mdf", str(drafter_dir)]):
        result = run_json(capsys, [*common, *extra, "--spec-policy", "classic", "--draft-p-min", "0"])
        assert [s["name"] for s in result["stats"]["strategies"]] == ["dflash"]
        assert result["tokens"] == expected["tokens"]
        assert result["stats"]["totals"]["n_drafted"] > 0
    tree = run_json(capsys, [*common, "-mdf", str(drafter_dir), "--draft-tree-tokens", "6"])
    assert tree["tokens"] == expected["tokens"]
    assert main([*common, "--spec-type", "draft-dflash"]) == 2
    assert "needs a DFlash drafter: dflash= (-mdf DIR)" in capsys.readouterr().err


# --------------------------------------------------------------------------- GGUF targets on llama.cpp


def test_greedy_dflash_on_a_llama_cpp_target_equals_plain(tmp_path, exactness_log, drafter_dir):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from conftest import in_dtype

    from specdecode.backends.gguf_files import export_gguf
    from specdecode.backends.llama_cpp import LlamaCppBackend
    from specdecode.backends.options import LoadOptions

    model = in_dtype(eagle3_target(), torch.float32)
    directory = save_model(tmp_path / "target", model, cached_tokenizer())
    gguf = export_gguf(directory, tmp_path / "target-q8_0.gguf", "q8_0")
    options = LoadOptions(backend="llama.cpp", threads=1, n_ctx=256)
    exact = LlamaCppBackend.load(export_gguf(directory, tmp_path / "target-f32.gguf", "f32"), options)
    assert torch.equal(exact.output_embeddings(), model.lm_head.weight.detach())  # the file's output head
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    prompt = contexts(1, 16)[0]
    expected = Pipeline.load(gguf, target_options=options).generate(prompt, GREEDY, config)
    for tree_tokens in (0, 6):
        pipe = Pipeline.load(
            gguf,
            dflash=drafter_dir,
            target_options=options,
            draft_config=DraftModelConfig(n_max=4, p_min=0.0, tree_tokens=tree_tokens),
        )
        assert pipe.dflash.dtype == torch.float32
        result = pipe.generate(prompt, GREEDY, config)
        check_same(result, expected)
        assert result.stats.totals.n_drafted > 0
        exactness_log.record(
            "dflash/greedy", f"llama.cpp q8_0 {'tree' if tree_tokens else 'chain'}", result.stats
        )
    # a drafter reading the last layer's output, which llama.cpp does not hand out
    rewrite(drafter_dir, {"dflash_config": {"target_layer_ids": [0, 3]}})
    pipe = Pipeline.load(gguf, dflash=drafter_dir, target_options=options)
    with pytest.raises(SpecdecodeError, match=r"not layer ids \[4\] .*--backend native"):
        pipe.generate(prompt, GREEDY, config)


def test_bench_lists_dflash_systems_with_a_drafter(tmp_path, drafter_dir):
    target = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    out = tmp_path / "bench"
    argv = ["bench", "-m", str(target), "-mdf", str(drafter_dir), "-n", "8", "--no-hf"]
    argv += ["--prompts-per-task", "1", "--runs", "1", "--sweep", "0", "--systems", "dflash,dflash-tree"]
    argv += ["--tasks", "completion", "--out", str(out), "--no-plots"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["systems"] == ["plain", "dflash", "dflash-tree"]
    for row in results["rows"]:
        assert row["exact_match_rate"] == 1.0, row


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("scaling", [{}, LLAMA3_ROPE, {"rope_type": "yarn", "factor": 4.0}])
def test_rotary_scalings_turn_as_transformers_turns_them(scaling):
    """Llama-3.1's drafters rotate with llama3 scaling: the drafter's angles are transformers'."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from specdecode.strategies.dflash_head import DFlashConfig, Rotary

    config = DFlashConfig(32, 1, 4, 2, 64, (1,), 4, 0, 100, rope_theta=500000.0, rope_scaling=scaling)
    llama = LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=8,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", **scaling, "rope_theta": 500000.0},
    )
    x = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    positions = torch.tensor([0, 5, 63, 64, 500, 1999])
    cos, sin = LlamaRotaryEmbedding(llama)(x.float(), positions[None])
    expected, _ = apply_rotary_pos_emb(x.float(), x.float(), cos, sin)
    torch.testing.assert_close(Rotary(config)(x, positions).float(), expected, atol=2e-5, rtol=1e-4)


def test_a_llama3_rope_drafter_loads_keeps_its_scaling_and_drafts_exactly(drafter_dir, exactness_log):
    rewrite(drafter_dir, config_changes={"rope_parameters": LLAMA3_ROPE})
    target = NativeBackend(eagle3_target(), cached_tokenizer())
    head = load_head(drafter_dir, target)
    assert head.config.rope_scaling["rope_type"] == "llama3"
    again = save_head(head, drafter_dir.parent / "again", dtype=torch.float64)
    assert load_head(again, target).config.rope_scaling == head.config.rope_scaling
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    prompt = contexts(1, 16)[0]
    pipe = Pipeline(target, dflash=head, draft_config=DraftModelConfig(n_max=4, p_min=0.0))
    result = pipe.generate(prompt, GREEDY, config)
    check_same(result, plain(NativeBackend, prompt, GREEDY, config))
    assert result.stats.totals.n_drafted > 0
    exactness_log.record("dflash/greedy", "llama3 rotary chain native", result.stats)
