"""`specdecode train ... --nproc 2`: two gloo processes on the CPU under torchrun, against one.

At the same global batch two processes follow one process's loss curve (float32: equal up
to the order in which gradients are summed), resume from their checkpoint like one process,
and generate the same self-distillation data in two shares.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specdecode.cli import main
from specdecode.testing import make_llama, make_tokenizer, save_model
from specdecode.train.eagle3 import GENERATED_FILE

FEW = [
    *("--batch-size", "4", "--seq-len", "32", "--warmup-steps", "1", "--precision", "fp32"),
    *("--calibration-windows", "0", "--checkpoint-every", "2", "--threads", "1"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("distributed")
    model = make_llama(
        320, hidden=32, layers=4, heads=4, kv_heads=2, init_std=0.5, seed=2, dtype=torch.float32
    )
    target = save_model(root / "target", model, make_tokenizer())
    data = root / "data.py"
    data.write_text(inspect.getsource(textwrap) * 2)
    return target, data


def losses(directory: Path) -> list[float]:
    return json.loads((directory / "train_log.json").read_text())["losses"]


@pytest.mark.slow
def test_two_processes_follow_one_and_resume(inputs, tmp_path):
    target, data = inputs
    common = ["train", "draft", "--target", str(target), "--data", str(data), *FEW]
    one, two = tmp_path / "one", tmp_path / "two"
    for steps in ("3", "6"):  # the second run resumes the first one's checkpoint
        assert main([*common, "--steps", steps, "--out", str(one)]) == 0
        assert main([*common, "--steps", steps, "--out", str(two), "--nproc", "2"]) == 0
        if steps == "3":
            np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    assert json.loads((two / "train_log.json").read_text())["resumed_from"] == 3
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    assert losses(one)[-1] < losses(one)[0]
    first, second = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for name, value in first.items():
        torch.testing.assert_close(second[name].float(), value.float(), rtol=0, atol=1e-2)  # bfloat16


@pytest.mark.slow
def test_self_distillation_data_is_generated_in_shares(inputs, tmp_path):
    target, data = inputs
    common = [
        *("train", "eagle3", "--target", str(target), "--data", str(data), "--steps", "2", *FEW),
        *("--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--unroll", "2"),
        *("--generated-tokens", "600"),  # 4 sequences: 2 per process
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*common, "--out", str(one)]) == 0
    assert main([*common, "--out", str(two), "--nproc", "2"]) == 0
    generated = np.load(one / GENERATED_FILE)
    assert generated.shape[0] == 4
    np.testing.assert_array_equal(np.load(two / GENERATED_FILE), generated)
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    assert (two / "model.safetensors").is_file()


@pytest.mark.slow
def test_dflash_blocks_are_drawn_alike_in_two_processes(inputs, tmp_path):
    """Each sequence draws its anchors from its own tokens: two processes, each with half of the
    batch, train on the blocks one process does."""
    target, data = inputs
    common = [
        *("train", "dflash", "--target", str(target), "--data", str(data), "--steps", "3", *FEW),
        *("--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--intermediate", "32"),
        *("--block-size", "4", "--anchors", "5", "--mask-token-id", "319"),
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*common, "--out", str(one)]) == 0
    assert main([*common, "--out", str(two), "--nproc", "2"]) == 0
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    assert (two / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--nproc", "3"], "batch_size 4 is not a multiple of --nproc 3"),
        (["--nproc", "2", "--steps", "0"], "steps must be >= 1"),
    ],
)
def test_bad_process_counts_are_refused_before_any_process_starts(inputs, tmp_path, capsys, extra, message):
    target, data = inputs
    out = tmp_path / "out"
    argv = ["train", "draft", "--target", str(target), "--data", str(data), *FEW, "--out", str(out), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()
