"""Context shift (llama.cpp's --context-shift): at a full context a generation drops tokens after
the first n_keep and goes on. Speculative output equals plain output token for token, and both
equal a reference that evaluates the shifted context from scratch at every token."""

from __future__ import annotations

import pytest
import torch
from conftest import TargetSpec, cached_tokenizer, draft_model, target_model
from fastapi.testclient import TestClient

from specdecode import (
    DraftModelConfig,
    GenerationConfig,
    HFBackend,
    Pipeline,
    SamplingParams,
    SpecdecodeError,
)
from specdecode.chat import encode
from specdecode.server import ServerSettings, create_app

SPEC = TargetSpec(seed=5, max_positions=64)  # a small context, shifted several times
GREEDY = SamplingParams(temperature=0)
PROMPT = "def f(x):\n    return x"


def pipeline(spec_types: list[str] | None) -> Pipeline:
    tokenizer = cached_tokenizer()
    return Pipeline(
        HFBackend(target_model(SPEC), tokenizer),
        HFBackend(draft_model(SPEC, 0.1), tokenizer),
        spec_types=spec_types,
        draft_config=DraftModelConfig(n_max=4, p_min=0.0),
    )


def shifted_reference(prompt: list[int], n: int, n_keep: int, n_discard: int) -> list[int]:
    """Greedy tokens of the target evaluated from scratch over the shifted context each time."""
    model, n_ctx, bos = target_model(SPEC), SPEC.max_positions, cached_tokenizer().bos_token_id
    keep = min(n_ctx - 4, (len(prompt) if n_keep < 0 else n_keep) + (prompt[0] == bos))
    history, out = list(prompt), []
    with torch.no_grad():
        while len(out) < n:
            if out:
                if len(history) + 1 > n_ctx:
                    left = len(history) - keep
                    drop = min(n_discard or left // 2, left - 1)
                    history = history[:keep] + history[keep + drop :]
                history.append(out[-1])
            out.append(int(model(torch.tensor([history])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize(("n_keep", "n_discard"), [(0, 0), (4, 0), (-1, 0), (2, 7)])
def test_shifted_generation_equals_plain_and_the_reference(exactness_log, n_keep, n_discard):
    prompt = encode(cached_tokenizer(), PROMPT)
    config = GenerationConfig(
        n_predict=150, ignore_eos=True, context_shift=True, n_keep=n_keep, n_discard=n_discard
    )
    plain = pipeline(None).generate(prompt, GREEDY, config)
    speculative = pipeline(["draft"]).generate(prompt, GREEDY, config)
    exactness_log.record("context-shift", "draft", speculative.stats, speculative.stats.stop_reason)
    assert plain.stats.n_context_shifts >= 2 and speculative.stats.n_context_shifts >= 2
    assert speculative.tokens == plain.tokens == shifted_reference(prompt, 150, n_keep, n_discard)
    assert speculative.stats.totals.n_accepted > 0  # drafts still run after a shift


def test_without_context_shift_a_full_context_ends_the_generation():
    config = GenerationConfig(n_predict=-1, ignore_eos=True)
    result = pipeline(["draft"]).generate(PROMPT, GREEDY, config)
    assert result.stats.stop_reason == "context" and result.stats.n_context_shifts == 0
    with pytest.raises(SpecdecodeError, match="exceeds the context"):
        pipeline(None).generate(PROMPT, GREEDY, GenerationConfig(n_predict=150))
    with pytest.raises(SpecdecodeError, match="n_keep"):
        GenerationConfig(context_shift=True, n_keep=-2)


def serve(context_shift: bool) -> TestClient:
    settings = ServerSettings(model_id="tiny", parallel=1, sampling=GREEDY, context_shift=context_shift)
    return TestClient(create_app(pipeline(["draft"]), settings))


def test_server_shifts_with_the_flag_and_n_keep_and_refuses_without_it(exactness_log):
    body = {"prompt": PROMPT, "n_predict": 120, "ignore_eos": True, "n_keep": 3, "return_tokens": True}
    with serve(context_shift=True) as client:
        reply = client.post("/completion", json=body)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["truncated"] is True and answer["tokens_predicted"] == 120
        config = GenerationConfig(n_predict=120, ignore_eos=True, context_shift=True, n_keep=3)
        expected = pipeline(None).generate(PROMPT, GREEDY, config)
        exactness_log.record("context-shift/server", "draft", expected.stats, expected.stats.stop_reason)
        assert answer["tokens"] == expected.tokens
        assert client.post("/completion", json={**body, "n_keep": -2}).status_code == 400
        openai = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 120})
        assert openai.status_code == 200  # past the context on OpenAI's endpoint too
    with serve(context_shift=False) as client:
        refused = client.post("/completion", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        whole = client.post("/completion", json={"prompt": PROMPT, "ignore_eos": True}).json()
        assert whole["truncated"] is True and whole["tokens_predicted"] + whole["tokens_evaluated"] == 64
        short = client.post("/completion", json={"prompt": PROMPT, "ignore_eos": True, "n_predict": 4})
        assert short.json()["truncated"] is False
