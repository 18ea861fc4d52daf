"""A draft model's greedy steps on the device (`backends.graph_draft`), run here on the CPU
without CUDA graphs: the draft a step-by-step draft makes, the same cuts, and the cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import VOCAB_SIZE, cached_tokenizer
from test_native import IDS, bf16_draft, family_model

from specdecode.backends.graph import GraphBackend
from specdecode.backends.graph_draft import DEVICE_DRAFT_STEPS
from specdecode.config import DraftModelConfig
from specdecode.strategies.draft_model import DraftModelStrategy


def strategy(model, mode_rows: int | None, **config) -> DraftModelStrategy:
    backend = GraphBackend(model, cached_tokenizer(), fixed_rows=mode_rows)
    return DraftModelStrategy(backend, DraftModelConfig(**config), target_vocab_size=VOCAB_SIZE)


def on_host(monkeypatch, draft: DraftModelStrategy) -> None:
    monkeypatch.setattr(draft, "_drafts_on_device", lambda: False)


@pytest.mark.parametrize("rows", [32, None], ids=["fixed", "bucketed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n_max, p_min", [(1, 0.0), (3, 0.0), (4, 0.0), (9, 0.0), (9, 0.3), (16, 0.6)])
def test_device_steps_draft_what_host_steps_draft(monkeypatch, rows, dtype, n_max, p_min):
    model = family_model("llama-gqa") if dtype == torch.float64 else bf16_draft()
    device, host = (
        strategy(model, rows, n_max=n_max, p_min=p_min),
        strategy(model, rows, n_max=n_max, p_min=p_min),
    )
    on_host(monkeypatch, host)
    calls = []
    original = GraphBackend.draft_greedy
    monkeypatch.setattr(
        GraphBackend, "draft_greedy", lambda self, *a: calls.append(a[1]) or original(self, *a)
    )
    history = list(IDS[:30])
    for round_ in range(4):  # the context grows as a generation's does: cached prefixes are reused
        drafts = [draft.draft(history, IDS[30 + round_], n_max) for draft in (device, host)]
        assert drafts[0].tokens == drafts[1].tokens
        assert drafts[0].confidences == drafts[1].confidences
        history = [*history, IDS[30 + round_], *drafts[1].tokens[:1]]
    assert calls and max(calls) <= DEVICE_DRAFT_STEPS


def test_a_call_runs_only_as_far_as_the_draft_reads(monkeypatch):
    draft = strategy(family_model("llama-gqa"), 32, n_max=9, p_min=0.0)
    calls = []
    original = GraphBackend.draft_greedy
    monkeypatch.setattr(
        GraphBackend, "draft_greedy", lambda self, *a: calls.append(a[1:3]) or original(self, *a)
    )
    context = [*IDS[:20], IDS[20]]
    result = draft.draft(IDS[:20], IDS[20], 9)
    # three calls (4 + 4 + 1 steps), the last evaluating nothing past the ninth token
    assert len(result.tokens) == 9 and calls == [(4, True), (4, True), (1, False)]
    assert draft.backend.tokens == [*context, *result.tokens[:8]]
    calls.clear()
    draft.config = dataclasses.replace(
        draft.config, p_min=1.0
    )  # nothing is confident enough: the first call's steps are wasted
    assert draft.draft(IDS[:20], IDS[20], 9).tokens == [] and calls == [(4, True)]


def test_recorded_hidden_states_keep_the_host_steps():
    draft = strategy(family_model("llama-gqa"), 32)
    assert draft._drafts_on_device()
    draft.backend.capture_hidden([0])
    assert not draft._drafts_on_device()  # device steps record no hidden states
