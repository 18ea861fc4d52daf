"""Published EAGLE-3 layouts in, our heads and drafts out to vLLM, SGLang and llama.cpp.

Heads are the trained float64 heads of conftest, saved in the layout under test; the
`speculators` package's config classes and its EAGLE-3 model read our speculators
directories, gguf's reader reads our GGUF files, and every export is read back and drafts
what the original drafts (speculative output equal to plain output, same acceptance).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch
from conftest import EAGLE3_LAYERS, VOCAB_SIZE, cached_tokenizer, eagle3_head, eagle3_target
from safetensors.torch import load_file
from speculators import SpeculatorModelConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.gguf_files import export_gguf, load_gguf_model
from specdecode.cli import main
from specdecode.export.engines import write_speculators
from specdecode.export.gguf import interleave_rows, read_head_gguf, write_head_gguf
from specdecode.strategies.eagle3_checkpoint import load_head, save_head
from specdecode.strategies.eagle3_layouts import layer_reading
from specdecode.testing import perturbed_copy, save_model

GREEDY = SamplingParams(temperature=0)
CONFIG = GenerationConfig(n_predict=40, ignore_eos=True)
PROMPT = list(range(3, 20))
HIGH_LAYERS = (2, 3, 4)  # SpecForge would store these as outputs of layers (1, 2, 3)


def float32_target():
    """A float32 copy of the target (what a saved model usually holds; the cached one stays)."""
    return copy.deepcopy(eagle3_target()).float()


def generate(zoo, head):
    return Pipeline(zoo.backend(eagle3_target()), eagle3=head).generate(PROMPT, GREEDY, CONFIG)


def plain(zoo):
    return Pipeline(zoo.backend(eagle3_target())).generate(PROMPT, GREEDY, CONFIG)


def check_exact(zoo, exactness_log, head, kind: str):
    """Speculative output with `head` is plain output; returns the run's stats."""
    result = generate(zoo, head)
    assert result.tokens == plain(zoo).tokens
    exactness_log.record("export/greedy", kind, result.stats, result.stats.stop_reason)
    return result.stats


def as_saved(config):
    """A config as files give it back: with its head dimension spelled out."""
    return replace(config, head_dim=config.dim)


def rewrite_ids(directory: Path, ids: list[int]) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    if "speculators_model_type" in config:
        config["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    path.write_text(json.dumps(config))


# --------------------------------------------------------------------------- layer ids


@pytest.mark.parametrize(
    ("config", "offset", "convention"),
    [
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}, 0, "input"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}, 0, "input"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 1, "output"),
        ({"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [1, 15, 28]}, 0, "input"),
        ({}, 0, "input"),
    ],
)
def test_layer_id_convention_follows_the_checkpoint(config, offset, convention):
    reading = layer_reading(config)
    assert reading.offset == offset and reading.convention.startswith(convention)
    assert layer_reading(config, override=-1).offset == -1
    stored = reading.stored or (2, 16, 29)
    assert reading.ids(32) == tuple(layer + offset for layer in stored)


def test_specforge_ids_are_shifted_and_the_override_changes_the_reading(zoo, exactness_log, tmp_path):
    """A head reading inputs of layers (2, 3, 4), saved with SpecForge's 'output of layer' ids
    (1, 2, 3), drafts as before; read with offset 0 instead it reads other layers: still exact,
    but it drafts worse. Both facts are reported."""
    head = eagle3_head(layer_ids=HIGH_LAYERS)
    expected = check_exact(zoo, exactness_log, head, "head, inputs (2, 3, 4)")
    directory = save_head(head, tmp_path / "specforge")
    rewrite_ids(directory, [1, 2, 3])
    target = zoo.backend(eagle3_target())
    loaded = load_head(directory, target)
    assert loaded.config.target_layer_ids == HIGH_LAYERS
    assert "output of layer" in loaded.layer_note and "offset +1" in loaded.layer_note
    stats = check_exact(zoo, exactness_log, loaded, "SpecForge ids, offset +1")
    assert stats.totals.n_accepted == expected.totals.n_accepted
    wrong = load_head(directory, target, layer_offset=0)
    assert wrong.config.target_layer_ids == (1, 2, 3) and "--eagle3-layer-offset" in wrong.layer_note
    misread = check_exact(zoo, exactness_log, wrong, "SpecForge ids misread, offset 0")
    assert misread.totals.n_accepted < expected.totals.n_accepted


def test_generate_prints_the_reading_and_takes_the_override(zoo, tmp_path, capsys):
    target = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    directory = save_head(eagle3_head(layer_ids=HIGH_LAYERS), tmp_path / "head")
    rewrite_ids(directory, [1, 2, 3])
    argv = ["generate", "-m", str(target), "-me", str(directory), "-p", "def f(x):", "-n", "8", "--temp", "0"]
    assert main(argv) == 0
    assert "target layer inputs [2, 3, 4]" in " ".join(capsys.readouterr().err.split())  # notes wrap
    assert main([*argv, "--eagle3-layer-offset", "0"]) == 0
    assert "target layer inputs [1, 2, 3]" in " ".join(capsys.readouterr().err.split())
    assert main([*argv, "--eagle3-layer-offset", "5"]) == 2
    assert "layers 0..4" in capsys.readouterr().err


def test_training_refuses_ids_that_engines_would_shift():
    from specdecode.errors import SpecdecodeError
    from specdecode.train.eagle3 import HeadShape

    with pytest.raises(SpecdecodeError, match="ambiguous"):
        HeadShape(layer_ids=(1, 2, 3))


# --------------------------------------------------------------------------- speculators (vLLM)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The target saved, and the trained head written as a speculators directory for it."""
    root = tmp_path_factory.mktemp("speculators")
    target = save_model(root / "target", float32_target(), cached_tokenizer())
    head_dir = write_speculators(eagle3_head(), root / "eagle3", str(target), ["LlamaForCausalLM"], 4)
    return target, head_dir


def test_speculators_config_classes_read_the_export(exported):
    target, head_dir = exported
    config = SpeculatorModelConfig.from_pretrained(head_dir)
    assert isinstance(config, Eagle3SpeculatorConfig)
    assert config.eagle_aux_hidden_state_layer_ids == list(EAGLE3_LAYERS)
    assert config.draft_vocab_size == 200 and config.target_vocab_size == VOCAB_SIZE
    assert config.transformer_layer_config.num_attention_heads == 4
    assert config.speculators_config.verifier.name_or_path == str(target)
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 4
    assert not config.norm_before_residual


def test_speculators_eagle3_model_loads_the_export(exported):
    """speculators' own EAGLE-3 model takes every tensor, under its names, with our values."""
    _, head_dir = exported
    model = Eagle3DraftModel.from_pretrained(head_dir)
    state = model.state_dict()
    saved = load_file(head_dir / "model.safetensors")
    assert "layers.0.hidden_norm.weight" in saved and not any(n.startswith("midlayer.") for n in saved)
    for name, value in saved.items():
        assert torch.equal(state[name].to(value.dtype), value), name
    assert torch.equal(model.d2t.to(torch.long), saved["d2t"])


def test_speculators_export_reads_back_and_drafts_the_same(zoo, exactness_log, exported):
    _, head_dir = exported
    original = eagle3_head()
    loaded = load_head(head_dir, zoo.backend(eagle3_target()))
    assert "speculators layout" in loaded.layer_note
    assert loaded.config == as_saved(original.config)
    torch.testing.assert_close(loaded.fc.weight, original.fc.weight.to(torch.bfloat16).double())
    check_exact(zoo, exactness_log, loaded, "speculators export")
    # the original layout holds the same bfloat16 head: the same drafts
    again = load_head(save_head(original, head_dir.parent / "original"), zoo.backend(eagle3_target()))
    assert generate(zoo, loaded).stats.totals.n_accepted == generate(zoo, again).stats.totals.n_accepted


def test_heads_with_unsupported_options_are_refused(zoo, exported, tmp_path):
    from specdecode.errors import SpecdecodeError

    _, head_dir = exported
    config = json.loads((head_dir / "config.json").read_text())
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes((head_dir / "model.safetensors").read_bytes())
    (copy / "config.json").write_text(json.dumps({**config, "norm_before_fc": True}))
    with pytest.raises(SpecdecodeError, match="norm_before_fc"):
        load_head(copy, zoo.backend(eagle3_target()))
    (copy / "config.json").write_text(json.dumps({**config, "speculators_model_type": "mtp"}))
    with pytest.raises(SpecdecodeError, match="not eagle3"):
        load_head(copy, zoo.backend(eagle3_target()))


# --------------------------------------------------------------------------- GGUF (llama.cpp)


def test_rotary_rows_are_interleaved_per_head_as_llama_cpp_expects():
    weight = torch.arange(8.0)[:, None]  # 2 heads of dimension 4: rows x0 x1 y0 y1 per head
    assert interleave_rows(weight, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    torch.testing.assert_close(interleave_rows(interleave_rows(weight, 2), 2, inverse=True), weight)


def test_model_gguf_holds_the_model_and_its_tokenizer(tmp_path):
    model = float32_target()
    directory = save_model(tmp_path / "target", model, cached_tokenizer())
    path = export_gguf(directory, tmp_path / "target.gguf")
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 4
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == VOCAB_SIZE and tokens[0] == "<|bos|>" and fields["tokenizer.ggml.bos_token_id"] == 0
    assert fields["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 1]  # the specials are control tokens
    assert len(fields["tokenizer.ggml.merges"]) > 0
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "blk.3.attn_q.weight", "output_norm.weight", "output.weight"} <= names
    back = load_gguf_model(path, torch.float32)[0].state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(back[name], value), name


def test_head_gguf_reads_back_and_drafts_the_same(zoo, exactness_log, tmp_path):
    head = eagle3_head()
    target_dir = save_model(tmp_path / "target", eagle3_target(), cached_tokenizer())
    path = write_head_gguf(head, target_dir, tmp_path / "eagle3.gguf")
    fields = {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == list(EAGLE3_LAYERS)
    assert fields["eagle3.target_hidden_size"] == 32 and fields["eagle3.block_count"] == 1
    loaded = read_head_gguf(path, zoo.backend(eagle3_target()))
    assert torch.equal(loaded.d2t, head.d2t)
    for name, value in head.state_dict().items():
        if name != "d2t":
            assert torch.equal(loaded.state_dict()[name], value.float().double()), name
    check_exact(zoo, exactness_log, loaded, "GGUF export")


# --------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    root = tmp_path_factory.mktemp("trio")
    target = save_model(root / "target", float32_target(), cached_tokenizer())
    draft = save_model(root / "draft", perturbed_copy(eagle3_target(), 0.1).float(), cached_tokenizer())
    return target, draft, save_head(eagle3_head(), root / "head")


def test_export_writes_every_engine_and_prints_its_commands(zoo, trio, tmp_path, capsys):
    target, draft, head = trio
    out = tmp_path / "out"
    argv = ["export", "-m", str(target), "-md", str(draft), "-me", str(head), "--out", str(out), "--json"]
    assert main(argv) == 0
    served = json.loads(capsys.readouterr().out)
    assert {(s["engine"], s["drafter"]) for s in served} == {
        (engine, drafter) for engine in ("vllm", "sglang", "llama.cpp") for drafter in ("eagle3", "draft")
    }
    lines = {(s["engine"], s["drafter"]): s["command"] for s in served}
    vllm = [s["command"] for s in served if s["engine"] == "vllm" and s["drafter"] == "eagle3"]
    model = str(out.resolve() / "vllm/eagle3")
    assert json.loads(vllm[0][-1]) == {"method": "eagle3", "model": model, "num_speculative_tokens": 3}
    assert vllm[1] == ["vllm", "serve", model]  # the verifier is named in the directory
    assert "--speculative-algorithm" in lines["sglang", "eagle3"]
    assert lines["llama.cpp", "draft"][-4:] == ["--spec-type", "draft-simple", "--spec-draft-n-max", "3"]
    assert (out / "commands.txt").read_text().count("\n# ") == len(served) - 1
    target_backend = zoo.backend(eagle3_target())
    for directory in (out / "vllm/eagle3", out / "sglang/eagle3"):
        assert load_head(directory, target_backend).config == as_saved(eagle3_head().config)
    from_gguf = read_head_gguf(out / "llama.cpp/eagle3.gguf", target_backend).config
    expected = as_saved(eagle3_head().config)
    assert replace(from_gguf, rms_norm_eps=expected.rms_norm_eps) == expected  # GGUF keeps float32
    assert load_gguf_model(out / "llama.cpp/draft.gguf", torch.float32)[0].config.num_hidden_layers == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engines", "vllm,trt"], "--engines takes"),
        (["--draft-max", "0"], "--spec-draft-n-max (--draft-max) must be >= 1"),
        (["--eagle3-layer-offset", "3"], "layers 0..4"),
    ],
)
def test_export_refuses_bad_input_and_writes_nothing(trio, tmp_path, capsys, extra, message):
    target, _, head = trio
    out = tmp_path / "out"
    assert main(["export", "-m", str(target), "-me", str(head), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_head_reading_layer_1_is_not_exported_for_sglang(trio, tmp_path, capsys):
    """Ids read with an offset of 0 from SpecForge's (1, 2, 3): SGLang would shift them again."""
    target, _, _ = trio
    head = save_head(eagle3_head(layer_ids=HIGH_LAYERS), tmp_path / "head")
    rewrite_ids(head, [1, 2, 3])
    argv = ["export", "-m", str(target), "-me", str(head), "--eagle3-layer-offset", "0"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "SGLang reads as SpecForge's" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main([*argv, "--out", str(tmp_path / "vllm"), "--engines", "vllm"]) == 0
    config = json.loads((tmp_path / "vllm/vllm/eagle3/config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM reads them as they are
