"""Hostile records: free-form JSON nested 300 and 3,000 levels deep is refused at every entry to the
store — capture (an instrumented LangGraph app, ``episode(...)``, ``submit``), ``add_episode``,
JSONL and Parquet import, the OTel processor — and dead-lettered with a bounded, non-recursive
preview naming the record and field, while every other episode still exports, trains and lists in
``marft ui``. A store that already holds rows that cannot be read back (written with SQL) still
iterates, exports and lists, and ``marft traces doctor`` moves them to the dead letters. Import holds
at most one record's limit in memory, whatever the length of a line.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any, TypedDict

import pytest
import sqlalchemy as sa
from test_schema import nested

import marft_bridge as mb
from marft_bridge.cli import main as marft
from marft_bridge.errors import MarftError, RecordError
from marft_bridge.limits import RecordLimits, first_over_limits, over_limits
from marft_bridge.schema import Action, Episode, Reward
from marft_bridge.store import EpisodeNotFound, EpisodeUnreadable, TraceStore
from marft_bridge.store.rows import MAX_DEAD_LETTER_CHARS

DEPTHS = (300, 3000)


def nested_text(depth: int) -> str:
    return '{"k": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def good_episode(i: int, eid: str | None = None) -> Episode:
    """One trainable planner call (prompt and sampled token ids, behaviour log-probs) with a team reward."""
    act = Action(id=f"g{i}-a", agent="planner", observation={"prompt_token_ids": [5, 6, 7]},
                 output={"text": "ok", "token_ids": [8, 9], "logprobs": [-0.5, -0.25]}, metadata={"n": i})
    return Episode(id=eid or f"g{i}", task={"i": i}, actions=[act], rewards=[Reward(value=1.0)])


def poisoned(eid: str, depth: int, where: str = "task") -> dict:
    """A good episode's JSON with ``nested(depth)`` at ``where``."""
    data = good_episode(0, eid).model_dump(mode="json")
    data["actions"][0]["id"] = f"{eid}-a"
    if where == "task":
        data["task"] = nested(depth)
    elif where == "metadata":
        data["metadata"] = {"ctx": nested(depth)}
    else:  # tool arguments, as an app's user controls them
        data["actions"][0]["observation"]["messages"] = [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested(depth)}}]}]
    return data


def usable(store: TraceStore, tmp_path, expected: set[str]) -> None:
    """Every stored episode exports, trains (the trainer's own store source and batch builder) and lists in the UI."""
    from test_ui_api import client_for

    from marft_bridge.demo.tinymodel import build_tokenizer
    from marft_bridge.trainers.batch import build_batch
    from marft_bridge.trainers.sources import load_episodes, read_jsonl
    from marft_bridge.ui.app import create_app

    out = tmp_path / "usable.jsonl"
    assert store.export(out) == len(expected)
    exported, bad = read_jsonl(out)
    assert bad == 0 and {e.id for e in exported} == expected
    tok = build_tokenizer()
    for episodes in (exported, load_episodes(store.url)):  # the file, and `marft train --store`'s own source
        batch = build_batch(episodes, tok, {"planner"}, len(tok), 64, default_temperature=1.0)
        assert sorted(s.action_id for s in batch.samples) == sorted(f"{i}-a" for i in expected)
    listed = client_for(create_app(store)).get("/api/episodes", params={"limit": 200}).json()
    assert {r["id"] for r in listed["items"]} == expected


def letter_for(store: TraceStore, record_start: str):
    (letter,) = [d for d in store.dead_letters() if (d.record or "").startswith(record_start)]
    return letter


# -- the limits themselves -------------------------------------------------------------------------


@pytest.fixture
def fresh_defaults():
    """Validation without a store reads the environment at first use: start and end this test unread."""
    from marft_bridge.limits import default_limits

    default_limits.cache_clear()
    yield
    default_limits.cache_clear()


def test_limits_defaults_environment_and_overrides(monkeypatch, tmp_path, fresh_defaults):
    assert RecordLimits() == RecordLimits(max_depth=64, max_field_bytes=2_000_000, max_record_bytes=64 * 2**20)
    monkeypatch.setenv("MARFT_MAX_JSON_DEPTH", "16")
    monkeypatch.setenv("MARFT_MAX_RECORD_BYTES", "1_000_000")
    assert RecordLimits.from_env() == RecordLimits(max_depth=16, max_record_bytes=1_000_000)
    with TraceStore.open(tmp_path / "a.db") as store:
        assert store.limits.max_depth == 16
    with TraceStore.open(tmp_path / "b.db", limits={"max_field_bytes": 4096}) as store:
        assert (store.limits.max_depth, store.limits.max_field_bytes) == (16, 4096)
        with pytest.raises(RecordError, match="metadata: .*over the 4,096-byte limit"):
            store.add_episode({"id": "big", "metadata": {"blob": "x" * 5000}})
        assert store.dead_letters()[0].field == "metadata"
    monkeypatch.setenv("MARFT_MAX_JSON_DEPTH", "500")  # past 128: the parser's own 200 would be reachable
    with pytest.raises(MarftError, match="max_depth .*MARFT_MAX_JSON_DEPTH.*128"):
        RecordLimits.from_env()
    monkeypatch.setenv("MARFT_MAX_JSON_DEPTH", "deep")
    with pytest.raises(MarftError, match="MARFT_MAX_JSON_DEPTH='deep': not a whole number"):
        TraceStore.open(tmp_path / "c.db")
    monkeypatch.setenv("MARFT_MAX_JSON_DEPTH", "8")  # validation without a store: the defaults, from the environment
    with pytest.raises(ValueError, match="task: JSON nested more than 8 levels"):
        Episode(task=nested(9))


def test_the_walk_is_iterative_and_exact_at_the_edges():
    limits = RecordLimits(max_depth=64, max_field_bytes=10_000)
    assert over_limits(nested(64), limits) is None
    assert "more than 64 levels" in over_limits(nested(65), limits)
    assert "more than 64 levels" in over_limits(nested(100_000), limits)  # no RecursionError
    loop: dict[str, Any] = {}
    loop["self"] = loop
    assert "more than 64 levels" in over_limits(loop, limits)
    assert over_limits([["x" * 4000], {"y": "z" * 4000}], limits) is None
    assert "over the 10,000-byte limit" in over_limits({"y": "é" * 6000}, limits)  # UTF-8 bytes, not characters
    assert over_limits("x" * 10_000, limits) is None and over_limits("x" * 10_001, limits)
    # The fields of one record are judged together first, then one by one: each is held to its own limit.
    two = [("a", {"x": "y" * 6000}), ("b", {"x": "z" * 6000})]
    assert first_over_limits(two, limits) is None  # 12,000 bytes together, 6,000 each
    assert first_over_limits([("a", nested(64)), ("b", nested(64))], limits) is None
    assert first_over_limits([("a", {"x": 1}), ("b", nested(65)), ("c", nested(99))], limits)[0] == "b"


# Where each free-form field sits in a record: a record holding a value there, the path to the value
# in the record's JSON, and the levels the field's own shape adds around it.
PLACES = {
    "task": (lambda v: {"task": v}, "task", 0),
    "metadata": (lambda v: {"metadata": {"x": v}}, "metadata.x", 1),
    "actions.0.metadata": (lambda v: {"actions": [{"agent": "p", "metadata": {"x": v}}]}, "actions.0.metadata.x", 1),
    "actions.0.output.tool_calls": (lambda v: {"actions": [{"agent": "p", "output": {"tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": v}}]}}]},
        "actions.0.output.tool_calls.0.function.arguments", 3),
    "actions.0.observation.tools": (lambda v: {"actions": [{"agent": "p", "observation": {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": v}}]}}]},
        "actions.0.observation.tools.0.function.parameters", 3),
    "rewards.0.metadata": (lambda v: {"rewards": [{"value": 1.0, "metadata": {"x": v}}]}, "rewards.0.metadata.x", 1),
}


def at(data: Any, path: str) -> Any:
    for part in path.split("."):
        data = data[int(part)] if part.isdigit() else data[part]
    return data


@pytest.mark.parametrize("field", sorted(PLACES))
def test_the_store_holds_each_free_form_field_to_the_limits_exactly(tmp_path, field):
    shape, path, around = PLACES[field]
    depth = 8 - around  # what a value there may nest, with 8 levels allowed
    # At the limit, wide (more brackets than levels) and with brackets inside its strings.
    wide = [nested(depth - 1)] * 12 + ["]]]}}}[[{{" * 3, {"k": '"\\]"'}]
    with TraceStore.open(tmp_path / "t.db", limits={"max_depth": 8, "max_field_bytes": 4096}) as store:
        for k, (value, refused) in enumerate([(wide, None), ([nested(depth)], "more than 8 levels"),
                                              ({"blob": "x" * 4100}, "over the 4,096-byte limit")]):
            for how in ("add", "submit"):
                raw = {"id": f"{how}{k}", **shape(value)}
                if how == "add" and refused:
                    with pytest.raises(RecordError, match=refused) as e:
                        store.add_episode(raw)
                    assert e.value.field == field
                elif how == "add":
                    store.add_episode(raw)
                else:
                    store.submit(Episode.model_validate(raw, context={"limits": None}))  # queued as JSON
        store.flush()
        assert {e.id for e in store.episodes()} == {"add0", "submit0"}
        assert at(store.get_episode("add0").model_dump(mode="json"), path) == wide
        assert sorted((d.record, d.field) for d in store.dead_letters()) == sorted(
            (f"episode {how}{k}", field) for how in ("add", "submit") for k in (1, 2))


# -- every entry refuses a deep record, the rest goes on ---------------------------------------------


class _State(TypedDict, total=False):
    q: str
    ctx: Any
    a: str


def deep_input_app(store):
    """A LangGraph app whose input carries the user's context; its planner node calls a (fake) chat model."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langgraph.graph import END, START, StateGraph

    model = GenericFakeChatModel(messages=iter([AIMessage(f"answer {k}") for k in range(10)]))
    g = StateGraph(_State)
    g.add_node("plan", lambda s: {"a": model.invoke(s["q"]).content}, metadata={"agent_name": "planner"})
    g.add_edge(START, "plan")
    g.add_edge("plan", END)
    return mb.instrument(g.compile(), store=store)


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_deep_record_through_capture_add_and_submit_is_dead_lettered_and_the_rest_is_usable(store, tmp_path, depth):
    for i in range(3):
        store.add_episode(good_episode(i))
    with pytest.raises(RecordError) as e:
        store.add_episode(poisoned("added", depth))
    assert (e.value.record, e.value.field) == ("episode added", "task")
    assert "more than 64 levels deep" in e.value.reason and "max_depth" in e.value.reason
    store.submit(poisoned("submitted", depth, "metadata"))
    store.submit(poisoned("tool-args", depth, "tool_calls"))
    store.submit(good_episode(3))  # the writer's group goes on past the refusals
    app = deep_input_app(store)
    assert app.invoke({"q": "hi", "ctx": nested(depth)})["a"] == "answer 0"  # the app is unaffected
    captured = app.last_episode_id
    with mb.episode(store=store, task=nested(depth)) as ep:
        ep.record_action("planner", output={"text": "hi"})
    store.flush()
    assert store.count() == 4
    assert letter_for(store, "episode submitted").field == "metadata"
    assert letter_for(store, "episode tool-args").field == "actions.0.observation.messages.0.tool_calls"
    assert letter_for(store, f"episode {captured}").field == "task"
    assert letter_for(store, f"episode {ep.id}").field == "task"
    for d in store.dead_letters():
        assert "max_depth" in d.reason and len(d.raw) < 100_000
        assert '"…"' in d.raw and d.raw.endswith("}")  # the levels past the preview's depth cut, the rest kept
    assert letter_for(store, "episode added").raw.startswith('{"schema_version": 3, "id": "added", "source": "manual"')
    usable(store, tmp_path, {"g0", "g1", "g2", "g3"})


def test_deep_jsonl_and_parquet_records_are_refused_and_the_import_goes_on(store, tmp_path):
    for i in range(2):
        store.add_episode(good_episode(i))
    lines = [good_episode(2).model_dump_json()]
    for depth in DEPTHS:
        lines.append('{"id": "deep-%d", "task": %s}' % (depth, nested_text(depth)))
    lines.append('{"id": "deep-metadata", "metadata": %s}' % nested_text(300))
    lines.append(good_episode(3).model_dump_json())
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    report = store.import_(src)
    assert (report.added, report.refused) == (2, 3)
    reasons = {r.record: r.reason for r in report.refusals}
    assert "task: JSON nested more than 64 levels deep" in reasons["in.jsonl line 2, episode deep-300"]
    assert "JSON nested too deep to read" in reasons["in.jsonl line 3"]  # the parser's own stack: refused, not a crash
    assert "metadata: JSON nested" in reasons["in.jsonl line 4, episode deep-metadata"]

    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    with TraceStore.open(tmp_path / "other.db") as other:
        other.add_episode(good_episode(4))
        other.add_episode(good_episode(5))
        other.export(good)
    table = pq.read_table(good)
    rows = table.to_pylist()
    deep = dict(rows[0], episode_id="deep-pq", action_id="deep-pq-a")
    deep["episode_json"] = '{"id": "deep-pq", "task": %s}' % nested_text(3000)
    deep["action_json"] = rows[0]["action_json"].replace('"g4-a"', '"deep-pq-a"')
    mixed = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist([rows[0], deep, rows[1]], schema=table.schema), mixed)
    report = store.import_(mixed)
    assert (report.added, report.refused) == (2, 1)
    (refusal,) = report.refusals
    assert refusal.record == "mixed.parquet rows 1-1" and "nested too deep to read" in refusal.reason
    assert store.stats()["dead_letters"] == 4
    usable(store, tmp_path, {f"g{i}" for i in range(6)})


def test_the_cli_import_of_a_deep_line_is_one_refusal_not_a_traceback(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "deep", "task": %s}\n%s\n' % (nested_text(3000), good_episode(1).model_dump_json()))
    db = tmp_path / "t.db"
    assert marft(["traces", "import", str(src), "--store", str(db)]) == 1
    out = capsys.readouterr()
    assert "1 added, 1 refused" in out.out and "Traceback" not in out.out + out.err
    assert marft(["traces", "export", str(tmp_path / "out.jsonl"), "--store", str(db)]) == 0
    assert [json.loads(x)["id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == ["g1"]


def otel_app(store):
    """An OTel-instrumented app's one workflow with one chat span, captured into ``store``; a call
    traces one run with the given task text."""
    from opentelemetry.sdk.trace import TracerProvider

    from marft_bridge.integrations import otel

    tp = TracerProvider()
    tp.add_span_processor(otel.EpisodeSpanProcessor(store))
    tracer = tp.get_tracer("app")

    def trace(task_text: str) -> None:
        msgs = json.dumps([{"role": "user", "parts": [{"type": "text", "content": task_text}]}])
        with tracer.start_as_current_span("invoke_workflow app", attributes={
                "gen_ai.operation.name": "invoke_workflow", "gen_ai.input.messages": msgs}):
            with tracer.start_as_current_span("chat m", attributes={"gen_ai.operation.name": "chat",
                                                                     "gen_ai.request.model": "m"}):
                pass

    return trace


def test_the_otel_processor_judges_a_trace_by_its_stores_limits(tmp_path):
    """A store whose limits are looser than the defaults takes from OTel what it would take from
    any other entry; one stricter refuses it, dead-lettered with the trace's name."""
    loose = TraceStore.open(f"sqlite:///{tmp_path / 'loose.db'}", limits={"max_depth": 100})
    strict = TraceStore.open(f"sqlite:///{tmp_path / 'strict.db'}", limits={"max_depth": 8})
    try:
        for store in (loose, strict):
            otel_app(store)(nested_text(80))
            store.flush()
        (ep,) = list(loose.episodes())
        assert ep.task == json.loads(nested_text(80)) and loose.dead_letters() == []
        assert list(strict.episodes()) == []
        (refused,) = strict.dead_letters()
        assert refused.record.startswith("otel trace ") and refused.field == "task" and "max_depth" in refused.reason
    finally:
        loose.close()
        strict.close()


def test_the_otel_processor_dead_letters_a_deep_trace_and_stores_the_next(sqlite_store):
    trace = otel_app(sqlite_store)
    for depth in DEPTHS:
        trace(nested_text(depth))
    trace('{"question": "fine"}')
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    assert ep.task == {"question": "fine"}
    shallow, deep = sorted(sqlite_store.dead_letters(), key=lambda d: d.seq)
    assert shallow.record.startswith("otel trace ") and shallow.field == "task" and "max_depth" in shallow.reason
    assert deep.record.startswith("otel trace ") and "RecursionError" in deep.reason
    assert '"name": "chat m"' in deep.raw and len(deep.raw) <= MAX_DEAD_LETTER_CHARS + 100  # the spans, as given


# -- reads never die on one bad row ---------------------------------------------------------------------


def spoil(store_url: str, episode_id: str, how: str) -> None:
    """Damage a stored episode with plain SQL, as a hand edit, another tool or a bad disk would."""
    engine = sa.create_engine(store_url)
    try:
        with engine.begin() as conn:
            head = conn.execute(sa.text("select body from marft_episodes where id = :i"), {"i": episode_id}).scalar_one()
            if how == "deep":  # valid JSON that the parser cannot read back (past its 200 levels)
                data = json.loads(head)
                data["task"] = "@@"
                body = json.dumps(data).replace('"@@"', nested_text(300))
                conn.execute(sa.text("update marft_episodes set body = :b where id = :i"), {"b": body, "i": episode_id})
            elif how == "torn":  # an action row cut short
                conn.execute(sa.text("update marft_actions set body = substr(body, 1, 20) where episode_id = :i"),
                             {"i": episode_id})
            elif how == "invariant":  # valid JSON that breaks the record model: 3 log-probs for 2 token ids
                conn.execute(sa.text("update marft_actions set body = replace(body, '[-0.5,-0.25]', '[-0.5,-0.25,-1.0]') "
                                     "where episode_id = :i"), {"i": episode_id})
            else:  # bytes that are not UTF-8 text (SQLite keeps what it is given)
                conn.execute(sa.text("update marft_actions set body = cast(x'7b22ff' as text) where episode_id = :i"),
                             {"i": episode_id})
    finally:
        engine.dispose()


def spoiled_store(store: TraceStore, store_url: str, good: int) -> list[str]:
    """``good`` readable episodes, then g1.. spoiled one way each (g0 and any after them stay good);
    returns the ways, in the order of the spoiled ids."""
    hows = ["deep", "torn", "invariant"] + ([] if store.is_postgres else ["bytes"])
    for i in range(len(hows) + good):
        store.add_episode(good_episode(i))
    for i, how in enumerate(hows, 1):
        spoil(store_url, f"g{i}", how)
    return hows


def test_a_store_with_unreadable_rows_still_iterates_exports_and_lists(store, store_url, tmp_path):
    hows = spoiled_store(store, store_url, good=2)
    good = {"g0", f"g{len(hows) + 1}"}
    # The viewer opened on the damaged store lists the rest and says what it set aside.
    from test_ui_api import client_for

    from marft_bridge.ui.app import create_app

    c = client_for(create_app(store))
    listed = c.get("/api/episodes").json()
    assert {r["id"] for r in listed["items"]} == good and listed["unreadable"]["quarantined"] == len(hows)
    assert c.get("/api/episodes/g1").status_code == 404
    assert store.stats()["quarantined"] == len(hows) and store.count() == 2
    letters = {d.record: d for d in store.dead_letters()}
    assert set(letters) == {f"stored episode g{i}" for i in range(1, len(hows) + 1)}
    assert nested_text(300) in letters["stored episode g1"].raw  # kept whole: nothing is lost
    assert {len(d.raw) for d in store.dead_letters(raw_chars=50)} == {50}  # a listing need not read them whole
    assert "3 log-probs for 2 token ids" in letters["stored episode g3"].reason
    assert "cannot be read back from the store, moved here" in letters["stored episode g2"].reason
    with pytest.raises(EpisodeNotFound):
        store.get_episode("g1")
    usable(store, tmp_path, good)


def test_get_episode_of_an_unreadable_row_says_so_and_moves_it(store, store_url):
    store.add_episode(good_episode(0))
    spoil(store_url, "g0", "torn")
    with pytest.raises(EpisodeUnreadable, match="could not be read back .*moved to the dead letters"):
        store.get_episode("g0")
    assert store.count() == 0 and store.stats()["unreadable_skipped"] == 1
    with pytest.raises(EpisodeNotFound):  # moved: it is gone from the episodes, kept in the dead letters
        store.get_episode("g0")
    # A later half of that episode is refused (its stored half cannot be merged) and kept too.
    store.add_episode(good_episode(1))
    spoil(store_url, "g1", "invariant")
    half = good_episode(1).model_dump(mode="json")
    half["actions"][0]["id"] = "second-half"
    with pytest.raises(RecordError, match="stored half cannot be read back"):
        store.add_episode(half)


def test_reading_a_list_of_ids_passes_over_an_unreadable_one(store, store_url):
    hows = spoiled_store(store, store_url, good=2)
    ids = [f"g{i}" for i in range(len(hows) + 2)][::-1] + ["never-stored", "g0"]
    assert [e.id for e in store.get_episodes(ids)] == [f"g{len(hows) + 1}", "g0", "g0"]  # in the order asked
    assert store.stats()["quarantined"] == len(hows) and store.stats()["unreadable_skipped"] == len(hows)


def test_doctor_finds_and_quarantines_unreadable_rows(store, store_url, capsys):
    hows = spoiled_store(store, store_url, good=1)
    assert marft(["traces", "doctor", "--dry-run", "--store", store_url]) == 1
    out = capsys.readouterr().out
    assert f"{len(hows) + 1} episode(s) checked: {len(hows)} unreadable, listed (dry run: nothing moved)" in out
    assert "would move to the dead letters: episode g3: actions.0.output.logprobs: 3 log-probs" in out
    assert store.count() == len(hows) + 1 and store.stats()["dead_letters"] == 0  # nothing moved
    assert marft(["traces", "doctor", "--store", store_url]) == 0
    assert f"{len(hows)} unreadable, {len(hows)} moved to the dead letters" in capsys.readouterr().out
    assert store.count() == 1 and store.stats()["quarantined"] == len(hows)
    assert marft(["traces", "doctor", "--store", store_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["scanned"], report["unreadable"], report["quarantined"]) == (1, [], 0)
    assert marft(["traces", "stats", "--store", store_url]) == 0
    assert f"{len(hows)} unreadable stored episode(s) were moved to the dead letters" in capsys.readouterr().out


def test_doctor_lists_readable_episodes_past_lowered_limits_and_keeps_them(store_url):
    with TraceStore.open(store_url) as store:
        store.add_episode(Episode(id="deepish", task=nested(40)))
        store.add_episode(good_episode(0))
    with TraceStore.open(store_url, limits={"max_depth": 16}) as store:
        report = store.doctor()
        assert [f.episode_id for f in report.over_limits] == ["deepish"] and report.unreadable == []
        assert "task: JSON nested more than 16 levels" in report.over_limits[0].reason
        assert {e.id for e in store.episodes()} == {"deepish", "g0"}  # readable: kept, and read


def test_a_crash_while_moving_a_row_leaves_it_stored_and_no_dead_letter(tmp_path):
    db = tmp_path / "t.db"
    url = f"sqlite:///{db}"
    with TraceStore.open(db) as store:
        store.add_episode(good_episode(0))
        store.add_episode(good_episode(1))
        spoil(url, "g1", "torn")
        engine = sa.create_engine(url)
        with engine.begin() as conn:  # the delete fails after the dead letter was inserted in the same transaction
            conn.execute(sa.text("create trigger no_delete before delete on marft_episodes "
                                 "begin select raise(abort, 'disk gone'); end"))
        assert [e.id for e in store.episodes()] == ["g0"]  # still skipped
        assert store.stats()["dead_letters"] == 0 and store.stats()["quarantined"] == 0
        with engine.begin() as conn:
            assert conn.execute(sa.text("select count(*) from marft_actions where episode_id = 'g1'")).scalar_one() == 1
            conn.execute(sa.text("drop trigger no_delete"))
        engine.dispose()
        assert store.doctor().quarantined == 1
        assert store.stats()["dead_letters"] == 1 and store.count() == 1


# -- bounded import memory ----------------------------------------------------------------------------------


def import_peak(store: TraceStore, src) -> tuple[Any, int]:
    """``store.import_(src)`` and the peak of Python memory it allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        return store.import_(src), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_oversized_jsonl_line_is_refused_unread_with_bounded_memory(tmp_path):
    cap = 2**20
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        f.write(good_episode(0).model_dump_json() + "\n")
        f.write('{"id": "huge", "task": "' + "x" * (48 * 2**20) + '"}\n')  # 48 MB on one line
        f.write('{"id": "deep", "task": %s}\n' % nested_text(3000))
        f.write(good_episode(1).model_dump_json())  # no final newline
    with TraceStore.open(tmp_path / "t.db", limits={"max_record_bytes": cap}) as store:
        report, peak = import_peak(store, src)
        assert (report.added, report.refused) == (2, 2)
        assert peak < 8 * 2**20, f"import peaked at {peak / 2**20:.1f} MiB with a 1 MiB record limit"
        huge = letter_for(store, "in.jsonl line 2")
        assert "over the 1,048,576-byte limit of one record (max_record_bytes); skipped unread" in huge.reason
        assert huge.raw.startswith('{"id": "huge", "task": "xxx') and huge.raw.endswith("bytes in all]")
        assert len(huge.raw) < 70_000
        assert {e.id for e in store.episodes()} == {"g0", "g1"}


def test_the_trainer_source_and_adapters_map_read_no_line_past_the_record_limit(tmp_path, monkeypatch, capsys,
                                                                                 fresh_defaults):
    from marft_bridge.trainers.sources import read_jsonl

    monkeypatch.setenv("MARFT_MAX_RECORD_BYTES", str(2**20))  # files read without a store: the defaults
    src = tmp_path / "eps.jsonl"
    with open(src, "wb") as f:
        f.write(good_episode(0).model_dump_json().encode() + b"\n")
        f.write(b'{"id": "huge", "task": "' + b"x" * (48 * 2**20) + b'"}\n')
        f.write(b'{"id": "\xff"}\n')  # bytes that are not UTF-8 text
        f.write(good_episode(1).model_dump_json().encode() + b"\n")

    def peak_of(fn):
        tracemalloc.start()
        try:
            return fn(), tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    (episodes, bad), peak = peak_of(lambda: read_jsonl(src))
    assert [e.id for e in episodes] == ["g0", "g1"] and bad == 2  # the long line and the bytes, skipped
    assert peak < 8 * 2**20, f"the trainer's source peaked at {peak / 2**20:.1f} MiB with a 1 MiB record limit"
    rc, peak = peak_of(lambda: marft(["adapters", "map", "--registry", str(tmp_path / "reg"), "--episodes", str(src)]))
    err = capsys.readouterr().err
    assert rc == 1 and f"{src} line 2" in err and "over the 1,048,576-byte limit of one record" in err
    assert peak < 8 * 2**20, f"adapters map peaked at {peak / 2**20:.1f} MiB with a 1 MiB record limit"


def test_an_oversized_parquet_episode_is_refused_with_bounded_memory(tmp_path):
    text = "y" * 50_000
    big = Episode(id="big", actions=[Action(id=f"b{k}", agent="planner", output={"text": text}) for k in range(400)])
    src = tmp_path / "in.parquet"
    with TraceStore.open(tmp_path / "src.db") as store:  # 20 MB: within the default 64 MiB
        store.add_episode(good_episode(0))
        store.add_episode(big)
        store.add_episode(good_episode(1, eid="z1"))
        store.export(src)
    with TraceStore.open(tmp_path / "t.db", limits={"max_record_bytes": 2**20}) as store:
        report, peak = import_peak(store, src)
        assert (report.added, report.refused) == (2, 1)
        assert "episode big: " in report.refusals[0].reason and "max_record_bytes" in report.refusals[0].reason
        assert peak < 8 * 2**20, f"import peaked at {peak / 2**20:.1f} MiB with a 1 MiB record limit"
        assert {e.id for e in store.episodes()} == {"g0", "z1"}


def test_a_whole_episode_past_the_record_limit_is_refused_on_write_and_merge(store_url):
    with TraceStore.open(store_url, limits={"max_record_bytes": 200_000}) as store:
        half = Episode(id="e", actions=[Action(id=f"a{k}", agent="p", output={"text": "t" * 1000}) for k in range(120)])
        store.add_episode(half)
        more = Episode(id="e", actions=[Action(id=f"b{k}", agent="p", output={"text": "t" * 1000}) for k in range(100)])
        with pytest.raises(RecordError, match="episode e: .* over the 200,000-byte limit of one record"):
            store.add_episode(more)  # the merged episode would pass the limit
        assert len(store.get_episode("e").actions) == 120
        with pytest.raises(RecordError, match="max_record_bytes"):
            store.add_episode(Episode(id="f", actions=[Action(id=f"c{k}", agent="p", output={"text": "t" * 1000})
                                                       for k in range(250)]))


def test_the_continuous_service_passes_over_an_unreadable_episode(tmp_path):
    from marft_bridge.service import ContinuousService, ServiceConfig

    db = tmp_path / "traces.db"
    with TraceStore.open(db) as store:
        for i in range(3):
            store.add_episode(good_episode(i))
    spoil(f"sqlite:///{db}", "g1", "deep")  # e.g. a task an older marft_bridge accepted 210 levels deep
    svc = ContinuousService(ServiceConfig(store=str(db), base_model=str(tmp_path / "base"), agents=["planner"],
                                          registry=str(tmp_path / "registry"), state_dir=str(tmp_path / "service"),
                                          heldout_fraction=0.0))
    try:
        assert svc.poll() == 2 and sorted(svc.state.pending) == ["g0", "g2"]
        assert svc.store.stats()["quarantined"] == 1
    finally:
        svc.store.close()
