"""DFlash drafters out to vLLM, SGLang (z-lab's layout) and llama.cpp (GGUF arch dflash).

The drafter is built here with random weights (norms included, so a swapped name shows) over
`eagle3_target()`, reading the inputs of target layers (1, 2, 4): z-lab's ids (0, 1, 3) in the
directories, llama.cpp's (1, 2, 4) in the GGUF. Its weights are rounded through bfloat16 first,
as a saved drafter holds them, so every export must give them back bit for bit and draft the
same tokens.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch
from conftest import VOCAB_SIZE, cached_tokenizer, eagle3_target
from safetensors.torch import load_file
from transformers import AutoConfig

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.cli import main
from specdecode.export.dflash_gguf import read_dflash_gguf, write_dflash_gguf
from specdecode.strategies.dflash_checkpoint import expected_shapes, load_head, save_head
from specdecode.strategies.dflash_head import ContextCache, DFlashConfig, DFlashHead
from specdecode.testing import save_model

GREEDY = SamplingParams(temperature=0)
CONFIG = GenerationConfig(n_predict=40, ignore_eos=True)
PROMPT = list(range(3, 20))
LAYERS = (1, 2, 4)  # inputs of target layers; z-lab writes (0, 1, 3)
MASK = VOCAB_SIZE - 1
SHAPE = DFlashConfig(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    target_layer_ids=LAYERS,
    block_size=4,
    mask_token_id=MASK,
    vocab_size=VOCAB_SIZE,
    head_dim=8,
)


def drafter(config: DFlashConfig = SHAPE, seed: int = 0) -> DFlashHead:
    """A float64 drafter for `eagle3_target()` with random weights rounded through bfloat16."""
    target = eagle3_target()
    head = DFlashHead(config, target.model.embed_tokens.weight, target.lm_head.weight).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in head.named_parameters():
            noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
            weight.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
            weight.copy_(weight.to(torch.bfloat16).double())
    return head.eval().requires_grad_(False)


def run(zoo, head: DFlashHead):
    return Pipeline(zoo.backend(eagle3_target()), dflash=head).generate(PROMPT, GREEDY, CONFIG)


def block_logits(head: DFlashHead, zoo) -> torch.Tensor:
    """The drafter's block after the prompt's target features: what it drafts from."""
    target = zoo.backend(eagle3_target())
    target.capture_hidden(head.config.target_layer_ids)
    target.evaluate(PROMPT[:-1])
    cache = ContextCache(head.config.num_hidden_layers)
    head.extend_context(target.hidden_states(0, len(PROMPT) - 1), cache)
    return head.block(PROMPT[-1], cache)


def check_same_drafts(zoo, exactness_log, loaded: DFlashHead, kind: str) -> None:
    """The weights back bit for bit, the same block logits, the same drafts and output."""
    original = drafter(loaded.config)  # the same weights, with the epsilon as the file keeps it
    for name, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert torch.equal(block_logits(loaded, zoo), block_logits(original, zoo))
    expected, result = run(zoo, original), run(zoo, loaded)
    plain = Pipeline(zoo.backend(eagle3_target())).generate(PROMPT, GREEDY, CONFIG)
    assert result.tokens == expected.tokens == plain.tokens
    assert result.stats.totals.n_drafted == expected.stats.totals.n_drafted
    assert result.stats.totals.n_accepted == expected.stats.totals.n_accepted
    exactness_log.record("export/greedy", kind, result.stats, result.stats.stop_reason)


def export(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash")
    target = save_model(root / "target", copy.deepcopy(eagle3_target()).float(), cached_tokenizer())
    return target, save_head(drafter(), root / "drafter")


@pytest.fixture(scope="module")
def exported(inputs, tmp_path_factory) -> tuple[Path, list[dict], str]:
    """The drafter exported for every engine: the directory, the commands, stderr."""
    target, drafter_dir = inputs
    out = tmp_path_factory.mktemp("exported") / "out"
    code, stdout, stderr = export(
        ["export", "-m", str(target), "--model-draft-dflash", str(drafter_dir), "--out", str(out), "--json"]
    )
    assert code == 0, stderr
    return out, json.loads(stdout), stderr


# --------------------------------------------------------------------------- the command


def test_export_prints_each_engines_command(exported):
    out, served, stderr = exported
    lines = {(s["engine"], s["drafter"]): s["command"] for s in served}
    assert set(lines) == {("vllm", "dflash"), ("sglang", "dflash"), ("llama.cpp", "dflash")}
    root = out.resolve()
    vllm = lines["vllm", "dflash"]
    spec = {"method": "dflash", "model": str(root / "vllm/dflash"), "num_speculative_tokens": 3}
    assert vllm[:2] == ["vllm", "serve"] and vllm[-2] == "--speculative-config"
    assert json.loads(vllm[-1]) == spec  # block_size 4 drafts 3 tokens a step
    assert json.loads((out / "vllm/speculative-config-dflash.json").read_text()) == spec
    sglang = lines["sglang", "dflash"]
    assert sglang[sglang.index("--speculative-algorithm") + 1] == "DFLASH"
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == str(root / "sglang/dflash")
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "4"  # the last token + 3
    gguf_dir = root / "llama.cpp"
    assert lines["llama.cpp", "dflash"] == [
        *("llama-server", "-m", str(gguf_dir / "target.gguf"), "-md", str(gguf_dir / "dflash.gguf")),
        *("--spec-type", "draft-dflash", "--spec-draft-n-max", "3"),
    ]
    assert (out / "commands.txt").read_text().count("# ") == 3
    assert "target layer inputs [1, 2, 4]" in " ".join(stderr.split())


def test_fewer_tokens_a_step_are_written_and_more_are_refused(inputs, tmp_path):
    target, drafter_dir = inputs
    argv = ["export", "-m", str(target), "-mdf", str(drafter_dir), "--engines", "vllm,sglang"]
    code, stdout, _ = export([*argv, "--out", str(tmp_path / "two"), "--json", "--spec-draft-n-max", "2"])
    assert code == 0
    lines = {s["engine"]: s["command"] for s in json.loads(stdout)}
    assert json.loads(lines["vllm"][-1])["num_speculative_tokens"] == 2
    assert lines["sglang"][-1] == "3"
    code, _, stderr = export([*argv, "--out", str(tmp_path / "five"), "--spec-draft-n-max", "5"])
    assert code == 2 and "drafts at most 3 tokens a step (block_size 4 - 1)" in stderr
    assert len(stderr.splitlines()) == 1
    assert not (tmp_path / "five").exists()


# --------------------------------------------------------------------------- vLLM and SGLang


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_zlab_directory_has_the_names_shapes_and_ids(exported, engine):
    out, _, _ = exported
    directory = out / engine / "dflash"
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"block_size": 4, "mask_token_id": MASK, "target_layer_ids": [0, 1, 3]}
    assert config["is_causal"] is False and config["num_hidden_layers"] == 2 and config["hidden_size"] == 32
    # what vLLM and SGLang read it with: transformers' Qwen3 config, the ids plus one (vLLM's
    # get_eagle3_aux_layers_from_config) being the inputs the drafter was made for
    hf = AutoConfig.from_pretrained(directory)
    assert type(hf).__name__ == "Qwen3Config" and hf.head_dim == 8 and hf.num_key_value_heads == 2
    assert [i + 1 for i in hf.dflash_config["target_layer_ids"]] == list(LAYERS)
    tensors = load_file(directory / "model.safetensors")
    shapes = expected_shapes(replace(SHAPE, head_dim=8))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == shapes
    assert shapes["fc.weight"] == (32, 96) and shapes["layers.1.self_attn.k_proj.weight"] == (16, 32)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert not any("embed" in name or "lm_head" in name for name in tensors)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_zlab_directory_reads_back_and_drafts_the_same(zoo, exactness_log, exported, engine):
    out, _, _ = exported
    loaded = load_head(out / engine / "dflash", zoo.backend(eagle3_target()))
    assert loaded.config == replace(SHAPE, head_dim=8)
    check_same_drafts(zoo, exactness_log, loaded, f"DFlash {engine} export")


# --------------------------------------------------------------------------- llama.cpp


def test_gguf_holds_the_drafter_its_ids_and_the_targets_tokenizer(exported):
    out, _, _ = exported
    reader = gguf.GGUFReader(out / "llama.cpp/dflash.gguf")
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.target_layers"] == list(LAYERS)  # inputs of target layers, as llama.cpp taps
    assert fields["dflash.block_size"] == 4 and fields["dflash.target_hidden_size"] == 32
    assert fields["dflash.block_count"] == 2 and fields["dflash.attention.head_count_kv"] == 2
    assert fields["dflash.attention.key_length"] == 8 and fields["dflash.attention.causal"] is False
    assert fields["tokenizer.ggml.mask_token_id"] == fields["dflash.mask_token_id"] == MASK
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == VOCAB_SIZE
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    assert shapes["fc.weight"] == (32, 96)
    assert shapes["enc.output_norm.weight"] == (32,) and shapes["output_norm.weight"] == (32,)
    assert shapes["blk.1.attn_k.weight"] == (16, 32) and shapes["blk.0.attn_q_norm.weight"] == (8,)
    assert shapes["blk.1.ffn_down.weight"] == (32, 64)
    assert len(shapes) == 3 + 2 * 11 and "token_embd.weight" not in shapes and "output.weight" not in shapes


def test_gguf_reads_back_and_drafts_the_same(zoo, exactness_log, exported):
    out, _, _ = exported
    loaded = read_dflash_gguf(out / "llama.cpp/dflash.gguf", zoo.backend(eagle3_target()))
    expected = replace(SHAPE, head_dim=8)
    assert replace(loaded.config, rms_norm_eps=expected.rms_norm_eps) == expected  # GGUF keeps float32
    check_same_drafts(zoo, exactness_log, loaded, "DFlash GGUF export")


def test_gguf_keeps_sliding_window_layers(zoo, inputs, tmp_path):
    target, _ = inputs
    config = replace(SHAPE, head_dim=8, sliding_window=6, sliding_layers=(1,))
    path = write_dflash_gguf(drafter(config), target, tmp_path / "swa.gguf")
    fields = {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}
    assert fields["dflash.attention.sliding_window"] == 6
    assert fields["dflash.attention.sliding_window_pattern"] == [False, True]
    loaded = read_dflash_gguf(path, zoo.backend(eagle3_target()))
    assert replace(loaded.config, rms_norm_eps=config.rms_norm_eps) == config


# --------------------------------------------------------------------------- bad input


def corrupt_weights(directory: Path) -> None:
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")


def no_json(directory: Path) -> None:
    (directory / "config.json").write_text("{ not json")


def other_hidden_size(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (None, "DFlash drafter directory not found"),
        (corrupt_weights, "cannot read model.safetensors"),
        (no_json, "cannot read config.json"),
        (other_hidden_size, "made for a target of hidden size 64"),
    ],
)
def test_a_missing_or_corrupt_drafter_is_refused_and_nothing_written(inputs, tmp_path, spoil, message):
    target, drafter_dir = inputs
    directory = tmp_path / "drafter"
    if spoil is not None:
        directory.mkdir()
        for name in ("config.json", "model.safetensors"):
            (directory / name).write_bytes((drafter_dir / name).read_bytes())
        spoil(directory)
    out = tmp_path / "out"
    argv = ["export", "-m", str(target), "-mdf", str(directory), "--out", str(out)]
    code, _, stderr = export(argv)
    assert code == 2 and message in stderr and len(stderr.splitlines()) == 1
    assert not out.exists()


def test_biased_attention_is_refused_for_llama_cpp(inputs, tmp_path):
    target, _ = inputs
    directory = save_head(drafter(replace(SHAPE, attention_bias=True)), tmp_path / "biased")
    argv = ["export", "-m", str(target), "-mdf", str(directory)]
    code, _, stderr = export([*argv, "--out", str(tmp_path / "out")])
    assert code == 2 and "llama.cpp's DFlash layers do not load" in stderr
    assert not (tmp_path / "out").exists()
    assert export([*argv, "--out", str(tmp_path / "vllm"), "--engines", "vllm"])[0] == 0


def test_a_drafter_reading_the_embeddings_goes_to_llama_cpp_only(inputs, tmp_path):
    """Input of layer 0 is z-lab's id -1, which vLLM and SGLang would misread; the GGUF says 0."""
    target, _ = inputs
    directory = save_head(drafter(replace(SHAPE, target_layer_ids=(0, 2, 4))), tmp_path / "embeddings")
    assert json.loads((directory / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [
        -1,
        1,
        3,
    ]
    argv = ["export", "-m", str(target), "-mdf", str(directory)]
    code, _, stderr = export([*argv, "--out", str(tmp_path / "out")])
    assert code == 2 and "reads the input of target layer 0" in stderr
    assert not (tmp_path / "out").exists()
    assert export([*argv, "--out", str(tmp_path / "gguf"), "--engines", "llama.cpp"])[0] == 0
    reader = gguf.GGUFReader(tmp_path / "gguf/llama.cpp/dflash.gguf")
    assert reader.fields["dflash.target_layers"].contents() == [0, 2, 4]
