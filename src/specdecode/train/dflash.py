"""Training a DFlash drafter (block diffusion; arXiv 2602.06036) for any local causal-LM target.

A drafter proposes a block at once: after verified tokens 0..p-1 and the token p they end with,
the block [token p, mask, ..., mask] at positions p..p+B-1 attends to the context rows of
positions 0..p-1 (the fused target features) and to itself, and position p+i is read as the
guess of token p+i. Training does the same for many anchors p of a sequence at once, after one
pass of the frozen target over it: every block's rows see the context rows before its anchor
and the rows of their own block, never another block's (`block_layout`), which is exactly
what drafting sees. Position p+i learns the target's distribution at p+i-1 (cross-entropy
against its softmax), weighted exp(-(i-1)/gamma) along the block: later positions are reached
only when the earlier ones are accepted. The paper's gamma is 7 for blocks of 16; here it is
scaled with the block, gamma = 7 B / 16.

Anchors are drawn at random for each sequence, from a generator seeded by its tokens, so a
run carries no random state, resumes exactly (see `specdecode.train.lm`) and draws the same
anchors in one process as in several.

The drafter starts from the target: its layers from the target's last layers wherever a
tensor's name and shape agree (a drafter narrower than the target keeps its own init there),
its output norm from the target's final norm; embeddings and output head are the target's,
never trained or saved. The mask token is the target's pad token unless one is given: an id
the vocabulary has that text never holds, whose embedding is not zero. Self-distillation
(training on the target's own greedy continuations) is EAGLE-3's
(`train.eagle3.generated_sequences`), and so are the loop, checkpoints and precision
(`train.lm`). The result is z-lab's layout (`dflash_checkpoint`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from specdecode.backends.hf import HFBackend, LoadOptions
from specdecode.errors import SpecdecodeError
from specdecode.strategies.dflash_checkpoint import check_fits, load_head, save_head
from specdecode.strategies.dflash_head import DFlashConfig, DFlashHead, default_layer_ids
from specdecode.strategies.draft_model import CONFIDENCE_TOP_K
from specdecode.strategies.eagle3_head import read_target
from specdecode.train import distributed, lm
from specdecode.train.calibrate import fit_scale, sample_windows, summary
from specdecode.train.config import DFlashShape, TrainConfig
from specdecode.train.eagle3 import frozen_teacher, self_distilled
from specdecode.train.lm import LossFn

PAPER_GAMMA, PAPER_BLOCK = 7.0, 16  # the loss decay the paper uses for blocks of 16
TRAINED_LAYERS = 2  # target layers a drafter made here reads, unless told (z-lab's spread)


def mask_token(target: nn.Module, shape: DFlashShape) -> int:
    """The id the block's undrafted rows hold: the shape's, else the target's pad token. Its
    embedding must not be zero: a zero row normalises to zero, so every masked row would ask
    the same (empty) query and a one-layer drafter could not tell its positions apart."""
    mask = shape.mask_token_id
    if mask is None:
        mask = getattr(target.config, "pad_token_id", None)
        if mask is None:
            raise SpecdecodeError(
                "the target has no pad token to use as the drafter's mask token; give one with "
                "--mask-token-id (an id of its vocabulary that text never holds)"
            )
    embeddings = target.get_input_embeddings().weight
    if 0 <= mask < len(embeddings) and not embeddings[mask].any():
        raise SpecdecodeError(
            f"the target's embedding of token {mask}, the mask token asked for, is all zeros (an "
            "untrained pad?): masked rows would all look alike; give --mask-token-id, another id "
            "that text never holds (in a byte-level BPE, the token of byte 0xC0, which UTF-8 lacks)"
        )
    return int(mask)


def head_config(target: nn.Module, shape: DFlashShape) -> DFlashConfig:
    c = target.config
    hidden, layers = int(c.hidden_size), int(c.num_hidden_layers)
    vocab = int(target.get_output_embeddings().weight.shape[0])
    rope = getattr(c, "rope_parameters", None) or {}
    config = DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        target_layer_ids=tuple(shape.layer_ids or default_layer_ids(layers, TRAINED_LAYERS)),
        block_size=shape.block_size,
        mask_token_id=mask_token(target, shape),
        vocab_size=vocab,
        head_dim=shape.head_dim,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(c, "rope_theta", None) or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(c.max_position_embeddings),
    )
    check_fits(config, layers, hidden, vocab, "the new drafter")
    return config


def new_head(target: nn.Module, shape: DFlashShape, seed: int) -> DFlashHead:
    """A drafter for `target` (a transformers causal LM): seeded init, then the target's last
    layers and final norm wherever shapes agree; the target's embeddings and output head shared."""
    config = head_config(target, shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = DFlashHead(config, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    weight = next(target.parameters())
    head = head.to(device=weight.device, dtype=weight.dtype)  # before copying: no rounding on the way
    decoder = target.get_decoder()
    sources = list(decoder.layers)[-len(head.layers) :]
    with torch.no_grad():
        for layer, source in zip(head.layers, sources, strict=False):
            theirs = source.state_dict()
            for name, value in layer.state_dict().items():
                if name in theirs and theirs[name].shape == value.shape:
                    value.copy_(theirs[name])
        final_norm = getattr(decoder, "norm", None)
        if final_norm is not None:
            head.norm.weight.copy_(final_norm.weight)
    return head


def gamma(block_size: int) -> float:
    """The loss decay's length for blocks of `block_size`: the paper's 7 for 16, scaled."""
    return PAPER_GAMMA * block_size / PAPER_BLOCK


def decay(block_size: int) -> torch.Tensor:
    """The loss weight of drafted positions i = 1..B-1 of a block: exp(-(i-1)/gamma)."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float64) / gamma(block_size))


def block_layout(anchors: torch.Tensor, block_size: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks at `anchors` [A] over `context` context rows (positions 0..context-1): the blocks'
    positions [A * B] and what each block row sees, [A * B, context + A * B] (bool): the context
    rows before its anchor and the rows of its own block."""
    device = anchors.device
    owner = torch.arange(len(anchors), device=device).repeat_interleave(block_size)  # [A * B]
    positions = anchors[owner] + torch.arange(block_size, device=device).repeat(len(anchors))
    sees_context = torch.arange(context, device=device)[None] < anchors[owner][:, None]
    return positions, torch.cat([sees_context, owner[:, None] == owner[None]], dim=1)


def draw_anchors(sequence: torch.Tensor, count: int, block_size: int) -> torch.Tensor:
    """`count` distinct anchors (ascending) in a sequence [T+1], every block inside it and after
    at least one context row: p in 1..T+1-B. Drawn from the sequence's own tokens, so a run
    carries no random state and a sequence gets the same anchors in any process."""
    choices = len(sequence) - block_size  # anchors 1 .. T+1-B
    if choices < 1:
        raise SpecdecodeError(f"{len(sequence)} tokens hold no block of {block_size} after a token")
    generator = torch.Generator().manual_seed(zlib.crc32(sequence.cpu().numpy().tobytes()))
    picked = torch.randperm(choices, generator=generator)[: min(count, choices)] + 1
    return picked.sort().values.to(sequence.device)


def dflash_loss(target: nn.Module, anchors: int) -> LossFn:
    """The anchored block loss of a drafter over batches [B, T+1] of target ids: one target pass,
    then each sequence's blocks in one drafter pass."""

    def loss_fn(head: DFlashHead, batch: torch.Tensor) -> torch.Tensor:
        c = head.config
        logits, feats = read_target(target, c.target_layer_ids, batch)  # [B, T+1, V], [B, T, F]
        context = head.context(feats)
        context_positions = torch.arange(feats.shape[1], device=batch.device)
        weights = decay(c.block_size).to(device=batch.device, dtype=torch.float32)
        losses = []
        for sequence, rows, wanted_logits in zip(batch, context, logits, strict=True):
            starts = draw_anchors(sequence, anchors, c.block_size)
            positions, visible = block_layout(starts, c.block_size, len(context_positions))
            tokens = torch.full_like(positions, c.mask_token_id)
            tokens[:: c.block_size] = sequence[starts]
            states = head.blocks(head.embed(tokens[None]), positions, rows[None], context_positions, visible)
            drafted = states[0].unflatten(0, (len(starts), c.block_size))[:, 1:]  # [A, B-1, H]
            wanted_at = positions.view(len(starts), c.block_size)[:, 1:] - 1  # the target's row of each guess
            wanted = torch.softmax(wanted_logits[wanted_at].float(), dim=-1)  # [A, B-1, V]
            log_q = F.log_softmax(head.logits(drafted).float(), dim=-1)
            cross_entropy = -(wanted * log_q).sum(-1)  # [A, B-1]
            losses.append((cross_entropy * weights).sum(-1).mean() / weights.sum())
        return torch.stack(losses).mean()

    return loss_fn


def train_dflash(
    tokens: np.ndarray,
    target_dir: Path,
    out_dir: Path,
    shape: DFlashShape,
    config: TrainConfig,
    progress: bool = True,
    generated_tokens: int = 0,
    on_start: Callable[[], None] | None = None,
) -> Path:
    """Train a drafter for the causal LM in target_dir on `tokens` (ids of its tokenizer), or, when
    generated_tokens > 0, on that many tokens the target generates from prefixes of them (see
    `train.eagle3`); write config.json, model.safetensors and train_log.json into out_dir,
    resuming from out_dir/checkpoint/ if present. on_start: see `lm.train_loop`."""
    if generated_tokens < 0:
        raise SpecdecodeError(f"generated_tokens must be >= 0 (0: the corpus), not {generated_tokens}")
    if config.seq_len < shape.block_size:
        raise SpecdecodeError(f"seq_len {config.seq_len} holds no block of {shape.block_size} after a token")
    out_dir = Path(out_dir)
    config, target, vocab_size = frozen_teacher(target_dir, config)
    lm.check_tokens(tokens, config, vocab_size)
    head_config(target, shape)  # refused before any generation
    tokens = self_distilled(target, tokens, generated_tokens, out_dir, config, progress, vocab_size)
    head = new_head(target, shape, config.seed)
    used = {"layer_ids": list(head.config.target_layer_ids), "mask_token_id": head.config.mask_token_id}
    identity = {**lm.run_identity("dflash", shape, config), "vocab_size": vocab_size}
    identity["shape"] = asdict(shape) | used
    if generated_tokens:
        identity["generated_tokens"] = generated_tokens
    positions = int(target.config.max_position_embeddings) - 1  # the target reads T+1 tokens
    loss_fn = dflash_loss(target, shape.anchors)
    log = lm.train_loop(head, loss_fn, tokens, out_dir, identity, config, progress, positions, on_start)
    if not distributed.is_main():
        return out_dir
    log["loss_decay_gamma"] = gamma(shape.block_size)
    head.eval()
    if config.calibration_windows:
        log["calibration"] = calibrate_head(
            target, head, tokens, config.calibration_windows, config.seq_len, config.seed
        )
    save_head(head, out_dir, lm.SAVE_DTYPES[config.save_dtype])
    lm.write_log(out_dir, log)
    return out_dir


@torch.no_grad()
def agreement_sample(
    target: nn.Module, head: DFlashHead, windows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over windows [W, T+1], for every block that fits (anchors 1..T+1-B) and each drafted
    position i = 1..B-1: the drafter's 10 largest logits [N, 10] (float64), whether its argmax
    is the target's there [N] (bool), and i [N]."""
    c = head.config
    device = head.fc.weight.device
    tops, agreements, offsets = [], [], []
    for window in windows:
        batch = window[None].to(device)
        logits, feats = read_target(target, c.target_layer_ids, batch)
        starts = torch.arange(1, batch.shape[1] - c.block_size + 1, device=device)
        positions, visible = block_layout(starts, c.block_size, feats.shape[1])
        tokens = torch.full_like(positions, c.mask_token_id)
        tokens[:: c.block_size] = batch[0, starts]
        context_positions = torch.arange(feats.shape[1], device=device)
        states = head.blocks(
            head.embed(tokens[None]), positions, head.context(feats), context_positions, visible
        )
        drafted = head.logits(states[0].unflatten(0, (len(starts), c.block_size))[:, 1:]).float()
        wanted = logits[0, positions.view(len(starts), c.block_size)[:, 1:] - 1].argmax(-1)  # [A, B-1]
        agreements.append((drafted.argmax(-1) == wanted).flatten().cpu())
        tops.append(torch.topk(drafted, CONFIDENCE_TOP_K).values.flatten(0, 1).cpu().double())
        offsets.append(torch.arange(1, c.block_size).repeat(len(starts)))
    return torch.cat(tops), torch.cat(agreements), torch.cat(offsets)


def calibrate_head(
    target: nn.Module, head: DFlashHead, tokens: np.ndarray, n_windows: int, seq_len: int, seed: int
) -> dict:
    """Fit one logit scale β on `n_windows` random windows of `tokens`, as a distilled draft's
    (`specdecode.train.calibrate`): the strategy stops a block's chain at the first position
    whose top-1 probability is below p_min, which then reads as the chance the target agrees.
    β goes into the final norm, so argmaxes, hence greedy drafts, are unchanged. Returns what the
    training log records, with each block position's agreement and confidence."""
    windows = sample_windows(tokens, n_windows, seq_len + 1, seed)
    top_logits, agree, offsets = agreement_sample(target, head, windows)
    scale = fit_scale(top_logits, agree)
    with torch.no_grad():
        head.norm.weight.mul_(scale)
    per_position = [
        summary(top_logits[offsets == i], agree[offsets == i], scale) for i in offsets.unique().tolist()
    ]
    return {"scale": scale, **summary(top_logits, agree, scale), "block_positions": per_position}


def calibrate_saved_head(
    target_dir: Path,
    head_dir: Path,
    corpus: Callable[[PreTrainedTokenizerBase], np.ndarray],
    config: TrainConfig,
) -> dict:
    """Calibrate the drafter in head_dir for the causal LM in target_dir and save it in place
    (config.save_dtype), without training. `corpus` encodes the data with the target's tokenizer
    once the drafter has loaded, so a wrong directory fails before a corpus is encoded."""
    if not config.calibration_windows:
        raise SpecdecodeError("calibrating a drafter needs calibration_windows >= 1")
    device = lm.prepare(config)
    teacher = HFBackend.load(target_dir, LoadOptions(device=device.type, dtype="float32"))
    head = load_head(head_dir, teacher)
    if config.seq_len < head.config.block_size:
        raise SpecdecodeError(
            f"seq_len {config.seq_len} holds no block of {head.config.block_size} after a token"
        )
    tokens = corpus(teacher.tokenizer)
    lm.check_tokens(tokens, config, teacher.vocab.size)
    record = calibrate_head(
        teacher.model, head, tokens, config.calibration_windows, config.seq_len, config.seed
    )
    save_head(head, head_dir, lm.SAVE_DTYPES[config.save_dtype])
    return record
