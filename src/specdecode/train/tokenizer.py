"""The byte-level BPE tokenizer of the project's models, and its training on the corpus.

Byte-level BPE can encode any text (no unknown token) and decodes back to it exactly, which
code completion needs. Ids 0, 1, 2 are <|bos|>, <|eos|>, <|pad|>; a post-processor puts BOS
before every encoded text, so a generation starts the way training files did.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from specdecode.errors import SpecdecodeError, read_text_file
from specdecode.train.corpus import corpus_files, split_files, stdlib_root

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2
MIN_VOCAB, MAX_VOCAB = 512, 65536
MODEL_MAX_LENGTH = 1 << 20  # no fixed limit: the model's context decides, not the tokenizer


def build_tokenizer(texts: Iterable[str], vocab_size: int, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with <|bos|>=0, <|eos|>=1, <|pad|>=2 trained on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", special_tokens=[("<|bos|>", 0)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=MODEL_MAX_LENGTH,
    )


def train_tokenizer(out_dir: Path, vocab_size: int = 8192, files: list[Path] | None = None) -> Path:
    """Train on `files` (default: the corpus's train split) and save it in Hugging Face format."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise SpecdecodeError(f"vocab_size must be in [{MIN_VOCAB}, {MAX_VOCAB}], not {vocab_size}")
    if files is None:
        root = stdlib_root()
        files = split_files(corpus_files(root), root)[0]
    if not files:
        raise SpecdecodeError("no files to train the tokenizer on")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecdecodeError(f"the output {out_dir} exists and is not a directory")
    texts = [read_text_file(path) for path in files]
    if not any(text.strip() for text in texts):
        raise SpecdecodeError("no text to train the tokenizer on: the data is empty")
    tokenizer = build_tokenizer(texts, vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
