"""Training the shipped target from scratch and distilling a draft for any causal-LM target.

A distilled draft's output scale is then calibrated (see `calibrate`), so that its top-1
probability, which the p_min rule reads, is the chance that the target agrees with it.

Both share one loop (`train_loop`), parameterised by a loss function:

* the target learns next-token cross-entropy on Python source;
* the draft learns to imitate the target: KL(target || draft) on temperature-softened
  distributions over every position, plus a small weight (`HARD_LOSS_WEIGHT`) of ordinary
  cross-entropy. Speculative decoding pays off in proportion to how often the draft proposes
  what the target would have chosen, so matching the target's whole distribution (which
  also carries its mistakes and its second choices) beats learning the data on its own; the
  small hard term only steadies the start, when the draft's distribution is flat.

Batches are random windows of the token array drawn by a generator seeded from
`config.seed` and the step number alone, the model is initialised under `config.seed`, and
Llama has no dropout: nothing depends on carried random state. A run interrupted after a
checkpoint therefore resumes to exactly the weights an uninterrupted run would reach (on
the CPU), and the checkpoint needs no RNG states. The checkpoint (out_dir/checkpoint/) is
kept after the last step, so training can be continued later with a larger `steps`: the
cosine schedule is then recomputed over the new total, from the step reached.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from specdecode.backends.hf import HFBackend, LoadOptions, cpu_has_bf16
from specdecode.errors import SpecdecodeError
from specdecode.train import distributed
from specdecode.train.calibrate import calibrate_draft
from specdecode.train.config import SAVE_DTYPE_NAMES, TrainConfig, choose_precision

HARD_LOSS_WEIGHT = 0.1  # share of plain next-token cross-entropy in the distillation loss
SAVE_DTYPES = {name: getattr(torch, name) for name in SAVE_DTYPE_NAMES}
CHECKPOINT_FILE = "checkpoint/state.pt"
LOG_FILE = "train_log.json"
# TrainConfig fields that may change between a run and its resumption.
RESUMABLE_CHANGES = frozenset(
    {"steps", "checkpoint_every", "save_dtype", "device", "threads", "calibration_windows"}
)

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 2048
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if min(self.hidden, self.layers, self.heads, self.kv_heads, self.intermediate) < 1:
            raise SpecdecodeError(f"model shape sizes must be >= 1: {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise SpecdecodeError(f"heads must divide hidden and kv_heads must divide heads: {self}")


# With an 8192 vocabulary: 2 x 8192 x 512 embeddings + 8 x 3,212,288 per layer + 512 = 34,087,424.
TARGET_SHAPE = ModelShape(hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1408)
# Tied embeddings: untied, the 8192 x 192 head alone would be 1.6M of a 4.0M draft (8.5x smaller).
# Tied: 8192 x 192 + 2 x 442,752 per layer + 192 = 2,458,560 parameters, 13.9x fewer.
DRAFT_SHAPE = ModelShape(hidden=192, layers=2, heads=6, kv_heads=6, intermediate=512, tie_embeddings=True)


def parameter_count(shape: ModelShape, vocab_size: int) -> int:
    """The number of parameters of a Llama of this shape (what `llama_config` builds)."""
    kv_width = shape.hidden // shape.heads * shape.kv_heads
    attention = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * kv_width
    layer = attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    embeddings = (1 if shape.tie_embeddings else 2) * vocab_size * shape.hidden
    return embeddings + shape.layers * layer + shape.hidden


def llama_config(
    shape: ModelShape, vocab_size: int, bos_id: int | None, eos_id: int | None, pad_id: int | None
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=shape.tie_embeddings,
    )


def sample_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """`batch_size` random windows of seq_len + 1 tokens (inputs and their next tokens): [B, T+1]."""
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator).numpy()  # [B]
    index = starts[:, None] + np.arange(seq_len + 1)  # [B, T+1]
    return torch.from_numpy(tokens[index].astype(np.int64))


def _batch_for_step(tokens: np.ndarray, config: TrainConfig, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    return sample_batch(tokens, config.batch_size, config.seq_len, generator)


def check_tokens(tokens: np.ndarray, config: TrainConfig, vocab_size: int) -> None:
    if tokens.ndim != 1 or len(tokens) <= config.seq_len + 1:
        raise SpecdecodeError(
            f"need a 1-D token array longer than seq_len + 1 = {config.seq_len + 1}, not shape {tokens.shape}"
        )
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise SpecdecodeError(f"token ids must lie in [0, {vocab_size}) (got {tokens.min()}..{tokens.max()})")


def _device(config: TrainConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SpecdecodeError("device cuda was asked for, but no CUDA GPU is available")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def _new_model(
    shape: ModelShape, vocab_size: int, tokenizer: PreTrainedTokenizerBase, seed: int
) -> LlamaForCausalLM:
    config = llama_config(
        shape, vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def _lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step (step counts from 0)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    params = list(model.parameters())  # deduplicated: a tied head appears once
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # norms, biases
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def run_identity(kind: str, shape: ModelShape, config: TrainConfig) -> dict:
    """What a checkpoint must share with a request to resume it."""
    fixed = {k: v for k, v in asdict(config).items() if k not in RESUMABLE_CHANGES}
    return {"kind": kind, "shape": asdict(shape), "config": fixed}


def _load_checkpoint(path: Path, identity: dict, steps: int) -> dict | None:
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise SpecdecodeError(f"cannot read the checkpoint {path}: {exc}") from None
    if state["identity"] != identity:
        raise SpecdecodeError(
            f"the checkpoint in {path.parent} was made by a different run "
            f"({state['identity']}, requested {identity}); use another output directory or delete it"
        )
    if state["step"] > steps:
        raise SpecdecodeError(f"the checkpoint {path} is at step {state['step']}, beyond steps={steps}")
    return state


def _save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)  # atomic: an interruption leaves the previous checkpoint whole


def train_loop(
    model: nn.Module,
    loss_fn: LossFn,
    tokens: np.ndarray,
    out_dir: Path,
    identity: dict,
    config: TrainConfig,
    progress: bool,
    max_positions: int,
    on_start: Callable[[], None] | None = None,
) -> dict:
    """Train `model` (on its device) to config.steps, resuming from and writing checkpoints.
    `loss_fn(model, batch [B, T+1])` may use other (frozen) models; only `model` is trained and
    checkpointed. max_positions: the longest sequence the models involved take. on_start: called
    once the run is checked, before anything is written (a refused run leaves out_dir as it was).
    Returns the log: per-step losses of the whole run, the step resumed from, tokens/s."""
    if config.seq_len > max_positions:
        raise SpecdecodeError(f"seq_len {config.seq_len} exceeds the model's {max_positions} positions")
    distributed.check_divides(config.batch_size)
    main = distributed.is_main()
    path = out_dir / CHECKPOINT_FILE
    optimizer = _optimizer(model, config)
    state = _load_checkpoint(path, identity, config.steps)
    start, losses = (state["step"], state["losses"]) if state else (0, [])
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if on_start is not None and main:
        on_start()
    distributed.barrier()  # nothing is trained before rank 0 has checked and kept its inputs
    model.train()
    bar = tqdm(
        total=config.steps, initial=start, disable=not (progress and main), unit="step", dynamic_ncols=True
    )
    smoothed, began = None, time.perf_counter()
    for step in range(start, config.steps):
        batch = distributed.share(_batch_for_step(tokens, config, step))
        losses.append(_step(model, optimizer, loss_fn, batch, step, config))
        smoothed = losses[-1] if smoothed is None else 0.95 * smoothed + 0.05 * losses[-1]
        rate = (step + 1 - start) * config.batch_size * config.seq_len / (time.perf_counter() - began)
        bar.set_postfix(loss=f"{smoothed:.3f}", tok_s=f"{rate:,.0f}")
        bar.update()
        if main and ((step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps):
            model_state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            _save_checkpoint(path, {"identity": identity, "step": step + 1, "losses": losses, **model_state})
    bar.close()
    distributed.barrier()  # the last checkpoint is whole before any process goes on
    return _run_log(identity, config, start, losses, time.perf_counter() - began)


def _run_log(identity: dict, config: TrainConfig, start: int, losses: list[float], seconds: float) -> dict:
    """What train_log.json records: the per-step losses of the whole run and this run's speed."""
    trained = (config.steps - start) * config.batch_size * config.seq_len
    return {
        "kind": identity["kind"],
        "steps": config.steps,
        "resumed_from": start,
        "losses": losses,
        "tokens_per_second": trained / seconds if start < config.steps else 0,
    }


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: torch.Tensor,  # [B, T+1]
    step: int,
    config: TrainConfig,
) -> float:
    """One optimizer step on this process's share of the batch; returns the global batch's loss."""
    device = next(model.parameters()).device
    for group in optimizer.param_groups:
        group["lr"] = _lr_at(step, config)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
        loss = loss_fn(model, batch.to(device))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    distributed.average_gradients(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return distributed.mean(loss)


def _save_result(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out_dir: Path, log: dict, config: TrainConfig
) -> Path:
    model.to(device="cpu", dtype=SAVE_DTYPES[config.save_dtype]).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    write_log(out_dir, log)
    return out_dir


def write_log(out_dir: Path, log: dict) -> None:
    (out_dir / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")


def prepare(config: TrainConfig) -> torch.device:
    """The device to train on; under torchrun, joins the process group (and takes its own GPU)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = _device(config)
    return distributed.init(device.type) or device


def with_precision(config: TrainConfig, device: torch.device) -> TrainConfig:
    """`config` with its precision decided for `device` ("auto": see `choose_precision`), said on
    stderr where the CPU decided it. Decided before the run's identity is taken, so a run resumes
    in the precision it started in, whichever way it was asked for."""
    precision, line = choose_precision(config.precision, device.type, device.type == "cpu" and cpu_has_bf16())
    if line is not None and distributed.is_main():
        print(line, file=sys.stderr)
    return replace(config, precision=precision)


def _next_token_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def train_target(
    tokens: np.ndarray,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    shape: ModelShape,
    config: TrainConfig,
    progress: bool = True,
    on_start: Callable[[], None] | None = None,
) -> Path:
    """Train a Llama of `shape` from scratch on `tokens` (ids of `tokenizer`); write a Hugging Face
    directory (and train_log.json) into out_dir, resuming from out_dir/checkpoint/ if present.
    on_start: see `train_loop`."""
    out_dir = Path(out_dir)
    vocab_size = len(tokenizer)
    check_tokens(tokens, config, vocab_size)
    device = prepare(config)
    config = with_precision(config, device)
    model = _new_model(shape, vocab_size, tokenizer, config.seed).to(device)
    identity = run_identity("target", shape, config)
    log = train_loop(
        model, _next_token_loss, tokens, out_dir, identity, config, progress, shape.max_positions, on_start
    )
    if not distributed.is_main():
        return out_dir
    return _save_result(model, tokenizer, out_dir, log, config)


def _distillation_loss(target: LlamaForCausalLM, temperature: float) -> LossFn:
    def loss_fn(draft: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]  # [B, T]
        with torch.no_grad():
            teacher = target(input_ids=inputs).logits.flatten(0, 1).float()  # [B*T, V]
        student = draft(input_ids=inputs).logits.flatten(0, 1).float()  # [B*T, V]
        soft = F.kl_div(
            F.log_softmax(student / temperature, dim=-1),
            F.log_softmax(teacher / temperature, dim=-1),
            log_target=True,
            reduction="batchmean",  # summed over the vocabulary, averaged over positions
        )
        hard = F.cross_entropy(student, batch[:, 1:].flatten())
        return (1 - HARD_LOSS_WEIGHT) * soft * temperature**2 + HARD_LOSS_WEIGHT * hard

    return loss_fn


def train_draft(
    tokens: np.ndarray,
    target_dir: Path,
    out_dir: Path,
    shape: ModelShape,
    config: TrainConfig,
    progress: bool = True,
    on_start: Callable[[], None] | None = None,
) -> Path:
    """Distill a Llama draft of `shape` from the causal LM in target_dir. The draft gets the target's
    tokenizer and output vocabulary size, so the two vocabularies match by construction.
    on_start: see `train_loop`."""
    out_dir = Path(out_dir)
    device = prepare(config)
    config = with_precision(config, device)
    teacher = HFBackend.load(target_dir, LoadOptions(device=device.type, dtype="float32"))
    vocab_size = teacher.vocab.size
    check_tokens(tokens, config, vocab_size)
    target = teacher.model.eval().requires_grad_(False)
    draft = _new_model(shape, vocab_size, teacher.tokenizer, config.seed).to(device)
    identity = {**run_identity("draft", shape, config), "vocab_size": vocab_size}
    loss_fn = _distillation_loss(target, config.distill_temperature)
    positions = min(shape.max_positions, target.config.max_position_embeddings)
    log = train_loop(draft, loss_fn, tokens, out_dir, identity, config, progress, positions, on_start)
    if not distributed.is_main():
        return out_dir
    if config.calibration_windows:
        log["calibration"] = calibrate_draft(
            target, draft, tokens, config.calibration_windows, config.seq_len, config.seed
        )
    return _save_result(draft, teacher.tokenizer, out_dir, log, config)
