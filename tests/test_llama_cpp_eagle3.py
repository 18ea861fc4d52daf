"""EAGLE-3 over a target on llama.cpp's kernels: the head reads the inputs of the target's layers,
which llama.cpp's staging API captures for every row of a pass (as its own EAGLE-3 drafting does).

- The captured rows are the Hugging Face forward's layer inputs (the embedding rows exactly,
  deeper ones to llama.cpp's float16 KV cache), and stay aligned with the cached positions
  through rollback and through a token tree's committed path.
- A head reading the last layer's output, which llama.cpp does not hand out, is refused.
- Greedy EAGLE-3 on a Q8_0 target (rows invariant in every build) equals plain generation on
  it, through `Pipeline.load` with the head's directory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import cached_tokenizer, eagle3_head, eagle3_target, in_dtype

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.backends.options import LoadOptions
from specdecode.errors import SpecdecodeError
from specdecode.strategies.eagle3_checkpoint import save_head
from specdecode.testing import save_model

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

LAYERS = (0, 1, 3)  # inputs of layers 0, 1 and 3 of the 4-layer target
OPTIONS = LoadOptions(backend="llama.cpp", threads=1, n_ctx=256)
IDS = list(range(3, 40))


@pytest.fixture(scope="module")
def target_files(tmp_path_factory) -> dict[str, object]:
    from specdecode.backends.gguf_files import export_gguf

    root = tmp_path_factory.mktemp("eagle3-gguf")
    model = in_dtype(eagle3_target(), torch.float32)
    directory = save_model(root / "target", model, cached_tokenizer())
    files = {fmt: export_gguf(directory, root / f"target-{fmt}.gguf", fmt) for fmt in ("f32", "q8_0")}
    with torch.no_grad():
        states = model(torch.tensor([IDS]), output_hidden_states=True).hidden_states
    return {**files, "reference": torch.cat([states[layer][0] for layer in LAYERS], dim=-1)}


def assert_rows_close(got: torch.Tensor, reference: torch.Tensor) -> None:
    """Embedding rows exact; deeper rows within 2% of their range (llama.cpp's float16 KV cache)."""
    width = reference.shape[1] // len(LAYERS)
    assert torch.equal(got[:, :width], reference[:, :width])
    assert torch.allclose(got, reference, atol=2e-2 * reference.abs().max().item(), rtol=0)


def test_captured_rows_are_the_layer_inputs_through_rollback_and_trees(target_files):
    backend = LlamaCppBackend.load(target_files["f32"], OPTIONS)
    backend.capture_hidden(LAYERS)
    reference = target_files["reference"]
    backend.evaluate(IDS[:20])
    backend.evaluate(IDS[20:])
    assert_rows_close(backend.hidden_states(0, len(IDS)), reference)
    backend.truncate(12)
    backend.evaluate(IDS[12:30])
    assert_rows_close(backend.hidden_states(0, 30), reference[:30])
    # a tree after position 30 whose committed path is IDS[30:33]: its rows come from a later pass
    backend.evaluate_tree([IDS[30], 90, IDS[31], IDS[32]], [-1, -1, 0, 2])
    backend.commit([0, 2, 3])
    assert backend.tokens == IDS[:33]
    assert_rows_close(backend.hidden_states(0, 33), reference[:33])
    backend.evaluate(IDS[33:])
    assert_rows_close(backend.hidden_states(0, len(IDS)), reference)


def test_a_head_reading_the_last_layers_output_is_refused(target_files):
    backend = LlamaCppBackend.load(target_files["f32"], OPTIONS)
    with pytest.raises(SpecdecodeError, match=r"not layer ids \[4\] .*--backend native"):
        backend.capture_hidden((0, 2, 4))


@pytest.mark.parametrize("n_max", [2, 6])
def test_greedy_eagle3_on_llama_cpp_equals_plain(target_files, tmp_path, exactness_log, n_max):
    head = save_head(copy.deepcopy(eagle3_head(layer_ids=LAYERS)), tmp_path / "head", torch.float32)
    target = target_files["q8_0"]
    greedy, config = SamplingParams(temperature=0), GenerationConfig(n_predict=40, ignore_eos=True)
    prompt = list(range(3, 20))
    expected = Pipeline.load(target, target_options=OPTIONS).generate(prompt, greedy, config)
    pipe = Pipeline.load(
        target, eagle3=head, target_options=OPTIONS, draft_config=DraftModelConfig(n_max=n_max, p_min=0.0)
    )
    assert isinstance(pipe.target, LlamaCppBackend) and pipe.target.invariant
    result = pipe.generate(prompt, greedy, config)
    assert result.tokens == expected.tokens
    assert 0 < result.stats.totals.n_accepted < result.stats.totals.n_drafted
    exactness_log.record(
        "eagle3-llama.cpp/greedy", "trained head", result.stats, result.stats.stop_reason, "q8_0"
    )


def test_a_heads_batch_keeps_contexts_of_its_own(target_files, tmp_path, exactness_log):
    """Forks sharing one context capture no hidden states: a head's target forks one context
    per sequence, and its batches still answer each prompt as plain generation does."""
    head = save_head(copy.deepcopy(eagle3_head(layer_ids=LAYERS)), tmp_path / "head", torch.float32)
    target = target_files["q8_0"]
    greedy, config = SamplingParams(temperature=0), GenerationConfig(n_predict=16, ignore_eos=True)
    pipe = Pipeline.load(
        target, eagle3=head, target_options=OPTIONS, draft_config=DraftModelConfig(n_max=4, p_min=0.0)
    )
    assert all(type(seat.target) is LlamaCppBackend for seat in pipe.forks(2))
    prompts = [list(range(3, 20)), list(range(20, 31))]
    plain = Pipeline.load(target, target_options=OPTIONS)
    for prompt, result in zip(prompts, pipe.generate_batch(prompts, greedy, config), strict=True):
        assert result.tokens == plain.generate(prompt, greedy, config).tokens
        exactness_log.record(
            "eagle3-llama.cpp/batch-greedy", "trained head", result.stats, result.stats.stop_reason, "q8_0"
        )
