"""Collectives for data-parallel MARFT, every tensor on the trainer's device.

NCCL accepts only CUDA tensors, gloo accepts CPU tensors: each helper here moves what it reduces
onto ``device`` (the trainer's) first, so one code path is right under both backends.

Gradient averaging is token-weighted: rank r holds the gradient g_r of its local mean loss over
n_r tokens (or samples); the step must use the gradient of the mean over all ranks' tokens,

    g = sum_r n_r g_r / sum_r n_r

so a rank with fewer tokens weighs less (a plain mean of g_r would weigh each rank equally). Each
adapter's gradients are flattened into buckets of at most ``bucket_bytes`` with n_r appended to
the first, so a LoRA adapter is one all-reduce (about 400 tensors at all-linear targets would
otherwise be 400 collectives).

Strategy (``README``): replicated (every rank holds the whole bf16 base, DDP-style averaging here)
fits a base up to about 30B parameters on an 80 GB GPU (60 GB of weights + activations under
checkpointing and micro-batching); beyond that the base must be sharded (FSDP2), which
``check_strategy`` refuses on CPU and this trainer does not implement yet.
"""

from __future__ import annotations

import os

import torch

DEFAULT_BUCKET_BYTES = 256 * 2**20


def init_from_env() -> tuple[int, int]:
    """(rank, world size), joining the process group torchrun / accelerate set up in the environment:
    NCCL with one GPU per local rank when CUDA is available, else gloo."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sum_floats(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of a short list of numbers over all ranks (counts, flags, metric sums), in one
    float64 all-reduce on ``device``."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    out, cur, size = [], [], 0
    for p in params:
        nbytes = p.numel() * 4  # reduced in fp32
        if cur and size + nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += nbytes
    if cur:
        out.append(cur)
    return out


def all_reduce_gradients(params: list[torch.nn.Parameter], weight: float, device: torch.device,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """Replace each ``p.grad`` by the weight-averaged gradient over all ranks; returns sum_r n_r.

    ``weight`` is this rank's n_r (0 for a rank that had no data: its missing gradients count as
    zeros). When the total weight is 0 the gradients are left at zero. fp32 buckets on ``device``.
    """
    import torch.distributed as dist

    total = None
    for k, bucket in enumerate(_buckets(params, bucket_bytes)):
        parts = [(p.grad.detach().float() * weight).reshape(-1) if p.grad is not None else
                 torch.zeros(p.numel(), dtype=torch.float32, device=device) for p in bucket]
        if k == 0:
            parts.append(torch.tensor([float(weight)], dtype=torch.float32, device=device))
        flat = torch.cat([x.to(device) for x in parts])  # (bucket numel [+1],)
        dist.all_reduce(flat)
        if k == 0:
            total = float(flat[-1])
        scale = 1.0 / total if total > 0 else 0.0
        offset = 0
        for p in bucket:
            g = (flat[offset:offset + p.numel()] * scale).view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
            offset += p.numel()
    return total or 0.0


def check_strategy(strategy: str, device: torch.device) -> None:
    """Refuse what this trainer cannot run: FSDP2 sharding is not implemented (replicated only)."""
    from ..errors import MarftError

    if strategy == "replicated":
        return
    if strategy == "fsdp2":
        where = "on CPU (gloo)" if device.type == "cpu" else "yet"
        raise MarftError(f"parallelism 'fsdp2' is not supported {where}: this trainer replicates the base on "
                         "every rank (DDP-style, bases up to ~30B on 80 GB GPUs); use parallelism 'replicated'")
    raise MarftError(f"unknown parallelism {strategy!r}; expected 'replicated' or 'fsdp2'")
