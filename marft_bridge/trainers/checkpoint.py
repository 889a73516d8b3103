"""Checkpoint files: trainable weights, optimiser states and RNG states as safetensors, the rest as JSON.

Layout of a checkpoint directory (``save``: ``write``'s files plus ``adapters/``, peft dirs of every agent):

    weights.safetensors      name -> tensor (every LoRA weight and the value head)
    optimizers.safetensors   "<optimiser>/<param id>/<key>" -> tensor (AdamW moments, step)
    rng.safetensors          generator states (fsdp2: every rank's, ``rank<r>/...`` for r > 0)
    state.json               counters, agents, world size, config, optimiser param groups and
                             non-tensor optimiser state

Tensors are always whole: under fsdp2 the trainer gathers its shards before ``write`` (rank 0
writes) and each rank takes its own shard of what ``read`` returns, so a checkpoint moves freely
between replicated and fsdp2 runs and world sizes. Adapters (``save_adapters``) likewise: the peft
layout the registry and ``marft serve`` load, gathered under fsdp2 and written by rank 0.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..errors import MarftError


def save(trainer, directory) -> Path:
    """A trainer's checkpoint: ``capture``, then ``write`` and its adapters. With several ranks a
    collective: every rank calls it, rank 0 writes."""
    weights, optim, rng = capture(trainer)
    d = Path(directory)
    if trainer.rank == 0:
        write(d, weights, optim, rng, {"update_count": trainer.update_count, "agents": trainer.agents,
                                       "world": trainer.world, "config": trainer.config.model_dump(mode="json")})
    save_adapters(trainer.policy, d / "adapters", weights)  # fsdp2: no second gather
    return d


def load(trainer, directory) -> None:
    """Restore what ``save`` wrote into ``trainer`` (same agents and model shapes required)."""
    state, weights, optim, rng = read(directory, trainer.device)
    if state["agents"] != trainer.agents:
        raise MarftError(f"checkpoint {directory} is for agents {state['agents']}, this trainer has {trainer.agents}")
    mine = trainer.named_weights()
    if set(weights) != set(mine) or any(weights[n].shape != mine[n].shape for n in mine):
        raise MarftError(f"checkpoint {directory} does not match this model/config (adapter weights differ)")
    restore(trainer, weights, optim, rng)
    trainer.update_count = state["update_count"]


def capture(trainer) -> tuple[dict, dict, dict]:
    """Host copies of a trainer's trainable weights, optimiser states and RNG states (what a
    checkpoint writes): no second copy of the trainable state on the device. With several ranks a
    collective (every rank calls this, in the same order): fsdp2's shards are gathered whole, and
    every rank's generators are kept."""
    from .fsdp import full

    def host(x):
        return full(x).detach().to("cpu", copy=True) if torch.is_tensor(x) else x

    optim = {}
    for k, o in trainer.optimizers().items():
        sd = o.state_dict()
        optim[k] = {"state": {i: {n: host(v) for n, v in st.items()} for i, st in sd["state"].items()},
                    "param_groups": copy.deepcopy(sd["param_groups"])}
    rng = {**{f"gen/{k}": g.get_state() for k, g in trainer.gens.items()},
           "order_gen": trainer.order_gen.get_state(),
           "torch": torch.get_rng_state(),
           **({"cuda": torch.cuda.get_rng_state()} if trainer.device.type == "cuda" else {})}
    if trainer.world > 1:
        # Keep each rank's generators (their minibatch shuffles drew on its own samples), rank 0's
        # under the plain names, so resume is exact on every rank.
        import torch.distributed as dist

        ranks: list = [None] * trainer.world
        dist.all_gather_object(ranks, rng)
        rng = {**ranks[0], **{f"rank{r}/{k}": v for r in range(1, trainer.world) for k, v in ranks[r].items()}}
    return {n: host(p) for n, p in trainer.named_weights().items()}, optim, rng


def restore(trainer, weights: dict, optim: dict, rng: dict) -> None:
    """Write a checkpoint's state (whole tensors) back into the trainer; under fsdp2 each rank keeps
    its shard."""
    from .fsdp import copy_full_, load_optimizer

    for n, p in trainer.named_weights().items():
        copy_full_(p, weights[n])
    for k, o in trainer.optimizers().items():
        load_optimizer(o, optim[k])  # load_state_dict copies what it keeps
    own = {k.split("/", 1)[1]: v for k, v in rng.items() if k.startswith(f"rank{trainer.rank}/")}
    rng = {**rng, **own}  # this rank's states where the checkpoint has them, else rank 0's
    for k, g in trainer.gens.items():
        if f"gen/{k}" in rng:  # absent in checkpoints from before per-group generators
            g.set_state(rng[f"gen/{k}"])
    trainer.order_gen.set_state(rng["order_gen"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])


def write(directory, weights: dict, optimizers: dict, rng: dict, state: dict) -> Path:
    """Write the four files; ``optimizers`` maps a name to an optimiser ``state_dict()``."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous().cpu() for n, t in weights.items()}, str(d / "weights.safetensors"))
    tensors, meta = {}, {}
    for name, sd in optimizers.items():
        meta[name] = {"param_groups": sd["param_groups"], "state": {}}
        for pid, st in sd["state"].items():
            meta[name]["state"][str(pid)] = {}
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"{name}/{pid}/{k}"] = v.contiguous().cpu()
                else:
                    meta[name]["state"][str(pid)][k] = v
    save_file(tensors, str(d / "optimizers.safetensors"))
    save_file(dict(rng), str(d / "rng.safetensors"))
    (d / "state.json").write_text(json.dumps({**state, "optimizers": meta}, indent=1))
    return d


def read(directory, device: torch.device) -> tuple[dict, dict, dict, dict]:
    """(state, weights, optimiser state dicts, rng) as ``write`` stored them, tensors on ``device``
    (optimiser step counters stay on the CPU, as torch keeps them)."""
    from safetensors.torch import load_file

    d = Path(directory)
    try:
        state = json.loads((d / "state.json").read_text())
        weights = load_file(str(d / "weights.safetensors"))
        opt_t = load_file(str(d / "optimizers.safetensors"))
        rng = load_file(str(d / "rng.safetensors"))
    except (OSError, ValueError) as e:
        raise MarftError(f"cannot read checkpoint {d}: {e}") from None
    optim = {}
    for name, meta in state["optimizers"].items():
        st = {int(pid): dict(extra) for pid, extra in meta["state"].items()}
        for key, t in opt_t.items():
            oname, pid, k = key.rsplit("/", 2)
            if oname == name:
                st.setdefault(int(pid), {})[k] = t.to(device) if k != "step" else t
        optim[name] = {"state": st, "param_groups": meta["param_groups"]}
    return state, {n: t.to(device) for n, t in weights.items()}, optim, rng


def save_adapters(policy, directory, whole: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``<dir>/<agent>/adapter_model.safetensors + adapter_config.json`` for every agent. With
    several ranks a collective: rank 0 writes (under fsdp2 every rank gathers the LoRA shards first)
    and every rank returns once the files exist; ``whole``: LoRA weights already gathered
    (``capture``'s), by parameter name."""
    import shutil
    import tempfile

    import torch.distributed as dist

    from .fsdp import full

    directory = Path(directory)
    state = None
    if policy.sharded:  # whole tensors, in the same order on every rank
        state = {n: whole[n] if whole is not None else full(p).detach().cpu()
                 for n, p in policy.model.named_parameters() if "lora_" in n}
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not several or dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            extra = {"state_dict": state} if state is not None else {}
            policy.model.save_pretrained(tmp, selected_adapters=policy.adapters, **extra)
            for agent, adapter in policy.adapter_of.items():
                src = Path(tmp) / adapter if adapter != "default" else Path(tmp)
                dst = directory / agent
                if dst.exists():
                    shutil.rmtree(dst)
                shutil.copytree(src, dst)
    if several:
        dist.barrier()  # every rank returns once the files exist
    return directory


def check_adapter_dirs(directory, agents: list[str]) -> None:
    """Refuse an ``init_adapters`` directory that lacks a peft dir (adapter_config.json and
    adapter_model.safetensors) for one of ``agents``, naming what is missing and what is there."""
    d = Path(directory)
    if not d.is_dir():
        raise MarftError(f"init_adapters {d} is not a directory")
    missing = [f"{a}/{f}" for a in agents for f in ("adapter_config.json", "adapter_model.safetensors")
               if not (d / a / f).is_file()]
    if missing:
        have = sorted(p.name for p in d.iterdir() if p.is_dir())
        raise MarftError(f"init_adapters {d} lacks {', '.join(missing)} (safetensors only; one <agent>/ dir per "
                         f"agent as `marft adapters publish` takes; it has: {', '.join(have) or 'nothing'})")


def load_adapters(policy, directory, agents: list[str]) -> None:
    """Load ``<dir>/<agent>/`` peft dirs as ``save_adapters`` writes them (safetensors only; shapes
    must match this LoRA config). Under fsdp2 every rank reads the files and keeps its shard."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    from .fsdp import copy_full_

    for agent in agents:
        path = Path(directory) / agent / "adapter_model.safetensors"
        if agent not in policy.adapter_of:
            raise MarftError(f"unknown agent {agent!r}; this trainer has {policy.agents}")
        try:
            state = load_file(str(path))
        except (OSError, ValueError) as e:
            raise MarftError(f"cannot load adapter for {agent!r} from {path}: {e}") from None
        adapter = policy.adapter_of[agent]
        if policy.sharded:  # peft's own loader cannot copy into DTensors: map the keys, copy shards
            mine = get_peft_model_state_dict(policy.model, state_dict=dict(policy.model.named_parameters()),
                                             adapter_name=adapter)
            unexpected = sorted(set(state) - set(mine))
            bad = [k for k in state if k in mine and state[k].shape != mine[k].shape]
            if unexpected or bad:
                raise MarftError(f"adapter {path} does not fit this LoRA config: {(unexpected or bad)[:3]}")
            for k, t in state.items():
                copy_full_(mine[k], t)
            continue
        try:
            res = set_peft_model_state_dict(policy.model, state, adapter_name=adapter)
        except RuntimeError as e:  # shape mismatch: another rank / target modules
            raise MarftError(f"adapter {path} does not fit this LoRA config: {str(e).splitlines()[0]}") from None
        if res.unexpected_keys:
            raise MarftError(f"adapter {path} has weights this model lacks: {res.unexpected_keys[:3]}")
