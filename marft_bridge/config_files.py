"""Typed configs from YAML files: one clear error line for an unreadable file or a bad option."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from .errors import MarftError

M = TypeVar("M", bound=BaseModel)


def load_yaml_config(cls: type[M], path: str | Path) -> M:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise MarftError(f"cannot read config {path}: {e}") from None
    if not isinstance(data, dict):
        raise MarftError(f"config {path}: expected a mapping of options, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise MarftError(f"config {path}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None
