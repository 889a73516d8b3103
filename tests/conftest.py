"""Shared fixtures. Store-backend fixtures run every store test on SQLite and, where a server is
reachable, PostgreSQL (CI sets MARFT_TEST_POSTGRES_URL)."""

from __future__ import annotations

import os

import pytest

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny character-level Llama + tokenizer saved as a transformers directory (built once)."""
    from marft_bridge.demo.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "base", seed=0)


@pytest.fixture(scope="session")
def postgres_url():
    """URL of a reachable PostgreSQL server, or skip with the reason."""
    url = os.environ.get("MARFT_TEST_POSTGRES_URL", DEFAULT_PG_URL)
    try:
        import sqlalchemy as sa

        engine = sa.create_engine(url)
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
        engine.dispose()
    except Exception as e:  # noqa: BLE001 - any failure means "no server here"
        pytest.skip(f"PostgreSQL not reachable at {url} ({type(e).__name__}); set MARFT_TEST_POSTGRES_URL")
    return url


def _pg_schema_url(base: str, schema: str) -> str:
    import sqlalchemy as sa

    u = sa.make_url(base)
    return u.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)


@pytest.fixture
def pg_store_url(postgres_url):
    """A PostgreSQL store URL in a fresh schema of its own (dropped afterwards), so tests of several
    engineers can share one database."""
    import uuid

    import sqlalchemy as sa

    schema = f"marft_test_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f'create schema "{schema}"'))
    try:
        yield _pg_schema_url(postgres_url, schema)
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f'drop schema "{schema}" cascade'))
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    """A fresh, empty store URL on each backend (the PostgreSQL case skips without a server)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'traces.db'}"
    return request.getfixturevalue("pg_store_url")


@pytest.fixture
def store(store_url):
    """An open TraceStore on each backend, closed after the test."""
    from marft_bridge.store import TraceStore

    s = TraceStore.open(store_url)
    yield s
    s.close()


@pytest.fixture
def sqlite_store(tmp_path):
    """An open SQLite TraceStore, closed after the test: for capture tests, which test what is
    recorded, not the backend (``store`` runs the store's own tests on each backend)."""
    from marft_bridge.store import TraceStore

    s = TraceStore.open(tmp_path / "traces.db")
    yield s
    s.close()
