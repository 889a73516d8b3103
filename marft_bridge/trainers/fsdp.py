"""FSDP2 (``parallelism: fsdp2``): the frozen base and the LoRA adapters sharded over all ranks.

For bases that do not fit one GPU. ``torch.distributed.fsdp.fully_shard`` makes each decoder layer
one unit and a root wrapper (``Root``) the unit of what is left (embeddings, final norm, LM head,
tied or not). Each rank keeps 1/world of every parameter; a unit's parameters are all-gathered just
before it runs and freed after it (forward and backward; FSDP prefetches the next layer), so a rank
holds its shards plus about two decoder layers and the root unit unsharded. The root unit stays
gathered for the whole of each pass: embeddings and LM head, 2 x vocab x hidden (one if tied), e.g.
4 GB in bf16 at a 128k vocabulary and hidden 8192 (2 GB tied). Communication: each forward
all-gathers the whole base once (the proximal and reference passes: twice per micro-batch), each
backward again, and the last backward of a minibatch reduce-scatters the active adapter's
gradients. On-policy sampling all-gathers the whole base for every generated token (each decoding
step is a forward): at scale roll out through ``marft serve`` or vLLM and ``train_on`` the captured
episodes.

* Every call into the model goes through ``Root.forward`` (``MultiAgentPolicy._call``): the chunked
  LM head (logprobs.py) reads ``lm_head.weight`` outside the HF forward, which is right only while
  the root unit is unsharded; its saved weight is re-gathered by FSDP's pre-backward hook.
* Base loading never materialises the full model on any accelerator and only once on host memory:
  every rank builds the model on the ``meta`` device, shards it and allocates only its shards; rank 0
  alone loads the checkpoint (plus the LoRA init, under the same seed as a single process) on the
  CPU and ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends each tensor's shards out,
  after which that host copy is dropped. Peak: one full copy in rank 0's host RAM; per accelerator
  1/world of the base plus one whole tensor at a time while it is broadcast (the largest: the
  embedding matrix).
* Adapter switching: peft's ``set_adapter`` / ``disable_adapter`` toggle ``requires_grad`` on the
  sharded parameters; FSDP2 copies that flag onto the unsharded parameter at every all-gather
  (``FSDPParam.to_unsharded``), so only the active adapter gets gradients and is reduce-scattered.
* Gradients: the trainer scales each rank's loss by its share of the global token count, so the
  reduction must be a sum (FSDP averages by default): divide factor 1, sum-only collectives (gloo
  has no PREMUL_SUM). The replicated path's flat all-reduce skips sharded (DTensor) parameters.
* Lockstep: every forward and backward is a collective, so every pass runs the same number of
  micro-batches on every rank; a rank with fewer runs empty ones (``pad_plan``, the trainer's idle
  passes: a one-token forward, and a zero backward that still reduce-scatters).
* Saves: adapters and checkpoints hold full (gathered) tensors, the replicated format, written by
  rank 0; loading takes each rank's shard of the full tensors. Rollback snapshots keep each rank's
  own shards on the host (snapshot.py); no collective.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import MarftError


def is_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (itself otherwise); shares storage under no_grad."""
    return t.to_local() if is_sharded(t) else t


def full(t):
    """The whole tensor (an all-gather: every rank must call it, in the same order)."""
    return t.full_tensor() if is_sharded(t) else t


def shard_like(value: torch.Tensor, like) -> torch.Tensor:
    """``value`` (whole, the same on every rank) as ``like``'s sharding: this rank's shard, no collective."""
    from torch.distributed.tensor import distribute_tensor

    if not is_sharded(like):
        return value.to(like.device)
    return distribute_tensor(value.to(like.device_mesh.device_type), like.device_mesh, like.placements,
                             src_data_rank=None)


def from_local_like(shard: torch.Tensor, like) -> torch.Tensor:
    """This rank's ``shard`` of a tensor sharded like ``like`` (a copy on its device): no collective."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard.to(like.device, copy=True), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def copy_full_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write a whole tensor into a (possibly sharded) parameter: each rank its own shard."""
    with torch.no_grad():
        local(param).copy_(local(shard_like(value, param)))


def load_optimizer(opt: torch.optim.Optimizer, sd: dict) -> None:
    """``opt.load_state_dict`` of a state dict with whole tensors: moments of sharded parameters are
    sharded like them first (step counters and other scalars stay as they are)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {pid: {k: shard_like(v, params[pid]) if torch.is_tensor(v) and v.shape == params[pid].shape else v
                   for k, v in st.items()} for pid, st in sd["state"].items()}
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def pad_plan(plan: list[list[int]], device: torch.device) -> list[list[int]]:
    """Empty micro-batches appended up to the most any rank has, so every rank runs as many passes."""
    import torch.distributed as dist

    n = torch.tensor([len(plan)], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return plan + [[] for _ in range(int(n) - len(plan))]


class Root(nn.Module):
    """The root FSDP unit: ``root(fn, *args)`` runs ``fn`` inside its forward, so the root unit's
    parameters are all-gathered around whatever ``fn`` does with them (hidden states, the chunked LM
    head, a KV-cached decoding step) and its backward hooks are registered on what ``fn`` returns."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (transformers names their classes in ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise MarftError(f"fsdp2: cannot find the decoder layers of {type(model).__name__} "
                         "(no _no_split_modules); use parallelism 'replicated'")
    return layers


def shard(model: nn.Module, source: nn.Module | None, device: torch.device, rng: torch.Tensor) -> Root:
    """Shard the meta-device peft ``model`` over the default process group and fill it from
    ``source`` (rank 0's full CPU copy of the same peft model; None on the other ranks). Every rank
    leaves with rank 0's global RNG state ``rng`` (taken after its LoRA init): the value head and
    later draws are then those of a single process."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = decoder_layers(model.get_base_model())
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    root = Root(model)
    fully_shard(root, mesh=mesh, reshard_after_forward=True)  # root too: sharded between passes
    for unit in (*layers, root):
        unit.set_gradient_divide_factor(1.0)  # sum: the losses are already token-weighted (module doc)
        unit.set_force_sum_reduction_for_comms(True)
    root.to_empty(device=device)
    # A tensor at a time from rank 0's CPU copy; each rank keeps its shard.
    set_model_state_dict(model, source.state_dict() if source is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers are not sharded, and non-persistent ones (rotary inv_freq) are in no state dict.
    src = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if source is not None:
                buf.copy_(src[name])
            dist.broadcast(buf, 0)
    rng = rng.to(device)
    dist.broadcast(rng, 0)
    torch.set_rng_state(rng.cpu())
    return root
