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
from fastapi.responses import RedirectResponse

from ..errors import MarftError
from .episodes import EpisodeIndex
from .files import Runs
from .routes import ViewerContext, error, router

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
    """The viewer's app: ``routes.router`` over a ``ViewerContext`` on ``app.state.viewer``, behind
    ``_guard``; every error is JSON ``{"error": ...}``."""
    from ..store import EpisodeNotFound

    app = FastAPI(title="marft ui", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.viewer = ViewerContext(
        store=store, index=EpisodeIndex(store), runs=Runs(list(runs)),
        registry_dir=Path(registry).expanduser().resolve() if registry else None,
        state_dir=Path(service_state).expanduser().resolve() if service_state else None,
        static=_static_files(), decode=load_decoder(tokenizer) if tokenizer else None)
    app.state.index = app.state.viewer.index
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

    app.include_router(router)
    return app
