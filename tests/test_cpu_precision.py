"""bfloat16 where it is fast, float32 where a CPU would emulate it: training's --precision auto,
and the note loading gives when --dtype auto runs bfloat16 weights in float32."""

from __future__ import annotations

import pytest
import torch
from conftest import TargetSpec, in_dtype, target_model

import specdecode.backends.hf
import specdecode.train.lm
from specdecode import LoadOptions
from specdecode.backends.load import load_backend
from specdecode.cli import main
from specdecode.testing import save_model
from specdecode.train.config import TrainConfig, choose_precision
from specdecode.train.lm import with_precision

CASES = [  # (asked, device, bf16 units) -> precision, what is said
    ("auto", "cuda", True, "bf16", None),
    ("auto", "cuda", False, "bf16", None),
    ("auto", "cpu", True, "bf16", None),
    ("auto", "cpu", False, "fp32", "note"),
    ("bf16", "cuda", True, "bf16", None),
    ("bf16", "cuda", False, "bf16", None),
    ("bf16", "cpu", True, "bf16", None),
    ("bf16", "cpu", False, "bf16", "warning"),
    ("fp32", "cuda", True, "fp32", None),
    ("fp32", "cuda", False, "fp32", None),
    ("fp32", "cpu", True, "fp32", None),
    ("fp32", "cpu", False, "fp32", None),
]


@pytest.mark.parametrize(("asked", "device", "bf16_units", "chosen", "said"), CASES)
def test_the_precision_is_bf16_unless_a_cpu_would_emulate_it(asked, device, bf16_units, chosen, said):
    precision, line = choose_precision(asked, device, bf16_units)
    assert precision == chosen
    assert (line.split(":")[0] if line else None) == said
    if said is not None:
        assert "this CPU has no bf16 units" in line


def test_auto_is_the_default_and_training_says_when_it_picks_fp32(monkeypatch, capsys):
    assert TrainConfig().precision == "auto"
    monkeypatch.setattr(specdecode.train.lm, "cpu_has_bf16", lambda: False)
    config = with_precision(TrainConfig(), torch.device("cpu"))
    assert config.precision == "fp32"
    assert capsys.readouterr().err == (
        "note: this CPU has no bf16 units: training in float32, about 10x faster here than bf16 emulation\n"
    )
    assert with_precision(TrainConfig(precision="bf16"), torch.device("cpu")).precision == "bf16"
    assert capsys.readouterr().err.startswith("warning: this CPU has no bf16 units")
    monkeypatch.setattr(specdecode.train.lm, "cpu_has_bf16", lambda: True)
    assert with_precision(TrainConfig(), torch.device("cpu")).precision == "bf16"
    assert capsys.readouterr().err == ""


@pytest.fixture
def bf16_model_dir(tmp_path, tokenizer):
    """A model whose weights are stored in bfloat16."""
    model = in_dtype(target_model(TargetSpec(seed=7, hidden=16, layers=1)), torch.bfloat16)
    return save_model(tmp_path / "bf16-model", model, tokenizer)


def test_loading_bf16_weights_in_float32_says_why(bf16_model_dir, monkeypatch):
    monkeypatch.setattr(specdecode.backends.hf, "cpu_has_bf16", lambda: False)
    native = LoadOptions(backend="native")  # auto may run a bfloat16 directory on llama.cpp
    backend = load_backend(bf16_model_dir, native)
    assert backend.weights.embeddings.dtype == torch.float32
    assert "this CPU has no bf16 units" in backend.dtype_note
    assert load_backend(bf16_model_dir, LoadOptions(dtype="float32")).dtype_note is None
    monkeypatch.setattr(specdecode.backends.hf, "cpu_has_bf16", lambda: True)
    assert load_backend(bf16_model_dir, native).dtype_note is None  # runs as stored


def test_generate_prints_the_dtype_note_once(bf16_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(specdecode.backends.hf, "cpu_has_bf16", lambda: False)
    args = ["-m", str(bf16_model_dir), "--backend", "native", "-p", "x = 1", "-n", "2", "--temp", "0"]
    assert main(["generate", *args]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(f"note: {bf16_model_dir.name}: this CPU has no bf16 units")
