"""`specdecode train dflash`: the anchored block loss, the drafter's start, training, the command.

The target is conftest's 4-layer float64 `eagle3_target()`; exactness is compared in float64.
"""

from __future__ import annotations

import inspect
import json
import textwrap

import numpy as np
import pytest
import torch
from conftest import EAGLE3_LAYERS, VOCAB_SIZE, cached_tokenizer, eagle3_corpus, eagle3_target
from safetensors.torch import load_file

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.cli import main
from specdecode.defaults import bundled_dflash, bundled_pair
from specdecode.errors import SpecdecodeError
from specdecode.strategies.dflash_checkpoint import load_head
from specdecode.strategies.dflash_head import ContextCache, default_layer_ids
from specdecode.strategies.eagle3_head import read_target
from specdecode.testing import make_llama, save_model
from specdecode.train import lm
from specdecode.train.config import DFlashShape, TrainConfig
from specdecode.train.dflash import (
    block_layout,
    calibrate_head,
    decay,
    dflash_loss,
    draw_anchors,
    new_head,
    train_dflash,
)
from specdecode.train.eagle3 import GENERATED_FILE, NEW_TOKENS, PREFIX_TOKENS

GREEDY = SamplingParams(temperature=0)
MASK = VOCAB_SIZE - 1  # the conftest targets' pad embedding is zero (transformers' padding_idx)
TINY_SHAPE = DFlashShape(
    layers=1,
    heads=4,
    kv_heads=2,
    head_dim=8,
    intermediate=48,
    block_size=4,
    anchors=6,
    layer_ids=EAGLE3_LAYERS,
    mask_token_id=MASK,
)


def tiny_config(steps: int, **changes) -> TrainConfig:
    settings = {
        "steps": steps,
        "batch_size": 4,
        "seq_len": 24,
        "lr": 1e-2,
        "min_lr": 1e-3,
        "warmup_steps": 2,
        "device": "cpu",
        "checkpoint_every": 4,
        "precision": "fp32",
    }
    return TrainConfig(**settings | changes)


# --------------------------------------------------------------------------- the loss


def test_block_layout_sees_the_context_before_each_anchor_and_its_own_block():
    positions, visible = block_layout(torch.tensor([1, 3]), 2, 4)
    assert positions.tolist() == [1, 2, 3, 4]
    assert visible.int().tolist() == [
        # context 0..3 | block rows
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 0, 0, 1, 1],
    ]


@pytest.mark.parametrize("layers", [1, 2])
def test_training_blocks_are_exactly_what_drafting_computes(layers):
    """Every block of one training forward (all anchors at once, the training mask) gives the
    logits the drafter gives at inference after the same context is cached: float64."""
    target = eagle3_target()
    shape = DFlashShape(
        layers=layers,
        heads=4,
        kv_heads=2,
        head_dim=8,
        intermediate=48,
        block_size=5,
        layer_ids=(0, 2, 4),
        mask_token_id=MASK,
    )
    head = new_head(target, shape, seed=3)
    ids = torch.tensor([np.random.default_rng(0).integers(3, VOCAB_SIZE, 22).tolist()])
    with torch.no_grad():
        _, feats = read_target(target, shape.layer_ids, ids)  # context rows of positions 0..20
        anchors = torch.arange(1, ids.shape[1] - shape.block_size + 1)  # every block that fits
        positions, visible = block_layout(anchors, shape.block_size, feats.shape[1])
        tokens = torch.full((1, len(positions)), head.config.mask_token_id)
        tokens[:, :: shape.block_size] = ids[:, anchors]
        context_positions = torch.arange(feats.shape[1])
        states = head.blocks(head.embed(tokens), positions, head.context(feats), context_positions, visible)
        trained = head.logits(states[0]).view(len(anchors), shape.block_size, -1)[:, 1:]
        for row, p in enumerate(anchors.tolist()):
            cache = ContextCache(layers)
            head.extend_context(feats[0, :p], cache)
            torch.testing.assert_close(trained[row], head.block(int(ids[0, p]), cache), rtol=0, atol=1e-10)


def test_loss_decays_along_the_block_as_the_paper_scaled():
    torch.testing.assert_close(decay(16), torch.exp(-torch.arange(15.0, dtype=torch.float64) / 7))
    torch.testing.assert_close(decay(8), torch.exp(-torch.arange(7.0, dtype=torch.float64) / 3.5))


def test_anchors_are_distinct_inside_the_sequence_and_a_function_of_it():
    sequence = torch.arange(25)
    anchors = draw_anchors(sequence, 6, 4)
    assert len(set(anchors.tolist())) == 6 and anchors.tolist() == sorted(anchors.tolist())
    assert anchors.min() >= 1 and anchors.max() + 4 <= 25  # a context row before, the block inside
    assert torch.equal(anchors, draw_anchors(sequence.clone(), 6, 4))
    assert not torch.equal(anchors, draw_anchors(sequence + 1, 6, 4))
    assert draw_anchors(sequence, 100, 4).tolist() == list(range(1, 22))  # all there are


def test_the_loss_reads_the_targets_next_token_distribution():
    """A drafter that already gives, at position p+1 of a block, the target's distribution at p
    would score the target's entropy there: the loss is the cross-entropy against the target."""
    target = eagle3_target()
    head = new_head(target, TINY_SHAPE, seed=0)
    batch = torch.randint(3, VOCAB_SIZE, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = float(dflash_loss(target, 6)(head, batch))
        logits, _ = read_target(target, TINY_SHAPE.layer_ids, batch)
        p = torch.softmax(logits.float(), -1)
        entropy = float(-(p * p.log()).sum(-1).mean())
    assert np.isfinite(loss) and loss > entropy


# --------------------------------------------------------------------------- the drafter's start


def test_default_layer_ids_are_z_labs_spread_as_layer_inputs():
    assert default_layer_ids(8, 2) == (2, 6)
    assert default_layer_ids(36, 5) == (2, 10, 18, 26, 34)  # z-lab's outputs 1, 9, 17, 25, 33
    assert default_layer_ids(4, 2) == (2,)  # a target too small for two distinct layers


def test_a_new_drafter_starts_from_the_targets_last_layer_and_norm():
    target = eagle3_target()
    shape = DFlashShape(
        layers=1, heads=4, kv_heads=2, head_dim=8, intermediate=37, layer_ids=(0, 4), mask_token_id=MASK
    )
    head = new_head(target, shape, seed=0)
    last = target.model.layers[-1]
    torch.testing.assert_close(head.norm.weight, target.model.norm.weight)
    attention = head.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # 4 heads, 2 kv heads of 8: as the target's
        assert torch.equal(getattr(attention, name).weight, getattr(last.self_attn, name).weight), name
    assert torch.equal(head.layers[0].input_layernorm.weight, last.input_layernorm.weight)
    assert head.layers[0].mlp.up_proj.weight.shape == (37, 32)  # narrower than the target's: its own
    assert torch.equal(head.target_embeddings, target.get_input_embeddings().weight)
    assert not any(name.startswith("target_") for name in head.state_dict())


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trainable(tmp_path_factory):
    """A saved float64 target and a token corpus of its own generations."""
    root = tmp_path_factory.mktemp("dflash-train")
    return save_model(root / "target", eagle3_target(), cached_tokenizer()), eagle3_corpus()


def test_training_lowers_the_loss_writes_a_drafter_and_resumes(zoo, trainable, tmp_path, monkeypatch):
    target_dir, tokens = trainable
    out = train_dflash(tokens, target_dir, tmp_path / "a", TINY_SHAPE, tiny_config(12), progress=False)
    log = json.loads((out / "train_log.json").read_text())
    losses = log["losses"]
    assert len(losses) == 12 and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])
    assert log["loss_decay_gamma"] == 1.75 and log["calibration"]["scale"] > 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    # it loads for the (float64) target and drafts, losslessly
    target = zoo.backend(eagle3_target())
    head = load_head(out, target)
    assert head.config.block_size == 4 and head.config.target_layer_ids == EAGLE3_LAYERS
    config = GenerationConfig(n_predict=20, ignore_eos=True)
    pipe = Pipeline(target, dflash=head, draft_config=DraftModelConfig(p_min=0.0))
    result = pipe.generate([5, 6, 7], GREEDY, config)
    expected = Pipeline(zoo.backend(eagle3_target())).generate([5, 6, 7], GREEDY, config)
    assert result.tokens == expected.tokens and result.stats.totals.n_drafted > 0
    # interrupted at step 10 (after the checkpoint of step 8) and resumed: the same weights
    real = lm._batch_for_step

    def interrupt_at_step_10(tokens, config, step):
        if step == 10:
            raise KeyboardInterrupt
        return real(tokens, config, step)

    monkeypatch.setattr(lm, "_batch_for_step", interrupt_at_step_10)
    with pytest.raises(KeyboardInterrupt):
        train_dflash(tokens, target_dir, tmp_path / "b", TINY_SHAPE, tiny_config(12), progress=False)
    monkeypatch.setattr(lm, "_batch_for_step", real)
    resumed = train_dflash(tokens, target_dir, tmp_path / "b", TINY_SHAPE, tiny_config(12), progress=False)
    resumed_log = json.loads((resumed / "train_log.json").read_text())
    assert resumed_log["resumed_from"] == 8 and resumed_log["losses"] == losses
    weights, expected_weights = load_file(resumed / "model.safetensors"), load_file(out / "model.safetensors")
    assert weights.keys() == expected_weights.keys()
    for name, value in expected_weights.items():
        assert torch.equal(weights[name], value), name
    # another block size does not resume a run it did not make
    other = DFlashShape(**{**TINY_SHAPE.__dict__, "block_size": 5})
    with pytest.raises(SpecdecodeError, match="different run"):
        train_dflash(tokens, target_dir, tmp_path / "b", other, tiny_config(16), progress=False)


def test_self_distillation_trains_on_the_targets_greedy_continuations(trainable, tmp_path):
    target_dir, tokens = trainable
    out = tmp_path / "drafter"
    train_dflash(tokens, target_dir, out, TINY_SHAPE, tiny_config(2), progress=False, generated_tokens=200)
    sequences = np.load(out / GENERATED_FILE)
    assert sequences.shape == (2, PREFIX_TOKENS + NEW_TOKENS)  # ceil(200 / 192) sequences
    with torch.no_grad():
        greedy = eagle3_target()(input_ids=torch.from_numpy(sequences.astype(np.int64))).logits.argmax(-1)
    assert np.array_equal(sequences[:, PREFIX_TOKENS:], greedy[:, PREFIX_TOKENS - 1 : -1].numpy())
    assert json.loads((out / "train_log.json").read_text())["steps"] == 2


@pytest.mark.parametrize(
    ("shape", "config", "message"),
    [
        (
            DFlashShape(layer_ids=(0, 5), mask_token_id=MASK),
            {},
            r"target layers \[-1, 4\], but the target has layers 0..3",
        ),
        (DFlashShape(mask_token_id=VOCAB_SIZE, layer_ids=(2,)), {}, "mask_token_id 320 is not in"),
        (
            DFlashShape(block_size=8, layer_ids=(2,), mask_token_id=MASK),
            {"seq_len": 6},
            "seq_len 6 holds no block of 8",
        ),
        (DFlashShape(layer_ids=(2,), mask_token_id=MASK), {"seq_len": 1100}, "exceeds the model.s 1023"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(trainable, tmp_path, shape, config, message):
    target_dir, tokens = trainable
    with pytest.raises(SpecdecodeError, match=message):
        train_dflash(tokens, target_dir, tmp_path / "out", shape, tiny_config(2, **config), progress=False)
    assert not (tmp_path / "out").exists()


def test_shapes_that_cannot_be_are_refused():
    for sizes, message in [
        ({"block_size": 1}, "drafts nothing"),
        ({"heads": 4, "kv_heads": 3}, "must divide heads"),
        ({"anchors": 0}, "must be >= 1"),
    ]:
        with pytest.raises(SpecdecodeError, match=message):
            DFlashShape(**sizes)


def test_the_mask_token_is_a_token_with_an_embedding():
    """The pad token by default; none, or one whose embedding is zero (every masked row would
    then be alike: a one-layer drafter's rows could not differ), needs --mask-token-id."""
    model = make_llama(VOCAB_SIZE, hidden=32, layers=4, heads=4, kv_heads=2, seed=2)
    with torch.no_grad():
        model.get_input_embeddings().weight[2] = 0  # an untrained pad, as the bundled target's
    with pytest.raises(SpecdecodeError, match="embedding of token 2, the mask token asked for, is all zeros"):
        new_head(model, DFlashShape(layer_ids=(2,)), seed=0)
    model.config.pad_token_id = None
    with pytest.raises(SpecdecodeError, match="no pad token"):
        new_head(model, DFlashShape(layer_ids=(2,)), seed=0)
    assert new_head(model, DFlashShape(layer_ids=(2,), mask_token_id=7), seed=0).config.mask_token_id == 7


def test_calibration_scales_the_logits_and_reads_every_drafted_position():
    target = eagle3_target()
    head = new_head(target, TINY_SHAPE, seed=0)
    norm = head.norm.weight.detach().clone()
    record = calibrate_head(target, head, eagle3_corpus(), 3, 20, seed=0)
    torch.testing.assert_close(head.norm.weight.detach(), norm * record["scale"])  # argmaxes unchanged
    assert record["positions"] == 3 * 17 * 3  # 3 windows x 17 blocks x 3 drafted positions
    assert [p["positions"] for p in record["block_positions"]] == [51, 51, 51]
    assert 0 <= record["agreement"] <= 1


# --------------------------------------------------------------------------- the command


def test_train_dflash_command_writes_a_loadable_drafter(zoo, trainable, tmp_path, capsys):
    target_dir, _ = trainable
    data = tmp_path / "data.py"
    data.write_text(inspect.getsource(textwrap) * 2)
    out = tmp_path / "drafter"
    argv = ["train", "dflash", "--target", str(target_dir), "--out", str(out), "--data", str(data)]
    argv += ["--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--intermediate", "32"]
    argv += ["--block-size", "6", "--anchors", "3", "--mask-token-id", "1", "--layer-ids", "1,4"]
    argv += ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--precision", "fp32", "--device", "cpu"]
    argv += ["--warmup-steps", "1"]
    assert main(argv) == 0
    assert "DFlash drafter ->" in capsys.readouterr().err
    head = load_head(out, zoo.backend(eagle3_target()))
    assert head.config.target_layer_ids == (1, 4) and head.config.block_size == 6
    assert head.config.mask_token_id == 1 and head.config.num_hidden_layers == 2
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert len(json.loads((out / "train_log.json").read_text())["losses"]) == 3
    config_text, weights = (out / "config.json").read_text(), load_file(out / "model.safetensors")
    capsys.readouterr()
    assert main([*argv[:6], "--calibrate-only", "--data", str(data), "--seq-len", "16"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (out / "config.json").read_text() == config_text
    calibrated = load_file(out / "model.safetensors")
    expected = (weights["norm.weight"].double() * record["scale"]).to(torch.bfloat16)
    torch.testing.assert_close(calibrated["norm.weight"].float(), expected.float(), rtol=1e-2, atol=0)
    assert torch.equal(calibrated["fc.weight"], weights["fc.weight"])
    bad = tmp_path / "bad"
    for flags, message in [
        (["--block-size", "1"], "drafts nothing"),
        (["--layer-ids", "1,x"], "--layer-ids takes comma-separated integers"),
        (["--generated-tokens", "-5"], "generated_tokens must be >= 0"),
        (["--kv-heads", "3"], "must divide heads"),
    ]:
        assert main([*argv[:5], str(bad), *argv[6:], *flags]) == 2
        assert message in capsys.readouterr().err
    assert not bad.exists()


def test_the_bundled_drafter_fits_the_bundled_target_and_drafts_exactly(exactness_log):
    directory = bundled_dflash()
    if directory is None:
        pytest.skip("this installation carries no bundled DFlash drafter")
    target = HFBackend.load(bundled_pair()[0])
    head = load_head(directory, target)
    assert head.config.block_size == 8 and head.config.mask_token_id == 127  # 'À', byte 0xC0
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    prompt = target.tokenizer.encode("def read_lines(path):")
    result = Pipeline(target, dflash=head, draft_config=DraftModelConfig(p_min=0.0)).generate(
        prompt, GREEDY, config
    )
    assert result.tokens == Pipeline(target).generate(prompt, GREEDY, config).tokens
    assert result.stats.totals.n_accepted > 0
    exactness_log.record(
        "dflash/greedy", "bundled drafter", result.stats, dtype=str(target.model.dtype).removeprefix("torch.")
    )
