"""Reading and vetting peft LoRA adapter directories before anything loads them.

Only ``adapter_model.safetensors`` + ``adapter_config.json`` are accepted: safetensors cannot run code
on load, pickled ``.bin``/``.pt`` files can. The checks here need only the files (no torch model), so
the registry can refuse a bad adapter at publish time and the server again before a swap.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..errors import MarftError

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Keys as peft saves them: "base_model.model.<module path>.lora_A.weight".
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class AdapterError(MarftError):
    """An adapter that cannot be published or loaded; the message says why."""


class AdapterInfo(BaseModel):
    """What a LoRA adapter directory holds, as far as compatibility checks need."""

    model_config = ConfigDict(frozen=True)

    path: str
    rank: int
    alpha: float
    scale: float  # what peft multiplies the LoRA output by: alpha / r, or alpha / sqrt(r) with use_rslora
    delta_bound: float  # an upper bound of |scale * B @ A| over every module's entries, in float64
    target_modules: tuple[str, ...]
    base_model: str | None
    # module path -> (in_features, out_features) implied by the lora_A / lora_B shapes
    modules: dict[str, tuple[int, int]]
    config: dict


def find_adapter_dir(source: str | Path, agent: str | None = None) -> Path:
    """The directory holding ``adapter_config.json``: ``source`` itself or ``source/<agent>``
    (what ``save_pretrained(selected_adapters=[agent])`` writes)."""
    source = Path(source)
    if not source.is_dir():
        raise AdapterError(f"adapter directory {source} does not exist")
    if (source / CONFIG_FILE).is_file():
        return source
    if agent and (source / agent / CONFIG_FILE).is_file():
        return source / agent
    raise AdapterError(f"{source} holds no {CONFIG_FILE}" + (f" (nor {agent}/{CONFIG_FILE})" if agent else ""))


def read_weights(path: str | Path) -> bytes:
    """The bytes of an adapter directory's weights file; ``AdapterError`` when there is none (naming
    pickled weights found instead) or it cannot be read."""
    path = Path(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES) if path.is_dir() else []
        if pickled:
            raise AdapterError(
                f"{path}: only safetensors adapters are accepted, found pickle file(s) {', '.join(pickled)} "
                "(save with save_pretrained(..., safe_serialization=True))"
            )
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
    try:
        return weights.read_bytes()
    except OSError as e:
        raise AdapterError(f"{path}: cannot read {WEIGHTS_FILE} ({e})") from None


def load_weights(path: str | Path, data: bytes) -> dict:
    """The tensors of a weights file's bytes (``read_weights``); ``AdapterError`` when they are not safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except SafetensorError as e:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} is corrupt ({e})") from None


def read_config(path: str | Path) -> tuple[bytes, dict]:
    """An adapter directory's ``adapter_config.json``: its bytes (what the manifest hashes) and the
    JSON object they hold."""
    path = Path(path)
    try:
        data = (path / CONFIG_FILE).read_bytes()
        config = json.loads(data)
    except FileNotFoundError:
        raise AdapterError(f"{path}: no {CONFIG_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: {CONFIG_FILE} must hold a JSON object")
    return data, config


def inspect_adapter(path: str | Path, weights: dict | None = None, config: dict | None = None) -> AdapterInfo:
    """Parse and vet an adapter directory; raise ``AdapterError`` for anything unsafe or inconsistent.

    ``weights`` / ``config``: its tensors (``load_weights``) and config (``read_config``) as the caller
    loaded them, so what is vetted is what the caller goes on to use; else the files are read here.
    """
    path = Path(path)
    data = read_weights(path) if weights is None else None  # a missing weights file is named first
    if config is None:
        config = read_config(path)[1]
    rank, targets = _check_config(path, config)
    if weights is None:
        weights = load_weights(path, data)
    modules, amax = _lora_modules(path, weights, rank, targets)
    alpha, scale = _lora_scale(path, config, rank)
    # |(B @ A)[i, j]| <= r * max|A| * max|B|: finite here means no weight delta can overflow.
    bound = max(abs(scale) * rank * amax[f"base_model.model.{m}.lora_A.weight"]
                * amax[f"base_model.model.{m}.lora_B.weight"] for m in modules)
    lora_config(path, config)  # what the engine builds from this config: refused now, not at load
    info = AdapterInfo(
        path=str(path),
        rank=rank,
        alpha=alpha,
        scale=scale,
        delta_bound=bound,
        target_modules=tuple(sorted(targets)),
        base_model=config.get("base_model_name_or_path"),
        modules=modules,
        config=config,
    )
    # float32 is the widest range the server runs (bfloat16 has the same); the engine checks its own dtype.
    check_range(info)
    return info


def _check_config(path: Path, config: dict) -> tuple[int, list[str]]:
    """The config's rank and target modules, once it is known to be a plain LoRA config."""
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    # The same restrictions vLLM applies, so an adapter that serves here also serves there.
    if config.get("use_dora"):
        raise AdapterError(f"{path}: DoRA adapters are not supported")
    if config.get("lora_bias") or config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: LoRA bias terms are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save is not supported ({config['modules_to_save']})")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{path}: per-module rank_pattern/alpha_pattern is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}: rank r={rank!r} must be a positive integer")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{path}: target_modules must be a non-empty list of module names")
    return rank, targets


def _lora_modules(path: Path, weights: dict, rank: int,
                  targets: list[str]) -> tuple[dict[str, tuple[int, int]], dict[str, float]]:
    """module path -> (in_features, out_features) from paired lora_A / lora_B tensors of rank
    ``rank``, and each tensor key's largest |entry|."""
    shapes: dict[str, dict[str, tuple[int, int]]] = {}
    amax: dict[str, float] = {}
    for key, tensor in weights.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{path}: unexpected tensor {key!r} (only LoRA A/B weights are accepted)")
        if tensor.dim() != 2:
            raise AdapterError(f"{path}: tensor {key} has shape {tuple(tensor.shape)}, expected 2-D")
        if not bool(tensor.float().isfinite().all()):
            raise AdapterError(f"{path}: tensor {key} holds NaN or infinite values")
        shapes.setdefault(m["module"], {})[m["ab"]] = tuple(tensor.shape)
        amax[key] = float(tensor.double().abs().max()) if tensor.numel() else 0.0
    if not shapes:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")

    modules: dict[str, tuple[int, int]] = {}
    for module, ab in sorted(shapes.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: module {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
        (a_rank, in_features), (out_features, b_rank) = ab["A"], ab["B"]
        if a_rank != rank or b_rank != rank:
            raise AdapterError(
                f"{path}: module {module} has rank {a_rank}/{b_rank} in its weights but the config says r={rank}"
            )
        if not any(module == t or module.endswith("." + t) for t in targets):
            raise AdapterError(f"{path}: module {module} is not among target_modules {targets}")
        modules[module] = (in_features, out_features)
    return modules, amax


def _lora_scale(path: Path, config: dict, rank: int) -> tuple[float, float]:
    """``lora_alpha`` and what peft multiplies the LoRA output by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    alpha = config.get("lora_alpha", rank)
    try:  # a bool is an int to Python, not a number here; a huge JSON int does not fit a float
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(float(alpha)):
            raise OverflowError
    except OverflowError:
        raise AdapterError(f"{path}: lora_alpha {alpha!r} is not a finite number") from None
    return float(alpha), float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def check_range(info: AdapterInfo, dtype=None) -> None:
    """Refuse an adapter whose scale or weight delta would overflow ``dtype`` (default float32) and
    turn every output it touches into inf/NaN."""
    import torch

    dtype = dtype or torch.float32
    limit = torch.finfo(dtype).max
    if not abs(info.scale) <= limit:
        raise AdapterError(f"{info.path}: LoRA scale lora_alpha/r = {info.scale:g} overflows {dtype} (max {limit:g})")
    if not info.delta_bound <= limit:
        raise AdapterError(f"{info.path}: LoRA weight delta (scale * r * max|A| * max|B| = {info.delta_bound:g}) "
                           f"overflows {dtype} (max {limit:g})")


def lora_config(path: str | Path, config: dict):
    """The peft ``LoraConfig`` the engine loads ``config`` with (as ``LoraConfig.from_pretrained``
    builds it); ``AdapterError`` with peft's message when peft refuses it."""
    from peft import LoraConfig

    try:
        return LoraConfig.from_peft_type(**LoraConfig.check_kwargs(
            **{k: v for k, v in config.items() if k != "runtime_config"}))
    except Exception as e:  # noqa: BLE001 - ValueError, TypeError, ImportError (loftq needs scipy), ...
        raise AdapterError(f"{path}: peft refuses {CONFIG_FILE} ({type(e).__name__}: {e})") from None


def base_fingerprint(model_dir: str | Path) -> str | None:
    """A hash of a base model's architecture (its ``config.json`` without volatile keys), or None
    when ``model_dir`` is not a local model directory. Two bases with the same fingerprint accept
    the same adapters."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache"):
        cfg.pop(key, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def check_against_base(
    info: AdapterInfo,
    base_modules: dict[str, tuple[int, int]],
    *,
    base_name: str,
    base_fp: str | None,
    adapter_fp: str | None,
    max_rank: int,
    dtype=None,
) -> None:
    """Refuse an adapter that was not trained for this base, exceeds the server's rank limit or
    would overflow the base's ``dtype`` (default float32).

    ``base_modules`` maps module paths of the served base model to (in_features, out_features).
    """
    check_range(info, dtype)
    if info.rank > max_rank:
        raise AdapterError(f"{info.path}: rank {info.rank} exceeds the server's --max-lora-rank {max_rank}")
    if adapter_fp is not None and base_fp is not None and adapter_fp != base_fp:
        raise AdapterError(
            f"{info.path}: trained for base model {info.base_model!r} (fingerprint {adapter_fp}), "
            f"but this server runs {base_name!r} (fingerprint {base_fp})"
        )
    for module, (fin, fout) in info.modules.items():
        if module not in base_modules:
            raise AdapterError(f"{info.path}: target module {module} does not exist in base model {base_name!r}")
        if base_modules[module] != (fin, fout):
            raise AdapterError(
                f"{info.path}: module {module} is {fin}->{fout} in the adapter but "
                f"{base_modules[module][0]}->{base_modules[module][1]} in base model {base_name!r} (wrong base model)"
            )
