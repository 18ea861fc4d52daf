"""Adding one trained MTP layer to any local causal-LM target (`specdecode train mtp`).

The layer (`strategies.mtp_head`, DeepSeek-V3's arrangement) reads the target's last hidden
state after its final norm with the embedding of the next token, and runs one decoder layer of
the target's own shape. It starts from the target's last layer (the block), its final norm
(`shared_head.norm`) and an `eh_proj` that passes the hidden state through, so its first
predictions already mean something; the embeddings and the output head are the target's
(neither trained nor saved).

Training is `train eagle3`'s: the training-time test unrolls the layer `unroll` times, feeding it
its own state as chained drafting does, against the frozen target's distributions (`ttt_loss`),
on the corpus or, with `generated_tokens` > 0, on the target's own greedy continuations
(self-distillation, the sequences kept in out_dir). Loop, checkpoints, resumption and seeding
are `specdecode.train.lm`'s; the layer's confidence is calibrated through its final norm as a
head's is. The result is a copy of the target with the layer added in the DeepSeek-V3 layout
(`mtp_checkpoint.write_target`), which `--spec-type draft-mtp` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdecode.backends.packed_weights import materialize
from specdecode.errors import SpecdecodeError
from specdecode.strategies.mtp_checkpoint import write_target
from specdecode.strategies.mtp_head import MtpConfig, MtpLayer
from specdecode.train import distributed, lm
from specdecode.train.calibrate_eagle3 import calibrate_head
from specdecode.train.config import MtpShape, TrainConfig
from specdecode.train.eagle3 import frozen_teacher, self_distilled, ttt_loss

PASS_THROUGH_NOISE = 0.1  # eh_proj starts as [0.1 * its random init ; identity]


def mtp_config(target: nn.Module) -> MtpConfig:
    c = target.config
    rope = getattr(c, "rope_parameters", None) or {}
    heads = int(c.num_attention_heads)
    attention = target.get_decoder().layers[-1].self_attn
    return MtpConfig(
        hidden_size=int(c.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        intermediate_size=int(c.intermediate_size),
        vocab_size=int(target.get_output_embeddings().weight.shape[0]),
        n_layers=int(c.num_hidden_layers),
        head_dim=getattr(c, "head_dim", None),
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(c, "rope_theta", None) or rope.get("rope_theta") or 10000.0),
        attention_bias=attention.q_proj.bias is not None,
        output_bias=attention.o_proj.bias is not None,
    )


def new_layer(target: nn.Module, seed: int) -> MtpLayer:
    """A layer for `target` (a transformers causal LM): seeded init, then the target's last
    layer, final norm and a pass-through eh_proj."""
    config = mtp_config(target)
    decoder = target.get_decoder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = MtpLayer(
            config, decoder.embed_tokens.weight, target.get_output_embeddings().weight, decoder.norm.weight
        )
    last = decoder.layers[-1].state_dict()
    with torch.no_grad():
        layer.block.load_state_dict({name: last[name] for name in layer.block.state_dict()})
        layer.norm.weight.copy_(decoder.norm.weight)
        h = config.hidden_size
        layer.eh_proj.weight.mul_(PASS_THROUGH_NOISE)
        layer.eh_proj.weight[:, h:] += torch.eye(h, dtype=layer.eh_proj.weight.dtype)
    weight = next(target.parameters())
    return layer.to(device=weight.device, dtype=weight.dtype)


def train_mtp(
    tokens: np.ndarray,
    target_dir: Path,
    out_dir: Path,
    shape: MtpShape,
    config: TrainConfig,
    progress: bool = True,
    generated_tokens: int = 0,
    on_start: Callable[[], None] | None = None,
) -> Path:
    """Train an MTP layer for the causal LM in target_dir on `tokens` (ids of its tokenizer), or,
    when generated_tokens > 0, on that many tokens the target generates from prefixes of them;
    write the target with the layer added, and train_log.json, into out_dir, resuming from
    out_dir/checkpoint/ if present. on_start: see `lm.train_loop`."""
    if generated_tokens < 0:
        raise SpecdecodeError(f"generated_tokens must be >= 0 (0: the corpus), not {generated_tokens}")
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.resolve() == target_dir.resolve():
        raise SpecdecodeError(f"--out must differ from --target ({target_dir}): the target is copied there")
    if target_dir.is_dir():  # a packed one (the bundled target's) decoded; else refused below
        target_dir = materialize(target_dir)
    config, target, vocab_size = frozen_teacher(target_dir, config)
    lm.check_tokens(tokens, config, vocab_size)
    tokens = self_distilled(target, tokens, generated_tokens, out_dir, config, progress, vocab_size)
    layer = new_layer(target, config.seed)
    identity = {**lm.run_identity("mtp", shape, config), "vocab_size": vocab_size}
    if generated_tokens:
        identity["generated_tokens"] = generated_tokens
    positions = int(target.config.max_position_embeddings) - 1  # the target reads T+1 tokens
    log = lm.train_loop(
        layer,
        ttt_loss(target, shape.unroll),
        tokens,
        out_dir,
        identity,
        config,
        progress,
        positions,
        on_start,
    )
    layer.eval()
    if not distributed.is_main():
        return out_dir
    if config.calibration_windows:
        log["calibration"] = calibrate_head(
            target, layer, tokens, config.calibration_windows, config.seq_len, shape.unroll, config.seed
        )
    write_target(layer, target_dir, out_dir, lm.SAVE_DTYPES[config.save_dtype])
    lm.write_log(out_dir, log)
    return out_dir
