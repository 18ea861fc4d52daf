"""Verification on reduced rows: stage 1 of sampling run where the target's logits are.

- Stage 1: `top_k_rows` is the first k of a stable descending sort (ties by ascending id),
  `top_k_keyed` (one topk, no host synchronisation) gives the same, -0.0 and -inf included.
- Random cases: logits rows with ties, -inf entries and rows, a logit bias, every kind of
  top-k / top-p / min-p / temperature setting, chains and trees of random drafts (many
  accepted), end-of-generation ids, match and rejection verification with draft
  distributions: the reduced rows give the host rows' candidates, Verdict and sampler state,
  bit for bit (on a GPU too, where one is present).
- End to end: a graph-passes target on the CPU generates the same tokens with the reduced
  rows as with host rows (and, for chains, as plain generation does), greedy and seeded,
  with draft-model chains and trees, n-grams (point masses, for rejection), and a batch
  through the scheduler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_graph import graph
from test_native import IDS, bf16_draft, bf16_llama

import specdecode.generate
from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.graph import GraphBackend
from specdecode.drafts import Draft
from specdecode.sampling import (
    Sampler,
    apply_bias,
    candidates,
    reduce_rows,
    reducible,
    top_k_keyed,
    top_k_rows,
)
from specdecode.verify import verify_match, verify_rejection

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
N_CASES = 400


# --------------------------------------------------------------------------- stage 1


def tied_rows(rng: np.random.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of few distinct values (ties everywhere), some -inf, -0.0 and 0.0 among them."""
    x = torch.tensor(rng.integers(-3, 4, (rows, vocab)) * 0.5, dtype=dtype)
    x[torch.tensor(rng.random((rows, vocab)) < 0.2)] = -torch.inf
    x[torch.tensor(rng.random((rows, vocab)) < 0.1)] = -0.0
    x[-1] = -torch.inf
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_rows_is_the_first_k_of_a_stable_sort(dtype):
    rng = np.random.default_rng(0)
    for _ in range(50):
        vocab = int(rng.integers(2, 60))
        x = tied_rows(rng, 4, vocab, dtype)
        k = int(rng.integers(1, vocab + 1))
        values, ids = top_k_rows(x, k)
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ids, order)
        assert torch.equal(values, x.gather(-1, order))


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_keyed_equals_top_k_rows(device):
    rng = np.random.default_rng(1)
    for _ in range(50):
        vocab = int(rng.integers(2, 60))
        x = tied_rows(rng, 4, vocab, torch.float32)
        k = int(rng.integers(1, vocab + 1))
        values, ids = top_k_keyed(x.to(device), k)
        expected_values, expected_ids = top_k_rows(x.double(), k)
        assert torch.equal(ids.cpu(), expected_ids)
        assert torch.equal(values.cpu(), expected_values)


def test_reducible_only_where_stage_one_needs_no_history_and_keeps_few():
    vocab = 100
    assert reducible(SamplingParams(temperature=0), vocab)
    assert reducible(SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05), vocab)
    assert reducible(SamplingParams(temperature=0.8, logit_bias={3: 2.0, 5: -float("inf")}), vocab)
    assert not reducible(SamplingParams(temperature=0, repeat_penalty=1.1), vocab)
    assert not reducible(SamplingParams(temperature=0.8, presence_penalty=0.5), vocab)
    assert not reducible(SamplingParams(temperature=0.8, top_k=0), vocab)
    assert not reducible(SamplingParams(temperature=0.8, top_k=vocab), vocab)
    assert not reducible(SamplingParams(temperature=0, logit_bias=[(3, 1.0), (3, 2.0)]), vocab)


# --------------------------------------------------------------------------- random cases


def random_rows(rng: np.random.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Logits rows as a target's pass gives them to the host: float32 (float64 for float64
    models), smooth, tie-heavy or bfloat16-rounded, with -inf entries and whole -inf rows."""
    kind = int(rng.integers(3))
    if kind == 0:
        x = torch.tensor(rng.normal(0.0, 3.0, (rows, vocab)))
    elif kind == 1:
        x = torch.tensor(rng.integers(-4, 5, (rows, vocab)) * 0.75)
    else:
        x = torch.tensor(rng.normal(0.0, 8.0, (rows, vocab))).bfloat16().double()
    x = x.to(torch.float64 if rng.random() < 0.2 else torch.float32)
    x[torch.tensor(rng.random((rows, vocab)) < rng.choice([0.0, 0.3, 0.9]))] = -torch.inf
    x[torch.tensor(rng.random((rows, vocab)) < 0.03)] = -0.0
    x[torch.tensor(rng.random(rows) < 0.1)] = -torch.inf
    return x


def random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    greedy = rng.random() < 0.3
    bias: dict[int, float] = {}
    if rng.random() < 0.4:
        for token in rng.choice(vocab + 3, size=min(4, vocab), replace=False):  # some past the row
            bias[int(token)] = float(rng.choice([-np.inf, -3.0, 0.75, 2.5, 1e300]))
    return SamplingParams(
        temperature=0.0 if greedy else float(rng.choice([0.3, 0.8, 1.0, 2.0])),
        top_k=int(rng.choice([1, 2, 3, 10, 40, vocab - 1, vocab, 0])),
        top_p=float(rng.choice([1.0, 0.95, 0.6, 0.1])),
        min_p=float(rng.choice([0.0, 0.05, 0.5])),
        logit_bias=bias,
        seed=int(rng.integers(2**32)),
    )


def random_draft(
    rng: np.random.Generator, rows: torch.Tensor, params: SamplingParams, rejection: bool
) -> Draft:
    """A chain or a tree whose nodes are often a candidate of their parent's row (accepted
    paths), else any id; with the distributions they were drawn from, for rejection."""
    n, vocab = rows.shape[0] - 1, rows.shape[1]
    tree = n > 1 and rng.random() < 0.5
    parents = [int(rng.integers(-1, i)) for i in range(n)] if tree else list(range(-1, n - 1))
    tokens = []
    for parent in parents:
        kept, _ = candidates(rows[parent + 1], params, [])
        likely = len(kept) and rng.random() < 0.7
        tokens.append(int(rng.choice(kept.numpy())) if likely else int(rng.integers(vocab)))
    probs = None
    if rejection and n and rng.random() < 0.7:
        q = torch.tensor(rng.dirichlet(np.full(vocab + int(rng.choice([0, 3])), 0.3), n))
        q[range(n), tokens] += 0.2
        probs = (q / q.sum(-1, keepdim=True)).to(torch.float32 if rng.random() < 0.5 else torch.float64)
    return Draft(tokens, probs, parents=parents if tree else None)


@pytest.mark.parametrize("device", DEVICES)
def test_reduced_rows_verify_as_host_rows_bit_for_bit(device):
    rng = np.random.default_rng(2026)
    accepted = rejected = 0
    for _ in range(N_CASES):
        vocab = int(rng.choice([3, 17, 64, 200]))
        n = int(rng.integers(0, 7))
        rows = random_rows(rng, n + 1, vocab)
        params = random_params(rng, vocab)
        rejection = rng.random() < 0.5
        draft = random_draft(rng, rows, params, rejection)
        history = rng.integers(0, vocab, 5).tolist()
        eog = frozenset(int(t) for t in rng.choice(vocab, size=int(rng.integers(0, 3)), replace=False))
        reduced = reduce_rows(rows.to(device), params)
        if rows.dtype == torch.float32 and not params.greedy:  # a GPU's stage 1 (a CPU's is top_k_rows)
            k = params.top_k if 0 < params.top_k < vocab else vocab
            biased = apply_bias(rows, params)
            assert all(map(torch.equal, top_k_keyed(biased, k), top_k_rows(biased.double(), k)))
        for full, row in zip(rows, reduced, strict=True):
            host_ids, host_probs = candidates(full, params, history)
            ids, probs = candidates(row, params, history)
            assert torch.equal(ids, host_ids) and torch.equal(probs, host_probs)
        verify = verify_rejection if rejection else verify_match
        host_sampler, reduced_sampler = Sampler(params), Sampler(params)
        expected = verify(draft, rows, host_sampler, history, eog)
        verdict = verify(draft, reduced, reduced_sampler, history, eog)
        assert verdict == expected
        assert reduced_sampler.uniform() == host_sampler.uniform()  # the same draws were taken
        accepted += len(verdict.path) > 0
        rejected += len(verdict.path) < len(draft.tokens)
    assert accepted > N_CASES // 5 and rejected > N_CASES // 5  # both kinds of step were checked


# --------------------------------------------------------------------------- end to end

GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=0.8, seed=3)
SPECULATION = {
    "draft-chain": {"draft_config": DraftModelConfig(n_max=6, p_min=0.0)},
    "draft-tree": {"draft_config": DraftModelConfig(n_max=6, p_min=0.0, n_parallel=3, p_split=0.05)},
    "ngram": {"spec_types": ["ngram-cache"]},
}
RUNS = [("greedy", GREEDY, "match"), ("seeded", SEEDED, "match"), ("seeded", SEEDED, "rejection")]


@pytest.fixture
def reductions(monkeypatch) -> list[int]:
    """Rows reduced by the generation loop, one entry per call (how many rows)."""
    calls: list[int] = []
    real = specdecode.generate.reduce_rows

    def counted(logits: torch.Tensor, params: SamplingParams):
        calls.append(len(logits))
        return real(logits, params)

    monkeypatch.setattr(specdecode.generate, "reduce_rows", counted)
    return calls


def pipeline(kind: str | None) -> Pipeline:
    """A fixed-mode graph target, speculating as `kind` says (None: plain generation)."""
    if kind is None:
        return Pipeline(graph(bf16_llama()))
    options = SPECULATION[kind]
    # The chain's draft is the target's model (most of it accepted), the tree's a perturbed copy.
    model = bf16_llama() if kind == "draft-chain" else bf16_draft()
    draft = graph(model, "bucketed") if "draft_config" in options else None
    return Pipeline(graph(bf16_llama()), draft, **options)


def host_rows(monkeypatch, run):
    """What `run()` gives with every row copied to the host, as a target without the ability."""
    with monkeypatch.context() as patched:
        patched.setattr(GraphBackend, "logits_on_device", False)
        return run()


@pytest.mark.parametrize("name,sampling,verify", RUNS, ids=[f"{n}-{v}" for n, _, v in RUNS])
@pytest.mark.parametrize("kind", list(SPECULATION))
def test_graph_target_generates_the_same_tokens_from_reduced_rows(
    exactness_log, reductions, monkeypatch, kind, name, sampling, verify
):
    # n-grams find drafts in the repeats of the prompt, and later in what the model repeats
    config = GenerationConfig(n_predict=48 if kind == "ngram" else 24, ignore_eos=True, verify=verify)
    prompt = IDS[:8] * 3
    result = pipeline(kind).generate(prompt, sampling, config)
    assert reductions and max(reductions) > 1  # verify passes were reduced where they ran
    n_reduced = len(reductions)
    assert result.tokens == host_rows(
        monkeypatch, lambda: pipeline(kind).generate(prompt, sampling, config).tokens
    )
    assert len(reductions) == n_reduced  # forced off, nothing was reduced
    if kind != "ngram":  # the model does not repeat its prompt: n-gram drafts are rejected
        assert result.stats.totals.n_accepted > 0
    # Rejection sampling matches plain generation in distribution, not token for token; and
    # graph passes sum tree nodes in another order than plain chains.
    if verify == "match" and kind != "draft-tree":
        plain = host_rows(monkeypatch, lambda: pipeline(None).generate(prompt, sampling, config).tokens)
        assert result.tokens == plain
        exactness_log.record(f"graph-device/{name}-{verify}", kind, result.stats, dtype="bfloat16")


PENALISED = SamplingParams(temperature=0.8, seed=4, repeat_penalty=1.3)  # rows to the host
BATCHES = {"greedy": [GREEDY] * 4, "mixed": [SEEDED, PENALISED, GREEDY, SEEDED]}


@pytest.mark.parametrize("settings", list(BATCHES))
def test_a_batch_generates_the_same_tokens_from_reduced_rows(
    exactness_log, reductions, monkeypatch, settings
):
    """A batch through the scheduler, its passes shared; mixed: some sequences' rows reduced
    where the pass ran, a penalised one's copied to the host, in the same passes."""
    config = GenerationConfig(n_predict=16, ignore_eos=True)
    prompts = [IDS[i : i + 12] for i in range(0, 40, 10)]
    sampling = BATCHES[settings]
    batched = pipeline("draft-chain").generate_batch(prompts, sampling, config)
    assert max(reductions) > 1
    on_host = host_rows(
        monkeypatch, lambda: pipeline("draft-chain").generate_batch(prompts, sampling, config)
    )
    assert [result.tokens for result in batched] == [result.tokens for result in on_host]
    if settings == "greedy":
        plain = host_rows(
            monkeypatch, lambda: [pipeline(None).generate(p, GREEDY, config).tokens for p in prompts]
        )
        assert [result.tokens for result in batched] == plain
        for result in batched:
            exactness_log.record("graph-device/greedy-batch", "draft-chain", result.stats, dtype="bfloat16")
