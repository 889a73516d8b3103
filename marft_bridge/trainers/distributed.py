"""Collectives for data-parallel MARFT, every tensor on the trainer's device.

NCCL accepts only CUDA tensors, gloo accepts CPU tensors: each helper here moves what it reduces
onto ``device`` (the trainer's) first, so one code path is right under both backends.

Gradient averaging is token-weighted: the step must use the gradient of the loss averaged over all
ranks' tokens (or samples) of the minibatch, n = sum_r n_r. Each rank scales its loss terms by
n_r / n (``sum_floats`` first sums the counts), so with g_r the gradient of rank r's local mean

    g = sum_r (n_r / n) g_r        = the sum all-reduce of the rank gradients

and a rank with fewer tokens weighs less (a plain mean of g_r would weigh each rank equally). Each
adapter's gradients are flattened into buckets of at most ``bucket_bytes``, so a LoRA adapter is one
all-reduce (about 400 tensors at all-linear targets would otherwise be 400 collectives).

Strategy (``README``): replicated (every rank holds the whole bf16 base, DDP-style averaging here)
fits a base up to about 30B parameters on an 80 GB GPU (60 GB of weights + activations under
checkpointing and micro-batching); beyond that the base must be sharded: ``fsdp2`` (fsdp.py), where
FSDP reduce-scatters the sharded LoRA gradients (as a sum, the same token weighting) and the flat
all-reduce here only handles what is not sharded (the value head).
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


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum of ``t`` over all ranks, reduced on ``device`` and returned on ``t``'s own device."""
    import torch.distributed as dist

    x = t.to(device)
    dist.all_reduce(x)
    return x.to(t.device)


def sum_floats(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of a short list of numbers over all ranks (counts, flags, metric sums), in one
    float64 all-reduce on ``device``."""
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64), device).tolist()


def max_floats(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum of a short list of numbers over all ranks."""
    import torch.distributed as dist

    x = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.tolist()


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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


def all_reduce_gradients(params: list[torch.nn.Parameter], device: torch.device,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Replace each ``p.grad`` by its sum over all ranks (a missing gradient counts as zeros), in
    flat fp32 buckets on ``device``: one all-reduce per adapter unless it exceeds ``bucket_bytes``.

    A sum, not a mean: the trainer divides each rank's loss by the *global* token (or sample) count
    of the minibatch, so the summed gradient is the token-weighted mean over all ranks.
    """
    import torch.distributed as dist

    from .fsdp import is_sharded

    params = [p for p in params if not is_sharded(p)]  # fsdp2 reduce-scattered those in backward
    for bucket in _buckets(params, bucket_bytes):
        flat = torch.cat([p.grad.detach().float().reshape(-1).to(device) if p.grad is not None else
                          torch.zeros(p.numel(), dtype=torch.float32, device=device) for p in bucket])
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            g = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
            offset += p.numel()


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float, device: torch.device) -> None:
    """``torch.nn.utils.clip_grad_norm_`` over replicated and sharded (fsdp2 DTensor) gradients alike:
    the global norm is sqrt(sum over ranks of the shards' squares + the replicated squares)."""
    from .fsdp import is_sharded

    if not any(is_sharded(p) for p in params):
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    grads = [p.grad for p in params if p.grad is not None]
    shard_sq = torch.zeros((), dtype=torch.float64, device=device)  # this rank's shards
    repl_sq = torch.zeros((), dtype=torch.float64, device=device)  # replicated: the same on every rank
    for g in grads:
        if is_sharded(g):
            shard_sq += g.to_local().double().pow(2).sum().to(device)
        else:
            repl_sq += g.double().pow(2).sum().to(device)
    total = (all_reduce_sum(shard_sq, device) + repl_sq).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for g in grads:
            (g.to_local() if is_sharded(g) else g).mul_(coef.to(g.dtype))


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any."""
    return sum_floats([float(flag)], device)[0] > 0


def all_finite(params: list[torch.Tensor], device: torch.device) -> bool:
    """Every weight finite, on every rank's shard (the ranks must agree whether to roll back)."""
    from .fsdp import is_sharded, local

    ok = bool(torch.stack([torch.isfinite(local(p)).all() for p in params]).all()) if params else True  # one sync
    if any(is_sharded(p) for p in params):
        ok = not any_rank(not ok, device)
    return ok


def check_strategy(strategy: str, device: torch.device) -> None:
    """Refuse what this trainer cannot run: ``fsdp2`` needs a process group (``torchrun``)."""
    import torch.distributed as dist

    from ..errors import MarftError

    if strategy == "replicated":
        return
    if strategy == "fsdp2":
        if not (dist.is_available() and dist.is_initialized()):
            raise MarftError(f"parallelism 'fsdp2' shards the base over a process group and none is running "
                             f"(device {device.type}): launch with torchrun --nproc_per_node N (or accelerate "
                             "launch), or use parallelism 'replicated' in a single process")
        return
    raise MarftError(f"unknown parallelism {strategy!r}; expected 'replicated' or 'fsdp2'")
