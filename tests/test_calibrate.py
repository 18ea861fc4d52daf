"""Draft calibration: the fitted scale is the maximum-likelihood one, and applying it changes
the draft's confidence but never its argmax (so never a greedy draft)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from specdecode.errors import SpecdecodeError
from specdecode.testing import make_llama, make_tokenizer, sample_text, save_model
from specdecode.train.calibrate import agreement_loss, apply_scale, fit_scale
from specdecode.train.lm import ModelShape, TrainConfig, train_draft

DRAFT = ModelShape(hidden=16, layers=1, heads=2, kv_heads=2, intermediate=32, max_positions=128)
CONFIG = TrainConfig(steps=4, batch_size=2, seq_len=32, warmup_steps=1, device="cpu", calibration_windows=4)


def test_fit_recovers_the_scale_that_generated_the_agreements():
    generator = torch.Generator().manual_seed(0)
    top = torch.sort(torch.randn(20000, 10, generator=generator, dtype=torch.float64), descending=True).values
    true_scale = 2.5
    p_top1 = torch.softmax(top * true_scale, dim=-1)[:, 0]
    agree = torch.rand(20000, generator=generator, dtype=torch.float64) < p_top1
    fitted = fit_scale(top, agree)
    assert math.isclose(fitted, true_scale, rel_tol=0.08)
    assert agreement_loss(top, agree, fitted) <= agreement_loss(top, agree, true_scale) + 1e-9
    with pytest.raises(SpecdecodeError):
        fit_scale(top[:0], agree[:0])


def test_applying_a_scale_multiplies_the_logits_and_keeps_the_argmax():
    model = make_llama(64, seed=2)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=ids).logits
    apply_scale(model, 3.0)
    after = model(input_ids=ids).logits
    torch.testing.assert_close(after, 3.0 * before)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_train_draft_calibrates_and_records_it(tmp_path):
    tokenizer = make_tokenizer(320)
    tokens = np.asarray(tokenizer(sample_text())["input_ids"], dtype=np.int32)
    target_dir = save_model(tmp_path / "target", make_llama(len(tokenizer), init_std=0.5), tokenizer)
    draft_dir = train_draft(tokens, target_dir, tmp_path / "draft", DRAFT, CONFIG, progress=False)
    calibration = json.loads((draft_dir / "train_log.json").read_text())["calibration"]
    assert calibration["positions"] == 4 * CONFIG.seq_len
    assert calibration["scale"] > 0
    # maximum likelihood pulls the mean confidence towards the observed agreement rate
    before = abs(calibration["mean_confidence_before"] - calibration["agreement"])
    assert abs(calibration["mean_confidence_after"] - calibration["agreement"]) <= before + 1e-9
    plain = train_draft(
        tokens, target_dir, tmp_path / "plain", DRAFT, replace(CONFIG, calibration_windows=0), progress=False
    )
    assert "calibration" not in json.loads((plain / "train_log.json").read_text())
