"""Training an EAGLE-3 head for any local causal-LM target, with EAGLE-3's training-time test.

Each batch runs the frozen target once (recording its features at the head's layers and
its next-token distributions), then unrolls the head `unroll` times over the same tokens:
step 0 reads g = fc(target features); step j reads, at position p, the head's own
pre-norm state of step j-1 at position p-1, exactly what drafting feeds it j tokens past
the verified prefix, under the attention mask that drafting implies (see
`head.unrolled_attention`). The loss is the cross-entropy of the head's distribution against
the target's (restricted to the draft vocabulary and renormalised), averaged over the
positions each step can reach, weighted 0.8^j and summed over steps (EAGLE-3's weighting).

The draft vocabulary is the `draft_vocab` most frequent target ids of the training tokens.
The head shares the target's embeddings (neither trained nor saved) and starts from the
target's final norm and the draft-vocabulary rows of its output head, so its output space
means something from the first step. Loop, checkpoints, resumption, seeding and bf16
autocast are `specdecode.train.lm`'s. The trained head's confidence is then calibrated (see
`calibrate_eagle3`), as a distilled draft's is; `calibrate_saved_head` does that alone for a head
already on disk.

Self-distillation (`generated_tokens` > 0, EAGLE's recipe): the head is trained, and
calibrated, on text the target wrote instead of the corpus. At drafting time the head
continues the target's own output, which is far more predictable than human text (all the
more from a small target), so a head trained on the corpus learns the wrong distribution of
contexts. Each sequence is a random `PREFIX_TOKENS`-token cut of the corpus followed by the
target's `NEW_TOKENS` greedy tokens; the sequences are kept in out_dir (`GENERATED_FILE`), so
a resumed run does not generate them again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from specdecode.backends.hf import HFBackend, LoadOptions, cache_keyword
from specdecode.errors import SpecdecodeError
from specdecode.strategies.eagle3_checkpoint import check_fits, load_head, save_head
from specdecode.strategies.eagle3_head import Eagle3Config, Eagle3Head, read_target, unrolled_states
from specdecode.strategies.eagle3_layouts import default_layer_ids
from specdecode.train import distributed, lm
from specdecode.train.calibrate_eagle3 import calibrate_head
from specdecode.train.config import NEW_TOKENS, PREFIX_TOKENS, HeadShape, TrainConfig
from specdecode.train.lm import LossFn

STEP_WEIGHT = 0.8  # weight of unroll step j: STEP_WEIGHT ** j
GENERATED_FILE = "tokens-generated.npy"
GENERATION_BATCH = 32  # sequences generated together


def draft_vocabulary(tokens: np.ndarray, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent ids of `tokens` (ties: the lower id), sorted ascending."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(order)).to(torch.long)


def head_config(target: nn.Module, shape: HeadShape, draft_vocab: int) -> Eagle3Config:
    c = target.config
    hidden, layers = int(c.hidden_size), int(c.num_hidden_layers)
    if hidden % shape.heads or shape.heads % shape.kv_heads:
        raise SpecdecodeError(f"heads must divide the hidden size {hidden} and kv_heads must divide heads")
    rope = getattr(c, "rope_parameters", None) or {}
    config = Eagle3Config(
        hidden_size=hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        target_hidden_size=hidden,
        target_layer_ids=tuple(shape.layer_ids or default_layer_ids(layers)),
        vocab_size=int(target.get_output_embeddings().weight.shape[0]),
        draft_vocab_size=draft_vocab,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-5)),
        rope_theta=float(getattr(c, "rope_theta", None) or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(c.max_position_embeddings),
    )
    check_fits(config, layers, hidden, config.vocab_size, "the new head")
    return config


def new_head(target: nn.Module, shape: HeadShape, d2t: torch.Tensor, seed: int) -> Eagle3Head:
    """A head for `target` (a transformers causal LM): seeded init, the target's output norm
    and draft-vocabulary output rows, the target's embeddings shared."""
    config = head_config(target, shape, len(d2t))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(config, target.get_input_embeddings().weight)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[d2t])
        final_norm = getattr(target.get_decoder(), "norm", None)
        if final_norm is not None:
            head.norm.weight.copy_(final_norm.weight)
    weight = next(target.parameters())
    return head.to(device=weight.device, dtype=weight.dtype)


def ttt_loss(target: nn.Module, unroll: int) -> LossFn:
    """The training-time-test loss of a head over batches [B, T+1] of target ids."""

    def loss_fn(head: Eagle3Head, batch: torch.Tensor) -> torch.Tensor:
        logits, feats = read_target(target, head.config.target_layer_ids, batch)
        wanted = torch.softmax(logits[:, 1:, head.d2t].float(), dim=-1)  # [B, T, V_draft]
        g = head.fc(feats.to(head.fc.weight.dtype))  # [B, T, H]
        total, weights = 0.0, 0.0
        for step, h in enumerate(unrolled_states(head, batch[:, 1:], g, unroll)):
            log_q = F.log_softmax(head.logits(h).float(), dim=-1)
            cross_entropy = -(wanted * log_q).sum(-1)  # [B, T]
            total = total + STEP_WEIGHT**step * cross_entropy[:, step:].mean()
            weights += STEP_WEIGHT**step
        return total / weights

    return loss_fn


@torch.no_grad()
def greedy_continuations(target: nn.Module, prefixes: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prefixes [B, P] followed by the target's `new_tokens` greedy tokens: [B, P + new_tokens].
    One pass per token over the target's KV cache; no stop at EOS (the target goes on to what
    it would write after it)."""
    keyword = cache_keyword(target)
    out = target(input_ids=prefixes, use_cache=True)
    new = [out.logits[:, -1:].argmax(-1)]  # [B, 1] each
    while len(new) < new_tokens:
        out = target(input_ids=new[-1], **{keyword: out[keyword]}, use_cache=True)
        new.append(out.logits[:, -1:].argmax(-1))
    return torch.cat([prefixes, *new], dim=1)


def sequence_count(n_tokens: int) -> int:
    """Sequences needed for n_tokens generated tokens (NEW_TOKENS each, rounded up)."""
    return -(-n_tokens // NEW_TOKENS)


def generate_sequences(
    target: nn.Module, tokens: np.ndarray, n_tokens: int, seed: int, progress: bool = True
) -> np.ndarray:
    """ceil(n_tokens / NEW_TOKENS) sequences [S, PREFIX_TOKENS + NEW_TOKENS] (int32): corpus
    prefixes cut at random (seeded) positions, each followed by the target's greedy continuation."""
    if len(tokens) < PREFIX_TOKENS:
        raise SpecdecodeError(f"{len(tokens)} corpus tokens cannot give a {PREFIX_TOKENS}-token prefix")
    count = sequence_count(n_tokens)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - PREFIX_TOKENS + 1, (count,), generator=generator).numpy()
    prefixes = torch.from_numpy(tokens[starts[:, None] + np.arange(PREFIX_TOKENS)].astype(np.int64))
    device = next(target.parameters()).device
    rank, size = distributed.world()
    mine = torch.tensor_split(prefixes, size)[rank]  # each process continues its share
    bar = tqdm(total=len(mine) * NEW_TOKENS, disable=not progress, unit="tok", desc="generating")
    rows = [torch.zeros(0, PREFIX_TOKENS + NEW_TOKENS, dtype=torch.long)]
    for first in range(0, len(mine), GENERATION_BATCH):
        batch = mine[first : first + GENERATION_BATCH].to(device)
        rows.append(greedy_continuations(target, batch, NEW_TOKENS).cpu())
        bar.update(len(batch) * NEW_TOKENS)
    bar.close()
    return distributed.gather_rows(torch.cat(rows).numpy().astype(np.int32))


def generated_sequences(
    target: nn.Module, tokens: np.ndarray, n_tokens: int, out_dir: Path, seed: int, progress: bool
) -> np.ndarray:
    """`generate_sequences`, kept in out_dir/GENERATED_FILE and read back from there."""
    path = out_dir / GENERATED_FILE
    if path.exists():
        sequences = np.load(path)
        wanted = (sequence_count(n_tokens), PREFIX_TOKENS + NEW_TOKENS)
        if sequences.shape != wanted:
            raise SpecdecodeError(
                f"{path} holds sequences of shape {sequences.shape}, not the {wanted} that "
                f"{n_tokens} generated tokens make; use another output directory or delete it"
            )
        return sequences
    sequences = generate_sequences(target, tokens, n_tokens, seed, progress)
    if distributed.is_main():
        out_dir.mkdir(parents=True, exist_ok=True)
        np.save(path, sequences)
    return sequences


def frozen_teacher(target_dir: Path, config: TrainConfig) -> tuple[TrainConfig, nn.Module, int]:
    """The frozen float32 target a drafter learns from, on the run's device; the config with the
    precision that device allows; the target's vocabulary size."""
    device = lm.prepare(config)
    config = lm.with_precision(config, device)
    teacher = HFBackend.load(target_dir, LoadOptions(device=device.type, dtype="float32"))
    return config, teacher.model.eval().requires_grad_(False), teacher.vocab.size


def self_distilled(
    target: nn.Module,
    tokens: np.ndarray,
    generated_tokens: int,
    out_dir: Path,
    config: TrainConfig,
    progress: bool,
    vocab_size: int,
) -> np.ndarray:
    """The tokens to train on: `tokens` as they are, or (generated_tokens > 0) that many tokens
    the target generates from prefixes of them (`generated_sequences`), as one stream like the
    corpus: a window may span the end of one sequence and the next."""
    if not generated_tokens:
        return tokens
    sequences = generated_sequences(target, tokens, generated_tokens, out_dir, config.seed, progress)
    tokens = sequences.reshape(-1)
    lm.check_tokens(tokens, config, vocab_size)
    return tokens


def train_eagle3(
    tokens: np.ndarray,
    target_dir: Path,
    out_dir: Path,
    shape: HeadShape,
    config: TrainConfig,
    progress: bool = True,
    generated_tokens: int = 0,
    on_start: Callable[[], None] | None = None,
) -> Path:
    """Train a head for the causal LM in target_dir on `tokens` (ids of its tokenizer), or, when
    generated_tokens > 0, on that many tokens the target generates from prefixes of them; write
    config.json, model.safetensors and train_log.json into out_dir, resuming from
    out_dir/checkpoint/ if present. on_start: see `lm.train_loop`."""
    if generated_tokens < 0:
        raise SpecdecodeError(f"generated_tokens must be >= 0 (0: the corpus), not {generated_tokens}")
    out_dir = Path(out_dir)
    config, target, vocab_size = frozen_teacher(target_dir, config)
    lm.check_tokens(tokens, config, vocab_size)
    head_config(target, shape, min(shape.draft_vocab, vocab_size))  # refused before any generation
    tokens = self_distilled(target, tokens, generated_tokens, out_dir, config, progress, vocab_size)
    d2t = draft_vocabulary(tokens, vocab_size, shape.draft_vocab)
    head = new_head(target, shape, d2t, config.seed)
    identity = {**lm.run_identity("eagle3", shape, config), "vocab_size": vocab_size}
    if generated_tokens:
        identity["generated_tokens"] = generated_tokens
    identity["shape"] = asdict(shape) | {"layer_ids": list(head.config.target_layer_ids)}
    positions = int(target.config.max_position_embeddings) - 1  # the target reads T+1 tokens
    log = lm.train_loop(
        head, ttt_loss(target, shape.unroll), tokens, out_dir, identity, config, progress, positions, on_start
    )
    head.eval()
    if not distributed.is_main():
        return out_dir
    if config.calibration_windows:
        log["calibration"] = calibrate_head(
            target, head, tokens, config.calibration_windows, config.seq_len, shape.unroll, config.seed
        )
    save_head(head, out_dir, lm.SAVE_DTYPES[config.save_dtype])
    lm.write_log(out_dir, log)
    return out_dir


def calibrate_saved_head(
    target_dir: Path,
    head_dir: Path,
    corpus: Callable[[PreTrainedTokenizerBase], np.ndarray],
    unroll: int,
    config: TrainConfig,
) -> dict:
    """Calibrate the head in head_dir for the causal LM in target_dir and save it in place
    (config.save_dtype), without training; returns what a training log records. `corpus` encodes
    the calibration data with the target's tokenizer; it runs only once the head has loaded, so
    a wrong directory fails before a corpus is encoded."""
    if not config.calibration_windows:
        raise SpecdecodeError("calibrating a head needs calibration_windows >= 1")
    device = lm.prepare(config)
    teacher = HFBackend.load(target_dir, LoadOptions(device=device.type, dtype="float32"))
    head = load_head(head_dir, teacher)
    positions = int(teacher.model.config.max_position_embeddings) - 1  # the target reads T+1 tokens
    if config.seq_len > positions:
        raise SpecdecodeError(f"seq_len {config.seq_len} exceeds the target's {positions} positions")
    tokens = corpus(teacher.tokenizer)
    lm.check_tokens(tokens, config, teacher.vocab.size)
    record = calibrate_head(
        teacher.model, head, tokens, config.calibration_windows, config.seq_len, unroll, config.seed
    )
    save_head(head, head_dir, lm.SAVE_DTYPES[config.save_dtype])
    return record
