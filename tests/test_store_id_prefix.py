"""Episode ids by unique prefix (issue 34), as git and docker take them: ``TraceStore.get_episode`` and
``resolve_id`` on SQLite and PostgreSQL, ``marft traces show/export/reward`` and ``marft ui`` URLs. An
exact id always wins; an ambiguous prefix is a clear error naming how many and some candidates; ``%``,
``_``, ``/`` and ``\\`` in ids are matched as themselves, and case counts (SQLite's LIKE ignores it)."""

from __future__ import annotations

import json

import pytest
from test_store import make_episode

from marft_bridge.cli import main as marft
from marft_bridge.errors import MarftError
from marft_bridge.store import AmbiguousEpisodeId, EpisodeNotFound, TraceStore


def fill(store, ids) -> None:
    for i, eid in enumerate(ids):
        store.add_episode(make_episode(i, eid=eid, n=2))


def test_a_unique_prefix_names_the_episode_and_an_exact_id_wins(store):
    fill(store, ["0a1b2c3d-x", "0a1b2c3d-y", "0a1bzzzz", "ep-1", "ep-10"])
    assert store.get_episode("0a1bz").id == "0a1bzzzz"
    assert store.get_episode("0a1b2c3d-y").id == "0a1b2c3d-y"
    assert store.resolve_id("ep-1") == "ep-1"  # also the prefix of ep-10: the exact id wins
    assert store.get_episode("ep-10").id == "ep-10"
    with pytest.raises(AmbiguousEpisodeId) as e:
        store.get_episode("0a1b")
    assert (e.value.count, e.value.candidates) == (3, ["0a1b2c3d-x", "0a1b2c3d-y", "0a1bzzzz"])
    assert str(e.value) == ("episode id prefix '0a1b' is ambiguous: 3 stored episodes start with it (0a1b2c3d-x, "
                            "0a1b2c3d-y, 0a1bzzzz); give more characters")
    assert isinstance(e.value, MarftError) and not isinstance(e.value, KeyError)
    with pytest.raises(EpisodeNotFound, match=r"^episode '0a1' is not in the store \(a prefix needs at least 4 "
                                              r"characters\)$"):
        store.get_episode("0a1")
    with pytest.raises(EpisodeNotFound, match=r"^episode 'ffff' is not in the store$"):
        store.get_episode("ffff")
    with pytest.raises(EpisodeNotFound):
        store.get_episode("0a1bz", exact=True)  # exact: the whole id only
    assert store.get_episode("ep-1", exact=True).id == "ep-1"


def test_many_candidates_are_counted_and_a_few_named(store):
    fill(store, [f"dup0-{k}" for k in range(7)])
    with pytest.raises(AmbiguousEpisodeId) as e:
        store.resolve_id("dup0")
    assert e.value.count == 7 and e.value.candidates == [f"dup0-{k}" for k in range(5)]
    assert str(e.value).endswith("(dup0-0, dup0-1, dup0-2, dup0-3, dup0-4, ... (2 more)); give more characters")


def test_like_wildcards_escape_characters_and_case_are_matched_literally(store):
    fill(store, ["ab%cd-1", "ab_cd-2", "abxcd-3", "abXcd-4", "AB%CD-5", "a/b/c-6", "a/bxc-7", "a\\b\\-8", "a\\bx-9"])
    # Unescaped, '%' and '_' would match any character(s): ab%c and ab_c would each be ambiguous.
    assert store.resolve_id("ab%c") == "ab%cd-1"
    assert store.resolve_id("ab_c") == "ab_cd-2"
    # SQLite's LIKE ignores the case of ASCII letters; a prefix does not.
    assert store.resolve_id("abxc") == "abxcd-3"
    assert store.resolve_id("abXc") == "abXcd-4"
    assert store.resolve_id("AB%C") == "AB%CD-5"
    # '/' is SQLAlchemy's escape character, '\\' PostgreSQL's default one: both are plain characters here.
    assert store.resolve_id("a/b/") == "a/b/c-6"
    assert store.resolve_id("a/bx") == "a/bxc-7"
    assert store.resolve_id("a\\b\\") == "a\\b\\-8"
    assert store.resolve_id("a\\bx") == "a\\bx-9"
    with pytest.raises(EpisodeNotFound):
        store.resolve_id("ab%%")


def test_traces_show_export_and_reward_take_prefixes(tmp_path, capsys):
    db = tmp_path / "t.db"
    with TraceStore.open(db) as store:
        fill(store, ["01a23d34ffee", "01a23d99ffee", "77aa00"])
    assert marft(["traces", "show", "01a23d3", "--store", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == "01a23d34ffee"

    assert marft(["traces", "show", "01a23d", "--store", str(db)]) == 1
    err = capsys.readouterr().err
    assert err == ("marft: error: episode id prefix '01a23d' is ambiguous: 2 stored episodes start with it "
                   "(01a23d34ffee, 01a23d99ffee); give more characters\n")

    out = tmp_path / "two.jsonl"
    assert marft(["traces", "export", str(out), "--id", "01a23d9", "--id", "77aa", "--store", str(db)]) == 0
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["01a23d99ffee", "77aa00"]
    assert marft(["traces", "export", str(out), "--id", "01a2", "--store", str(db)]) == 1
    assert "is ambiguous: 2 stored episodes" in capsys.readouterr().err

    assert marft(["traces", "reward", "77aa", "0.5", "--store", str(db)]) == 0
    assert capsys.readouterr().out.strip().endswith("added to episode 77aa00")
    with TraceStore.open(db) as store:
        assert store.get_episode("77aa00").team_reward() == 0.5


def test_ui_urls_take_prefixes(store):
    from fastapi.testclient import TestClient

    from marft_bridge.ui.app import create_app

    fill(store, ["0a1b2c3d-x", "0a1b2c3d-y", "0a1bzzzz"])
    app = create_app(store)
    assert app.state.index.ready.wait(60)
    c = TestClient(app, base_url="http://127.0.0.1")
    assert c.get("/api/episodes/0a1bz").json()["summary"]["id"] == "0a1bzzzz"
    assert c.get("/api/episodes/0a1b2c3d-x/actions").status_code == 200
    actions = c.get("/api/episodes/0a1bzz/actions").json()
    assert actions["total"] == 2
    r = c.get("/api/episodes/0a1b2c3d")
    assert r.status_code == 400
    assert "ambiguous: 2 stored episodes start with it (0a1b2c3d-x, 0a1b2c3d-y)" in r.json()["error"]
    assert c.get("/api/episodes/0a1").status_code == 404
