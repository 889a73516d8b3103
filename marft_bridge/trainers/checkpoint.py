"""Checkpoint files: trainable weights, optimiser states and RNG states as safetensors, the rest as JSON.

Layout of a checkpoint directory (the trainer adds ``adapters/``, peft dirs of every agent):

    weights.safetensors      name -> tensor (every LoRA weight and the value head)
    optimizers.safetensors   "<optimiser>/<param id>/<key>" -> tensor (AdamW moments, step)
    rng.safetensors          generator states
    state.json               counters, agents, world size, config, optimiser param groups and
                             non-tensor optimiser state
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import MarftError


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
