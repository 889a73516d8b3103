"""The viewer's HTTP side: a read-only FastAPI app, JSON under ``/api``, the page and its assets
from the package (nothing from the network).

Security as for ``marft serve``: only GET (and HEAD) exist; with an API key every request needs it
(``Authorization: Bearer KEY``, or the ``marft_ui_key`` cookie that opening ``/?key=KEY`` once
sets); a ``..`` anywhere in the path or query is refused; pages are bounded. Without a key the
server answers only requests addressed to a loopback name (a web page elsewhere cannot reach it
through DNS rebinding).
"""

from __future__ import annotations

import secrets
from importlib import resources
from pathlib import Path
from urllib.parse import unquote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ..errors import MarftError
from .episodes import EpisodeIndex, action_page, action_view, episode_view
from .files import Runs, adapters_view

KEY_COOKIE = "marft_ui_key"
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def _static_files() -> dict[str, tuple[bytes, str]]:
    """The page's assets, read once from the package: a request can only pick one of these names."""
    root = resources.files("marft_bridge.ui") / "static"
    return {f.name: (f.read_bytes(), STATIC_TYPES[Path(f.name).suffix])
            for f in root.iterdir() if Path(f.name).suffix in STATIC_TYPES}


def _host_name(host_header: str) -> str:
    if host_header.startswith("["):
        return host_header[: host_header.find("]") + 1]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def load_decoder(path: str | Path):
    """``ids -> [text of each id]`` from a local tokenizer directory (the base model's, say)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - missing package, missing or unreadable files: one message
        raise MarftError(f"--tokenizer {path}: cannot load a tokenizer there ({type(e).__name__}: {e})") from None
    return lambda ids: [tok.decode([i]) for i in ids]


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _guard(api_key: str | None):
    """The middleware every request passes: read-only, no '..', and loopback only without a key, else
    the key (Bearer header, or the cookie ``/?key=KEY`` sets)."""
    async def guard(request: Request, call_next):
        if request.method not in ("GET", "HEAD"):
            return error(405, "marft ui is read-only")
        raw = request.scope.get("raw_path", b"").decode("latin-1") + "?" + request.scope.get("query_string", b"").decode("latin-1")
        if ".." in raw or ".." in unquote(unquote(raw)):
            return error(400, "'..' is not allowed in a path or parameter")
        if api_key is None:
            if _host_name(request.headers.get("host", "")) not in LOOPBACK_NAMES:
                return error(403, "without --api-key marft ui answers only requests to a loopback address")
            return await call_next(request)
        given = request.headers.get("authorization", "")
        token = given[7:] if given.startswith("Bearer ") else request.cookies.get(KEY_COOKIE, "")
        query_key = request.query_params.get("key")
        if query_key is not None and secrets.compare_digest(query_key.encode(), api_key.encode()):
            # Opening /?key=KEY once keeps the key in a cookie, then drops it from the address bar.
            resp = RedirectResponse(request.url.path, status_code=303)
            resp.set_cookie(KEY_COOKIE, api_key, httponly=True, samesite="strict")
            return resp
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            return error(401, "invalid or missing API key (Authorization: Bearer KEY, or open /?key=KEY)")
        return await call_next(request)

    return guard


def create_app(store, *, registry: str | Path | None = None, runs: list[str | Path] = (),
               service_state: str | Path | None = None, api_key: str | None = None,
               tokenizer: str | Path | None = None):
    from ..store import EpisodeNotFound

    index = EpisodeIndex(store)
    run_dirs = Runs(list(runs))
    registry_dir = Path(registry).expanduser().resolve() if registry else None
    state_dir = Path(service_state).expanduser().resolve() if service_state else None
    static = _static_files()
    decode = load_decoder(tokenizer) if tokenizer else None
    app = FastAPI(title="marft ui", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.index = index

    app.middleware("http")(_guard(api_key))

    @app.exception_handler(MarftError)
    async def bad_request(_request, exc: MarftError):
        return error(400, str(exc))

    @app.exception_handler(EpisodeNotFound)
    async def not_found(_request, exc: EpisodeNotFound):  # also EpisodeUnreadable: says it was moved aside
        return error(404, str(exc))

    @app.exception_handler(ValueError)
    async def bad_value(_request, exc: ValueError):
        return error(400, f"bad parameter: {exc}")

    @app.exception_handler(RequestValidationError)  # a typed parameter (cursor=abc): our shape, not FastAPI's 422
    async def bad_parameter(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
        return error(400, f"{where}: {first.get('msg', 'invalid')}")

    def page_params(request: Request) -> dict[str, str]:
        return dict(request.query_params)

    @app.get("/")
    def page():
        body, kind = static["index.html"]
        return Response(body, media_type=kind, headers={"Cache-Control": "no-store"})

    @app.get("/static/{name}")
    def asset(name: str):
        if name not in static:
            return error(404, f"no asset {name!r}")
        body, kind = static[name]
        return Response(body, media_type=kind)

    @app.get("/api/meta")
    def meta():
        index.refresh()
        return {"store": store.url, "registry": str(registry_dir) if registry_dir else None,
                "runs": [str(r) for r in run_dirs.roots], "service_state": str(state_dir) if state_dir else None,
                "cursor": index.cursor, "stats": store.stats()}

    @app.get("/api/episodes")
    def episodes(request: Request):
        return index.query(page_params(request))

    @app.get("/api/changes")
    def changes(cursor: int = 0):
        return index.changes(cursor)

    @app.get("/api/dead-letters")
    def dead_letters(limit: int = 50):
        if not 1 <= limit <= 200:
            raise MarftError("limit must be 1..200")
        return {"items": [d.model_dump(mode="json") for d in store.dead_letters(limit, raw_chars=2000)]}

    @app.get("/api/episodes/{episode_id}")
    def episode(episode_id: str):
        return episode_view(index.episode(episode_id))

    @app.get("/api/episodes/{episode_id}/actions")
    def actions(episode_id: str, request: Request):
        return action_page(index.episode(episode_id), page_params(request))

    @app.get("/api/episodes/{episode_id}/actions/{action_id}")
    def action(episode_id: str, action_id: str):
        ep = index.episode(episode_id)
        try:
            return action_view(ep, action_id, decode)
        except KeyError:
            return error(404, f"episode {episode_id!r} has no action {action_id!r}")

    @app.get("/api/episodes/{episode_id}/export")
    def export(episode_id: str):
        ep = index.episode(episode_id)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in episode_id)[:80]
        return Response(ep.to_json(), media_type="application/json",
                        headers={"Content-Disposition": f'attachment; filename="episode-{safe}.json"'})

    @app.get("/api/runs")
    def runs_list():
        return {"roots": [str(r) for r in run_dirs.roots], "runs": run_dirs.list()}

    @app.get("/api/runs/{name:path}")
    def run(name: str):
        found = run_dirs.series(name)
        return error(404, f"no training run {name!r}") if found is None else found

    @app.get("/api/adapters")
    def adapters():
        return adapters_view(registry_dir, state_dir, index.served())

    @app.get("/api/{rest:path}")
    def unknown(rest: str):
        return error(404, f"no endpoint /api/{rest}")

    return app
