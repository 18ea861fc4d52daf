"""Data-parallel training on torch.distributed: several processes, one global batch.

`specdecode train ... --nproc N` starts N copies of itself under torchrun (gloo on CPUs, NCCL
on GPUs, one GPU per process); torchrun started by hand (several nodes) works the same way. Each
step every process draws the same global batch (it is a function of the seed and the step
alone, see `lm`), takes its contiguous share of the rows, and the gradients are averaged
across processes before clipping and the optimizer step. Shares are equal and every loss is a
mean over positions, so the average is the gradient of the global batch's loss: N processes
follow one process's loss curve (to float rounding), and the weights stay identical on every
process. Rank 0 alone writes checkpoints, logs and models; every rank reads a checkpoint to
resume. Self-distillation data is generated in shares and gathered (`gather_rows`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.run as torchrun
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from specdecode.errors import SpecdecodeError


def launched() -> bool:
    """True inside a process that torchrun started."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init(device_type: str) -> torch.device | None:
    """Join the process group torchrun describes (once); on CUDA the process's own GPU, returned."""
    if not launched() or int(os.environ["WORLD_SIZE"]) < 2:
        return None
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return torch.device("cuda", local) if device_type == "cuda" else None


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world() -> tuple[int, int]:
    """(rank, number of processes); (0, 1) outside a process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def is_main() -> bool:
    return world()[0] == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def share(batch: torch.Tensor) -> torch.Tensor:
    """This process's contiguous rows of the global batch."""
    rank, size = world()
    rows = len(batch) // size
    return batch[rank * rows : (rank + 1) * rows]


def check_divides(batch_size: int) -> None:
    size = world()[1]
    if batch_size % size:
        raise SpecdecodeError(f"batch_size {batch_size} is not a multiple of the {size} processes")


def average_gradients(model: nn.Module) -> None:
    """Every parameter's gradient replaced by its mean over the processes."""
    size = world()[1]
    if size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for handle in [dist.all_reduce(g, async_op=True) for g in grads]:
        handle.wait()
    for g in grads:
        g.div_(size)


def mean(value: torch.Tensor) -> float:
    """A scalar's mean over the processes."""
    value = value.detach().reshape(1).clone()
    if world()[1] > 1:
        dist.all_reduce(value)
        value /= world()[1]
    return value.item()


def gather_rows(rows: np.ndarray) -> np.ndarray:
    """Every process's rows, concatenated in rank order, on every process."""
    if world()[1] == 1:
        return rows
    parts: list[np.ndarray | None] = [None] * world()[1]
    dist.all_gather_object(parts, rows)
    return np.concatenate([p for p in parts if p is not None])


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run `specdecode ARGV` in nproc processes on this machine under torchrun's launcher; 0 when
    every process succeeded. ARGV goes to the processes as it is: torchrun's own command line would
    read options of ours that abbreviate its own (--nproc) as its own."""
    args = torchrun.get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "specdecode.cli"]
    )
    args.training_script_args = list(argv)
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        return max((failure.exitcode for failure in exc.failures.values()), default=1) or 1
    return 0
