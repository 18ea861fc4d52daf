"""The trainer: target from scratch, draft by distillation, checkpoints, resumption, errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdecode import GenerationConfig, HFBackend, Pipeline, SamplingParams, SpecdecodeError
from specdecode.testing import make_llama, make_tokenizer, sample_text, save_model
from specdecode.train import lm
from specdecode.train.lm import ModelShape, TrainConfig, train_draft, train_target
from specdecode.vocab import vocab_difference

SHAPE = ModelShape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=128)
DRAFT = ModelShape(
    hidden=16, layers=1, heads=2, kv_heads=2, intermediate=32, max_positions=128, tie_embeddings=True
)
CONFIG = TrainConfig(
    steps=30,
    batch_size=4,
    seq_len=32,
    lr=1e-2,
    min_lr=1e-3,
    warmup_steps=3,
    checkpoint_every=10,
    device="cpu",
)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(320)


@pytest.fixture(scope="module")
def tokens(tokenizer) -> np.ndarray:
    return np.array(tokenizer(sample_text())["input_ids"], dtype=np.int32)


@pytest.fixture(scope="module")
def trained(tokens, tokenizer, tmp_path_factory) -> Path:
    return train_target(tokens, tokenizer, tmp_path_factory.mktemp("target"), SHAPE, CONFIG, progress=False)


def log_of(directory: Path) -> dict:
    return json.loads((directory / lm.LOG_FILE).read_text())


def checkpoint_weights(directory: Path) -> dict[str, torch.Tensor]:
    return torch.load(directory / lm.CHECKPOINT_FILE, weights_only=True)["model"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def early_and_late(losses: list[float]) -> tuple[float, float]:
    return float(np.mean(losses[:5])), float(np.mean(losses[-5:]))


def test_presets_have_the_documented_sizes():
    assert lm.parameter_count(lm.TARGET_SHAPE, 8192) == 34_087_424
    assert lm.parameter_count(lm.DRAFT_SHAPE, 8192) == 2_458_560
    for shape in (SHAPE, DRAFT):
        model = lm.LlamaForCausalLM(lm.llama_config(shape, 320, 0, 1, 2))
        assert sum(p.numel() for p in model.parameters()) == lm.parameter_count(shape, 320)


def test_target_learns_and_saves_a_loadable_model(trained):
    log = log_of(trained)
    assert len(log["losses"]) == CONFIG.steps and log["resumed_from"] == 0
    early, late = early_and_late(log["losses"])
    assert late < 0.8 * early
    with safe_open(trained / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}  # noqa: SIM118
    backend = HFBackend.load(trained)
    result = Pipeline(backend).generate(
        "def f(", SamplingParams(temperature=0), GenerationConfig(n_predict=5)
    )
    assert len(result.tokens) == 5


def test_float16_save(tokens, tokenizer, tmp_path):
    config = replace(CONFIG, steps=2, save_dtype="float16")
    out = train_target(tokens, tokenizer, tmp_path, SHAPE, config, progress=False)
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.float16}


def test_same_seed_same_weights_other_seed_differs(tokens, tokenizer, tmp_path, trained):
    again = train_target(tokens, tokenizer, tmp_path / "a", SHAPE, CONFIG, progress=False)
    assert_same_weights(checkpoint_weights(again), checkpoint_weights(trained))
    other = train_target(tokens, tokenizer, tmp_path / "b", SHAPE, replace(CONFIG, seed=1), progress=False)
    assert not torch.equal(
        checkpoint_weights(other)["model.embed_tokens.weight"],
        checkpoint_weights(trained)["model.embed_tokens.weight"],
    )


def test_interrupted_run_resumes_to_the_same_weights(tokens, tokenizer, tmp_path, trained, monkeypatch):
    real = lm._batch_for_step

    def interrupt_at_step_15(tokens, config, step):
        if step == 15:
            raise KeyboardInterrupt
        return real(tokens, config, step)

    monkeypatch.setattr(lm, "_batch_for_step", interrupt_at_step_15)
    with pytest.raises(KeyboardInterrupt):
        train_target(tokens, tokenizer, tmp_path, SHAPE, CONFIG, progress=False)
    monkeypatch.setattr(lm, "_batch_for_step", real)
    train_target(tokens, tokenizer, tmp_path, SHAPE, CONFIG, progress=False)
    assert log_of(tmp_path)["resumed_from"] == 10  # the last checkpoint before the interruption
    assert log_of(tmp_path)["losses"] == log_of(trained)["losses"]
    assert_same_weights(checkpoint_weights(tmp_path), checkpoint_weights(trained))


def test_a_finished_run_continues_with_more_steps(tokens, tokenizer, tmp_path):
    train_target(tokens, tokenizer, tmp_path, SHAPE, replace(CONFIG, steps=10), progress=False)
    first = log_of(tmp_path)["losses"]
    train_target(tokens, tokenizer, tmp_path, SHAPE, replace(CONFIG, steps=20), progress=False)
    log = log_of(tmp_path)
    assert log["resumed_from"] == 10 and len(log["losses"]) == 20 and log["losses"][:10] == first
    with pytest.raises(SpecdecodeError, match="beyond steps"):
        train_target(tokens, tokenizer, tmp_path, SHAPE, replace(CONFIG, steps=5), progress=False)


def test_a_checkpoint_of_another_run_is_refused(tokens, tokenizer, trained):
    with pytest.raises(SpecdecodeError, match="different run"):
        train_target(tokens, tokenizer, trained, replace(SHAPE, layers=1), CONFIG, progress=False)
    with pytest.raises(SpecdecodeError, match="different run"):
        train_target(tokens, tokenizer, trained, SHAPE, replace(CONFIG, lr=5e-3), progress=False)


def test_draft_distills_and_matches_the_target_vocabulary(tokens, tokenizer, tmp_path, trained):
    draft_dir = train_draft(tokens, trained, tmp_path / "draft", DRAFT, CONFIG, progress=False)
    early, late = early_and_late(log_of(draft_dir)["losses"])
    assert late < 0.8 * early
    assert vocab_difference(HFBackend.load(trained), HFBackend.load(draft_dir)) is None


def test_draft_of_a_saved_random_target(tokens, tokenizer, tmp_path):
    target_dir = save_model(tmp_path / "target", make_llama(len(tokenizer)), tokenizer)  # float64
    config = replace(CONFIG, steps=3, distill_temperature=2.0)
    draft_dir = train_draft(tokens, target_dir, tmp_path / "draft", DRAFT, config, progress=False)
    assert vocab_difference(HFBackend.load(target_dir), HFBackend.load(draft_dir)) is None


def test_draft_needs_a_causal_lm_target_with_a_tokenizer(tokens, tmp_path):
    with pytest.raises(SpecdecodeError, match="not found"):
        train_draft(tokens, tmp_path / "missing", tmp_path / "draft", DRAFT, CONFIG, progress=False)
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    (tmp_path / "t5" / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecdecodeError, match="not a causal language model"):
        train_draft(tokens, tmp_path / "t5", tmp_path / "draft", DRAFT, CONFIG, progress=False)
    make_llama(320).save_pretrained(tmp_path / "bare")
    with pytest.raises(SpecdecodeError, match="tokenizer"):
        train_draft(tokens, tmp_path / "bare", tmp_path / "draft", DRAFT, CONFIG, progress=False)
    assert not (tmp_path / "draft").exists()


def test_tokens_outside_the_vocabulary_are_refused(tokenizer, tmp_path):
    with pytest.raises(SpecdecodeError, match="token ids"):
        train_target(np.full(100, 999, np.int32), tokenizer, tmp_path, SHAPE, CONFIG, progress=False)
    with pytest.raises(SpecdecodeError, match="longer than"):
        train_target(np.zeros(10, np.int32), tokenizer, tmp_path, SHAPE, CONFIG, progress=False)


@pytest.mark.parametrize(
    "change",
    [
        {"steps": 0},
        {"batch_size": 0},
        {"lr": 1e-3, "min_lr": 1e-2},
        {"grad_clip": 0.0},
        {"device": "tpu"},
        {"save_dtype": "float32"},
        {"distill_temperature": 0.0},
        {"threads": 0},
        {"precision": "fp16"},
    ],
)
def test_bad_train_config(change):
    with pytest.raises(SpecdecodeError):
        replace(CONFIG, **change)


def test_bad_shape():
    with pytest.raises(SpecdecodeError):
        ModelShape(hidden=30, layers=1, heads=4, kv_heads=2, intermediate=64)
