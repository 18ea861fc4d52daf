"""The training commands' settings, free of heavy imports: `specdecode train --help` reads their
defaults here without loading torch (the training modules import them from here too)."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecdecodeError

SAVE_DTYPE_NAMES = ("bfloat16", "float16")  # the dtypes trained weights are saved in
# "bf16": matmuls under bfloat16 autocast (fp32 master weights and optimizer state), about twice
# as fast as fp32 on GPUs and on CPUs with AVX512-BF16 or AMX; "fp32" for CPUs without them, where
# bfloat16 is emulated (about 10x slower); "auto": whichever of the two is fast where training runs.
PRECISIONS = ("auto", "bf16", "fp32")
DEVICES = ("cpu", "cuda", "auto")
PREFIX_TOKENS = 64  # corpus tokens before each generated continuation
NEW_TOKENS = 192  # the target's greedy tokens after each prefix


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20_000
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 500
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"  # "cpu", "cuda" or "auto" (cuda when available)
    checkpoint_every: int = 500
    save_dtype: str = "bfloat16"
    precision: str = "auto"
    distill_temperature: float = 1.0
    threads: int | None = None  # torch intra-op threads; None leaves torch's setting alone
    calibration_windows: int = 32  # drafts, heads: training windows that fit the confidence scale (0: none)

    def __post_init__(self) -> None:
        if self.calibration_windows < 0:
            raise SpecdecodeError(f"calibration_windows must be >= 0, not {self.calibration_windows}")
        positive = ("steps", "batch_size", "seq_len", "checkpoint_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise SpecdecodeError(f"{name} must be >= 1, not {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr:
            raise SpecdecodeError(f"need 0 <= min_lr <= lr (lr {self.lr}, min_lr {self.min_lr})")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise SpecdecodeError("warmup_steps and weight_decay must be >= 0 and grad_clip > 0")
        if self.distill_temperature <= 0:
            raise SpecdecodeError(f"distill_temperature must be > 0, not {self.distill_temperature}")
        if self.device not in DEVICES:
            raise SpecdecodeError(f"unknown device {self.device!r} (choose from {', '.join(DEVICES)})")
        if self.save_dtype not in SAVE_DTYPE_NAMES:
            raise SpecdecodeError(
                f"save_dtype must be one of {', '.join(SAVE_DTYPE_NAMES)}, not {self.save_dtype!r}"
            )
        if self.precision not in PRECISIONS:
            raise SpecdecodeError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.threads is not None and self.threads < 1:
            raise SpecdecodeError(f"threads must be >= 1, not {self.threads}")


def choose_precision(asked: str, device_type: str, cpu_has_bf16: bool) -> tuple[str, str | None]:
    """The precision to train in, and a line to say about it (None: nothing worth saying): "auto"
    is bf16 on a GPU or on a CPU with bf16 units, else fp32; an explicit choice is obeyed, with a
    warning where it is bf16 on a CPU that would emulate it."""
    emulated = device_type == "cpu" and not cpu_has_bf16
    if asked == "auto":
        if emulated:
            return "fp32", (
                "note: this CPU has no bf16 units: training in float32, "
                "about 10x faster here than bf16 emulation"
            )
        return "bf16", None
    if asked == "bf16" and emulated:
        return "bf16", (
            "warning: this CPU has no bf16 units: --precision bf16 is emulated here, about 10x slower than "
            "--precision fp32"
        )
    return asked, None


@dataclass(frozen=True)
class HeadShape:
    """The head's sizes; its hidden size is the target's (shared embeddings)."""

    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 512
    draft_vocab: int = 1024
    unroll: int = 5
    layer_ids: tuple[int, ...] | None = None  # None: [2, L // 2, L - 3]

    def __post_init__(self) -> None:
        if min(self.heads, self.kv_heads, self.intermediate, self.draft_vocab, self.unroll) < 1:
            raise SpecdecodeError(f"head sizes and unroll must be >= 1: {self}")
        if self.layer_ids and self.layer_ids[0] == 1:
            # SGLang and `load_head` read a first id of 1 as SpecForge's "output of layer 0"
            raise SpecdecodeError(
                "layer ids starting with 1 are ambiguous: engines read them as SpecForge's "
                "'output of layer' ids and shift them by one; start with 0 or 2"
            )


EAGLE3_SHAPE = HeadShape()


@dataclass(frozen=True)
class DFlashShape:
    """A DFlash drafter's sizes (its hidden size, embeddings and output head are the target's) and
    how it is trained: `anchors` blocks per training sequence share one target pass."""

    layers: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 256
    block_size: int = 8
    anchors: int = 32
    layer_ids: tuple[int, ...] | None = None  # None: z-lab's spread of two layers (see train.dflash)
    mask_token_id: int | None = None  # None: the target's pad token

    def __post_init__(self) -> None:
        sizes = (self.layers, self.heads, self.kv_heads, self.head_dim, self.intermediate, self.anchors)
        if min(sizes) < 1:
            raise SpecdecodeError(f"drafter sizes and anchors must be >= 1: {self}")
        if self.heads % self.kv_heads:
            raise SpecdecodeError(f"kv_heads {self.kv_heads} must divide heads {self.heads}")
        if self.block_size < 2:
            raise SpecdecodeError(f"block_size {self.block_size} drafts nothing (at least 2)")


DFLASH_SHAPE = DFlashShape()


@dataclass(frozen=True)
class MtpShape:
    """What `train mtp` chooses; the MTP layer's sizes are the target's own layer's."""

    unroll: int = 3  # training-time-test steps: drafting chains the layer on its own state

    def __post_init__(self) -> None:
        if self.unroll < 1:
            raise SpecdecodeError(f"unroll must be >= 1, not {self.unroll}")
