"""Shared fixtures. Store-backend fixtures run every store test on SQLite and, where a server is
reachable, PostgreSQL (CI sets MARFT_TEST_POSTGRES_URL)."""

from __future__ import annotations

import os

import pytest

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny character-level Llama + tokenizer saved as a transformers directory (built once)."""
    from marft_bridge.tinymodel import build_tiny_model

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
