"""What the engine refuses: a request before it is queued (each check names the field at fault, so the
server answers 400 with OpenAI's ``param`` rather than failing in the worker), and an adapter before
it reaches a slot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..adapter_files import (base_fingerprint, check_against_base, inspect_adapter, load_weights, lora_config,
                             read_config, read_weights)
from .types import MAX_SEED, GenerationRequest, RequestError

if TYPE_CHECKING:
    from ..registry import AdapterRegistry


def check_request(req: GenerationRequest, *, max_tokens_limit: int, max_positions: int, vocab_size: int,
                  n_tokens: int) -> None:
    """``n_tokens``: the ids both the model and the tokenizer know (``allowed_token_ids`` must be among them)."""
    if not req.prompt_ids:
        raise RequestError("the prompt is empty", "prompt")
    if not 1 <= req.max_tokens <= max_tokens_limit:
        raise RequestError(f"max_tokens must be between 1 and {max_tokens_limit}, got {req.max_tokens}", "max_tokens")
    if len(req.prompt_ids) + req.max_tokens > max_positions:
        raise RequestError(
            f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
            f"context of {max_positions} tokens", "max_tokens", "context_length_exceeded"
        )
    if req.temperature < 0 or not 0 < req.top_p <= 1 or req.top_k < 0 or not 0 <= req.top_logprobs <= 20:
        raise RequestError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0, 0 <= top_logprobs <= 20")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise RequestError(f"seed must be between 0 and 2**63-1, got {req.seed}", "seed")
    if not all(0 <= t < vocab_size for t in req.prompt_ids):
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    allowed = req.allowed_token_ids
    if allowed is not None and (not allowed or len(allowed) > n_tokens
                                or not all(isinstance(t, int) and 0 <= t < n_tokens for t in allowed)):
        raise RequestError(f"allowed_token_ids must be 1 to {n_tokens} token ids in [0, {n_tokens})",
                           "allowed_token_ids")


def vet_adapter(path: str | Path, registry: AdapterRegistry | None, base_modules: dict[str, tuple[int, int]], *, base_name: str,
                base_fp: str | None, max_rank: int, dtype: Any) -> tuple[Any, dict]:
    """Read an adapter once, check it against the base model (and its registry manifest, when it has
    a ``registry``), and return its ``LoraConfig`` and weights. Raises ``AdapterError`` for a bad one.

    Read here, in the caller's thread: the bytes vetted and checked against the manifest are the
    bytes the worker puts into a slot (nothing reads the file again)."""
    from ..registry import read_manifest

    manifest = read_manifest(path) if registry is not None else None
    data, (config_data, config_dict) = read_weights(path), read_config(path)
    weights = load_weights(path, data)
    info = inspect_adapter(path, weights, config_dict)
    adapter_fp = manifest.base_fingerprint if manifest is not None else None
    if adapter_fp is None and info.base_model:
        adapter_fp = base_fingerprint(info.base_model)
    check_against_base(info, base_modules, base_name=base_name, base_fp=base_fp, adapter_fp=adapter_fp,
                       max_rank=max_rank, dtype=dtype)
    if manifest is not None:
        registry.check_files(path, data, config_data, manifest)
    # From the bytes checked above, as LoraConfig.from_pretrained builds it from the file.
    return lora_config(path, config_dict), weights
