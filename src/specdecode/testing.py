"""Tiny Llama-architecture models and tokenizers made on the spot, for tests and the demo.

Nothing here downloads anything: tokenizers are trained in a fraction of a second on Python
source that ships with the interpreter, and models get seeded random weights.

    python -m specdecode.testing DIR   # writes DIR/target and DIR/draft (a random-weight pair)
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from specdecode.train.tokenizer import build_tokenizer

DEMO_DEEP_LAYER_SCALE = 0.03
DEMO_HEAD_SCALE = 40.0


def sample_text() -> str:
    """Python source present wherever Python is."""
    return inspect.getsource(textwrap)


def make_tokenizer(
    vocab_size: int = 320, text: str | None = None, add_bos: bool = True
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with <|bos|>=0, <|eos|>=1, <|pad|>=2, trained on `text`."""
    return build_tokenizer([text or sample_text()], vocab_size, add_bos)


def make_llama(
    vocab_size: int,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 512,
    init_std: float = 0.2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> LlamaForCausalLM:
    """A seeded random Llama. float64 makes ties and batch-shape rounding differences vanish."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def perturbed_copy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """The same model with Gaussian noise (relative to each weight's scale) added: a draft
    that agrees with the target often but not always."""
    copy = LlamaForCausalLM(model.config).to(next(model.parameters()).dtype).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in copy.parameters():
            scale = weight.abs().mean()
            weight.add_(noise * scale * torch.randn(weight.shape, generator=generator, dtype=weight.dtype))
    return copy


def truncated_copy(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """The first `layers` decoder layers of a model with its norm and head: an early-exit draft."""
    config = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": layers})
    copy = LlamaForCausalLM(config).to(next(model.parameters()).dtype).eval()
    copy.load_state_dict(model.state_dict(), strict=False)
    return copy


def save_model(directory: str | Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> Path:
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_demo_pair(directory: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """A synthetic random-weight target (8 layers, ~28M parameters) and its 1-layer early exit.

    Until a trained pair ships, this is what exercises the engine end to end. The weights are
    random, so the text is meaningless; the target's layers after the first are scaled down
    and its head sharpened, so that the 1-layer draft agrees with it most of the time while
    the target still pays for all 8 layers. The speed-up it shows is the engine's, at a high
    acceptance rate that real pairs reach only on easy text.
    """
    directory = Path(directory)
    tokenizer = make_tokenizer(vocab_size=2048)
    target = make_llama(
        len(tokenizer),
        hidden=512,
        layers=8,
        heads=8,
        kv_heads=8,
        intermediate=1536,
        max_positions=2048,
        init_std=0.02,
        seed=seed,
        dtype=torch.float32,
    )
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(DEMO_DEEP_LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(DEMO_DEEP_LAYER_SCALE)
        target.lm_head.weight.mul_(DEMO_HEAD_SCALE)
    draft = truncated_copy(target, layers=1)
    return save_model(directory / "target", target, tokenizer), save_model(
        directory / "draft", draft, tokenizer
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight demo target/draft pair.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    target, draft = make_demo_pair(args.directory, args.seed)
    print(f"wrote {target} and {draft}")


if __name__ == "__main__":
    main()
