"""The viewer's routes: read-only JSON under ``/api``, the page and its assets. Each handler reads the
``ViewerContext`` on ``app.state.viewer``, set by ``app.create_app``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..errors import MarftError
from .episodes import EpisodeIndex, action_page, action_view, episode_view
from .files import Runs, adapters_view
from .releases import DEFAULT_MARGIN, LiveRewards, releases_view

router = APIRouter()


@dataclass
class ViewerContext:
    """What the viewer serves from: the store and its index, the training runs, the registry and the
    service's state, the page's assets and an optional token decoder."""

    store: Any
    index: EpisodeIndex
    runs: Runs
    registry_dir: Path | None
    state_dir: Path | None
    static: dict[str, tuple[bytes, str]]
    decode: Callable[[list[int]], list[str]] | None
    live: LiveRewards | None = None  # made at the first /api/releases (its first look reads the store)


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _ctx(request: Request) -> ViewerContext:
    return request.app.state.viewer


@router.get("/")
def page(request: Request):
    body, kind = _ctx(request).static["index.html"]
    return Response(body, media_type=kind, headers={"Cache-Control": "no-store"})


@router.get("/static/{name}")
def asset(name: str, request: Request):
    static = _ctx(request).static
    if name not in static:
        return error(404, f"no asset {name!r}")
    body, kind = static[name]
    return Response(body, media_type=kind)


@router.get("/api/meta")
def meta(request: Request):
    c = _ctx(request)
    c.index.refresh()
    return {"store": c.store.url, "registry": str(c.registry_dir) if c.registry_dir else None,
            "runs": [str(r) for r in c.runs.roots], "service_state": str(c.state_dir) if c.state_dir else None,
            "cursor": c.index.cursor, "stats": c.store.stats()}


@router.get("/api/episodes")
def episodes(request: Request):
    return _ctx(request).index.query(dict(request.query_params))


@router.get("/api/changes")
def changes(request: Request, cursor: int = 0):
    return _ctx(request).index.changes(cursor)


@router.get("/api/dead-letters")
def dead_letters(request: Request, limit: int = 50):
    if not 1 <= limit <= 200:
        raise MarftError("limit must be 1..200")
    return {"items": [d.model_dump(mode="json") for d in _ctx(request).store.dead_letters(limit, raw_chars=2000)]}


@router.get("/api/episodes/{episode_id}")
def episode(episode_id: str, request: Request):
    return episode_view(_ctx(request).index.episode(episode_id))


@router.get("/api/episodes/{episode_id}/actions")
def actions(episode_id: str, request: Request):
    return action_page(_ctx(request).index.episode(episode_id), dict(request.query_params))


@router.get("/api/episodes/{episode_id}/actions/{action_id}")
def action(episode_id: str, action_id: str, request: Request):
    c = _ctx(request)
    ep = c.index.episode(episode_id)
    try:
        return action_view(ep, action_id, c.decode)
    except KeyError:
        return error(404, f"episode {episode_id!r} has no action {action_id!r}")


@router.get("/api/episodes/{episode_id}/export")
def export(episode_id: str, request: Request):
    ep = _ctx(request).index.episode(episode_id)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in ep.id)[:80]
    return Response(ep.to_json(), media_type="application/json",
                    headers={"Content-Disposition": f'attachment; filename="episode-{safe}.json"'})


@router.get("/api/runs")
def runs_list(request: Request):
    runs = _ctx(request).runs
    return {"roots": [str(r) for r in runs.roots], "runs": runs.list()}


@router.get("/api/runs/{name:path}")
def run(name: str, request: Request):
    found = _ctx(request).runs.series(name)
    return error(404, f"no training run {name!r}") if found is None else found


@router.get("/api/adapters")
def adapters(request: Request):
    c = _ctx(request)
    return adapters_view(c.registry_dir, c.state_dir, c.index.served())


@router.get("/api/releases")
def releases(request: Request, margin: float = DEFAULT_MARGIN):
    if not 0 <= margin < float("inf"):
        raise MarftError("margin must be a number >= 0")
    c = _ctx(request)
    if c.live is None:
        c.live = LiveRewards(c.store)
    return releases_view(c.registry_dir, c.live, margin)


@router.get("/api/{rest:path}")
def unknown(rest: str):
    return error(404, f"no endpoint /api/{rest}")
