"""Where training episodes come from: a TraceStore URL or a JSONL file of ``Episode.model_dump_json()``."""

from __future__ import annotations

import logging

from ..errors import MarftError, RecordError
from ..schema import Episode

log = logging.getLogger("marft_bridge.trainers")


def read_jsonl(path) -> tuple[list[Episode], int]:
    """Valid episodes of a JSONL file, and how many bad lines were skipped (each logged with its reason).
    Lines are read as the store's import reads them: never past the record limit (``max_record_bytes``)."""
    from ..store.files import read_jsonl_episodes

    episodes, bad = [], 0
    try:
        for item in read_jsonl_episodes(path, label=str(path)):
            if isinstance(item, RecordError):
                bad += 1
                log.warning("skipped: %s", item)
            else:
                episodes.append(item)
    except OSError as e:
        raise MarftError(f"cannot read episodes {path}: {e}") from None
    return episodes, bad


def load_episodes(store: str | None = None, episodes_file: str | None = None) -> list[Episode]:
    """Rewarded episodes from a store URL and/or a JSONL file."""
    if not store and not episodes_file:
        raise MarftError("give --store URL or --episodes FILE.jsonl")
    out: list[Episode] = []
    if store:
        from ..store import TraceStore

        with TraceStore.open(store) as ts:
            out += list(ts.episodes(has_reward=True))
    if episodes_file:
        out += read_jsonl(episodes_file)[0]
    return out

