"""The roofline a batch-1 decode cannot pass: the bytes one token reads (every weight once, the
KV cache so far) over the device's memory bandwidth; MBU is the share of that bandwidth a
decode uses. Apart so that every plain figure, ours and the baselines', is put against the same
bytes and the same bandwidth (128-token prompt and output, bfloat16: 2.48 GB a token for the
Llama-3.2-1B shape, 15.04 GB for the Llama-3.1-8B shape)."""

from __future__ import annotations

import statistics
import time

import torch

from specdecode.compare.gpu_models import Run, Timing
from specdecode.compare.gpu_setup import Shape

BF16_BYTES = 2
# Datasheet memory bandwidth, TB/s, by the words of the device's name (every word must be
# there; the first entry that matches wins: a variant before its family).
DATASHEET_TBPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 4.8),
    (("H100", "PCIE"), 2.0),
    (("H100", "NVL"), 3.9),
    (("H100",), 3.35),  # SXM5, HBM3 ("NVIDIA H100 80GB HBM3")
    (("A100", "80GB", "PCIE"), 1.935),
    (("A100", "80GB"), 2.039),  # SXM4
    (("A100",), 1.555),  # 40GB, SXM4 and PCIe alike
    (("L40S",), 0.864),
    (("RTX", "4090"), 1.008),
)
COPY_BYTES = {"cuda": 2**30, "cpu": 2**26}  # the copy measured: ~1 GiB on a GPU, less on a CPU
COPY_REPEATS = 10


def layer_parameters(shape: Shape) -> int:
    """One decoder layer's weights: attention (grouped KV heads), the gated MLP, two norms."""
    head_dim = shape.hidden // shape.heads
    attention = 2 * shape.hidden * shape.heads * head_dim + 2 * shape.hidden * shape.kv_heads * head_dim
    return attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden


def kv_bytes_per_position(shape: Shape) -> int:
    """Keys and values one position adds to the cache, over all layers."""
    return 2 * shape.layers * shape.kv_heads * (shape.hidden // shape.heads) * BF16_BYTES


def bytes_per_token(shape: Shape, context: float) -> float:
    """Bytes a batch-1 decode step reads at `context` cached positions: every layer, the final
    norm, the LM head (a tied embedding counts once, read as the LM head), one embedding row
    and the KV cache."""
    weights = shape.layers * layer_parameters(shape) + shape.hidden + shape.vocab * shape.hidden
    return (weights + shape.hidden) * BF16_BYTES + context * kv_bytes_per_position(shape)


def mean_context(prompt: int, new_tokens: int) -> float:
    """The cached positions a decode step sees on average: the prompt and half the output."""
    return prompt + new_tokens / 2


def datasheet_bandwidth(device_name: str) -> float | None:
    """Bytes/s of the datasheet for this device name (None: not in the table)."""
    words = set(device_name.upper().replace("-", " ").replace("_", " ").split())
    for required, terabytes in DATASHEET_TBPS:
        if words.issuperset(required):
            return terabytes * 1e12
    return None


def copy_bandwidth(run: Run) -> float:
    """Bytes/s of a device-to-device copy (bytes read plus bytes written, median of the
    repeats): what the memory gives a kernel that only streams."""
    size = COPY_BYTES.get(run.device.type, COPY_BYTES["cpu"])
    source = torch.empty(size, dtype=torch.uint8, device=run.device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    samples = []
    for _ in range(COPY_REPEATS):
        run.sync()
        start = time.perf_counter()
        target.copy_(source)
        run.sync()
        samples.append(time.perf_counter() - start)
    return 2 * size / statistics.median(samples)


def measure_bandwidth(run: Run) -> None:
    """The bandwidth MBU is put against (the datasheet's where the device is known, else the
    measured copy), and the copy beside it in the speed section's bandwidth table."""
    name = str(run.report.data["machine"]["gpu"])
    datasheet = datasheet_bandwidth(name)
    run.bandwidth = datasheet  # a copy that fails below still leaves the datasheet's figure
    copy = copy_bandwidth(run)
    run.bandwidth = datasheet or copy
    row = {
        "device": name,
        "datasheet TB/s": None if datasheet is None else datasheet / 1e12,
        "copy TB/s": copy / 1e12,
        "copy / datasheet": None if datasheet is None else copy / datasheet,
        "MBU against": "datasheet" if datasheet else "measured copy",
    }
    run.report.add("speed", row, table="bandwidth")


def decode_columns(timings: list[Timing]) -> dict:
    """Decode tokens/s (tokens after the first over the seconds after it) as the median of the
    repeats, their range, the time to the first token apart."""
    rates = sorted(timing.decode_rate for timing in timings)
    rate = statistics.median(rates)
    return {
        "tokens": len(timings[0].tokens),
        "decode tokens/s": rate,
        "decode tokens/s range": f"{rates[0]:.1f}–{rates[-1]:.1f}",
        "repeats": len(timings),
        "TTFT ms": 1e3 * statistics.median(timing.first for timing in timings),
        "ms/token": 1e3 / rate,
    }


def roofline_columns(run: Run, shape: Shape, rate: float, tokens: int) -> dict:
    """GB/token, the roofline tokens/s and MBU of a plain decode at `rate` tokens/s (None where
    no bandwidth is known)."""
    read = bytes_per_token(shape, mean_context(run.sizes.speed_prompt, tokens))
    bandwidth = run.bandwidth
    return {
        "GB/token": read / 1e9,
        "roofline tokens/s": None if bandwidth is None else bandwidth / read,
        "MBU": None if bandwidth is None else rate * read / bandwidth,
    }


def plain_columns(run: Run, shape: Shape, timings: list[Timing]) -> dict:
    """Every column a plain figure carries: decode speed, its range, TTFT and the roofline's."""
    columns = decode_columns(timings)
    return columns | roofline_columns(run, shape, columns["decode tokens/s"], columns["tokens"])
