"""The demo task, its warm-started base model and the two-agent LangGraph app."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from marft_bridge.demo import task, warmstart

# -- task: generator, splits, checker -----------------------------------------------------------------


def test_known_question_plans_solutions_and_answers():
    assert task.solve("4+5*3") == 19
    assert task.solve("4*3-2") == 10
    assert task.plan_text("4+5*3", "right") == "4+(5*3)"
    assert task.plan_text("4+5*3", "left") == "(4+5)*3"
    assert task.solution_text("4+5*3", "right") == "5*3=15,4+15=19"
    assert task.solution_text("4+5*3", "left") == "4+5=9,9*3=27"
    assert task.solution_text("4*3-2", "right") == "3-2=1,4*1=4"
    assert task.single_agent_reply("4*3-2", "left") == "(4*3)-2\n4*3=12,12-2=10"
    assert task.plan_order("4+5*3", " 4+(5*3)\n") == "right"
    assert task.plan_order("4+5*3", "(4+5)*3") == "left"
    assert task.plan_order("4+5*3", "4-(5*3)") is None
    assert task.Problem("4+5*3", 19).correct_order == "right"
    assert task.Problem("4*3-2", 10).correct_order == "left"


def test_checker_accepts_correct_and_refuses_wrong_answers():
    assert task.reward("4+5*3", "5*3=15,4+15=19") == 1.0
    assert task.reward("4+5*3", "19") == 1.0
    assert task.reward("4+5*3", "4+5=9,9*3=27") == 0.0  # wrong order
    assert task.reward("4+5*3", "5*3=15,4+15=18") == 0.0  # arithmetic slip
    assert task.reward("4+5*3", "19,4") == 0.0  # the last number is the answer
    assert task.reward("4+5*3", "") == 0.0
    assert task.reward("4+5*3", None) == 0.0
    assert task.reward("4+5*3", "no idea") == 0.0
    assert task.extract_answer("3-5=-2") == -2
    with pytest.raises(ValueError, match="not a demo question"):
        task.reward("4+5*", "12")


def test_every_question_needs_the_right_plan():
    problems = task.all_problems()
    assert len(problems) == len({p.question for p in problems}) > 400  # 485 with digits 1-6
    for p in problems:
        a, op1, b, op2, c = p.operands
        assert sorted([op1, op2]) in (["*", "+"], ["*", "-"])
        assert max(a, b, c) <= task.MAX_OPERAND
        other = "right" if p.correct_order == "left" else "left"
        right, wrong = (task.steps(p.question, o)[1][3] for o in (p.correct_order, other))
        assert right == p.answer == eval(p.question)  # noqa: S307 - digits and operators only
        assert wrong != p.answer
        for order in ("left", "right"):
            assert all(0 <= v <= task.MAX_VALUE for *_, v in task.steps(p.question, order))


def test_splits_are_deterministic_and_disjoint():
    s0, again, s1 = task.make_splits(0), task.make_splits(0), task.make_splits(1)
    assert s0 == again
    assert s0.heldout != s1.heldout
    train, held = {p.question for p in s0.train}, {p.question for p in s0.heldout}
    assert len(held) == len(s0.heldout) == 100
    assert not train & held
    assert train | held == {p.question for p in task.all_problems()}
    assert task.sample_problems(s0.train, 20, seed=3) == task.sample_problems(s0.train, 20, seed=3)
    assert task.sample_problems(s0.train, 20, seed=3) != task.sample_problems(s0.train, 20, seed=4)
    with pytest.raises(ValueError, match="heldout_size"):
        task.make_splits(0, heldout_size=0)


def test_demonstrations_are_imperfect_by_the_configured_fractions():
    problems = task.make_splits(0).train
    demos = warmstart.demonstrations(problems, 3000, seed=0, plan_error_rate=0.3, answer_error_rate=0.2)
    assert demos == warmstart.demonstrations(problems, 3000, seed=0, plan_error_rate=0.3, answer_error_rate=0.2)
    plans = [(m[1]["content"], reply) for m, reply in demos if m[0]["content"] == task.PLANNER_SYSTEM]
    solves = [(m[1]["content"], reply) for m, reply in demos if m[0]["content"] == task.SOLVER_SYSTEM]
    assert (len(plans), len(solves)) == (600, 1200)  # a fifth planner, two fifths solver
    wrong_plans = sum(task.plan_order(q, plan) != task.Problem(q, task.solve(q)).correct_order for q, plan in plans)
    assert 0.25 < wrong_plans / 600 < 0.35
    # The solver demonstration follows the plan it was given, right or wrong; 20% end in a slip.
    slips = 0
    for user, reply in solves:
        q, plan = user.split("\nplan: ")
        order = task.plan_order(q, plan)
        expected = task.solution_text(q, order)
        assert reply.rsplit("=", 1)[0] == expected.rsplit("=", 1)[0]
        slips += reply != expected
    assert 0.15 < slips / 1200 < 0.25


# -- warm-started base model ----------------------------------------------------------------------------


REPO_MODELS = Path(__file__).resolve().parents[1] / warmstart.DEFAULT_CACHE_DIR


@pytest.fixture(scope="module")
def warm_model():
    """The demo's default warm-started model, from the same cache `make demo` uses (built if missing)."""
    return warmstart.warm_start(cache_dir=REPO_MODELS)


def test_warm_start_trains_once_then_loads_from_the_cache(tmp_path):
    cfg = warmstart.WarmStartConfig(steps=3, batch_size=4, hidden_size=32, intermediate_size=64, warmup_steps=1)
    steps = []
    path = warmstart.warm_start(cfg, cache_dir=tmp_path, progress=lambda s, n, loss: steps.append((s, n)))
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert path == tmp_path / cfg.dirname() and path.name.startswith("demo-base-")
    assert (path / "model.safetensors").exists() and not list(path.glob("*.bin"))
    calls = []
    assert warmstart.warm_start(cfg, cache_dir=tmp_path, progress=lambda *a: calls.append(a)) == path
    assert calls == []  # loaded from the cache, not trained again
    assert warmstart.read_meta(path)["config"] == cfg.model_dump()
    assert cfg.model_copy(update={"seed": 1}).dirname() != cfg.dirname()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary directory left behind
    with pytest.raises(ValueError):
        warmstart.WarmStartConfig(plan_error_rate=1.5)


def test_warm_start_is_bit_identical_for_a_seed(tmp_path):
    cfg = warmstart.WarmStartConfig(steps=4, batch_size=4, hidden_size=32, intermediate_size=64, warmup_steps=1)
    a = warmstart.warm_start(cfg, cache_dir=tmp_path / "a")
    b = warmstart.warm_start(cfg, cache_dir=tmp_path / "b")
    c = warmstart.warm_start(cfg.model_copy(update={"seed": 1}), cache_dir=tmp_path / "c")
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]


def test_warm_model_is_competent_but_imperfect(warm_model):
    from marft_bridge.demo import evaluate

    model, tokenizer = evaluate.load_model(warm_model)
    held = task.make_splits(0).heldout
    # Sampled at T=0.7 through both agents; three sampling seeds so sampling noise stays small.
    results = [evaluate.evaluate_two_agent(model, tokenizer, held, temperature=0.7, seed=s) for s in range(3)]
    accuracy = sum(r.accuracy for r in results) / 3
    plan_accuracy = sum(r.plan_accuracy for r in results) / 3
    assert 0.3 <= accuracy <= 0.6, (accuracy, plan_accuracy)
    assert 0.6 <= plan_accuracy <= 0.95, (accuracy, plan_accuracy)  # the planner has room too
    # The solver follows the plan it is given: handed the wrong-order plan, it does that step first
    # and (almost) never reaches the right answer, so the planner's choice decides the team reward.
    wrong = [("left" if p.correct_order == "right" else "right") for p in held]
    replies = evaluate.generate(
        model, tokenizer, [task.solver_messages(p.question, task.plan_text(p.question, o)) for p, o in zip(held, wrong)], temperature=0
    )
    first_steps = [task.solution_text(p.question, o).split("=")[0] for p, o in zip(held, wrong)]
    assert sum(r.split("=")[0] == f for r, f in zip(replies, first_steps)) / len(held) >= 0.8
    assert sum(task.reward(p.question, r) for p, r in zip(held, replies)) / len(held) <= 0.1


# -- the LangGraph app against a local OpenAI-shaped server ---------------------------------------------


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Chat completions in OpenAI's JSON shape. The planner gets the correct plan; the solver's reply
    follows whatever plan is in its prompt, so the app only succeeds if the plan reaches the solver."""

    requests: list[dict] = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        user = body["messages"][-1]["content"]
        if body["model"] == "planner":
            q = user
            text = task.plan_text(q, task.Problem(q, task.solve(q)).correct_order)
        elif body["model"] == "solver":
            q, plan = user.split("\nplan: ")
            text = task.solution_text(q, task.plan_order(q, plan))
        else:
            text = task.single_agent_reply(user, task.Problem(user, task.solve(user)).correct_order)
        payload = {
            "id": f"chatcmpl-{len(type(self).requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": {
                        "content": [{"token": ch, "logprob": -0.5, "bytes": list(ch.encode()), "top_logprobs": []} for ch in text]
                    },
                    "finish_reason": "stop",
                    "token_ids": [ord(ch) for ch in text],
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": len(text), "total_tokens": 10 + len(text)},
            "adapter": {"name": body["model"], "version": 1},
        }
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server():
    _FakeOpenAI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeOpenAI.requests
    server.shutdown()
    server.server_close()
    thread.join()


def test_app_runs_planner_then_solver_through_chat_openai(fake_server):
    from marft_bridge.demo.app import build_app

    url, requests = fake_server
    app = build_app(url, api_key="k1", temperature=0.5, max_tokens=24)
    edges = {(e.source, e.target) for e in app.get_graph().edges}
    assert edges == {("__start__", "planner"), ("planner", "solver"), ("solver", "__end__")}
    state = app.invoke({"question": "4+5*3"})
    assert state == {"question": "4+5*3", "plan": "4+(5*3)", "answer": "5*3=15,4+15=19"}
    assert task.reward(state["question"], state["answer"]) == 1.0
    assert [r["model"] for r in requests] == ["planner", "solver"]
    assert all(r["path"] == "/v1/chat/completions" for r in requests)
    assert requests[0]["messages"] == task.planner_messages("4+5*3")
    assert requests[1]["messages"] == task.solver_messages("4+5*3", "4+(5*3)")
    for r in requests:
        assert r["auth"] == "Bearer k1"
        assert r["logprobs"] is True
        assert r["return_token_ids"] is True  # extra_body is merged into the request body
        assert r["temperature"] == 0.5
        assert r["max_completion_tokens"] == 24


def test_app_accepts_base_url_with_v1_and_custom_model_names(fake_server):
    from marft_bridge.demo.app import build_app

    url, requests = fake_server
    app = build_app(url + "/v1/", planner_model="planner", solver_model="solver")
    state = app.invoke({"question": "4*3-2"})
    assert state["answer"] == "4*3=12,12-2=10"
    assert [r["path"] for r in requests] == ["/v1/chat/completions"] * 2
    assert requests[0]["auth"] == "Bearer EMPTY"


def test_single_agent_app_does_the_whole_task_in_one_call(fake_server):
    from marft_bridge.demo.app import build_single_agent_app

    url, requests = fake_server
    app = build_single_agent_app(url, model="single")
    assert {(e.source, e.target) for e in app.get_graph().edges} == {("__start__", "agent"), ("agent", "__end__")}
    state = app.invoke({"question": "4+5*3"})
    assert state == {"question": "4+5*3", "plan": "4+(5*3)", "answer": "4+(5*3)\n5*3=15,4+15=19"}
    assert task.reward("4+5*3", state["answer"]) == 1.0
    assert [r["model"] for r in requests] == ["single"]
    assert requests[0]["messages"] == task.single_agent_messages("4+5*3")


def test_app_against_the_real_server_matches_in_process_greedy_generation(warm_model, tmp_path):
    from marft_bridge.demo import evaluate
    from marft_bridge.demo.app import build_app
    from marft_bridge.serving import ServerProcess

    model, tokenizer = evaluate.load_model(warm_model)
    held = task.make_splits(0).heldout[:4]
    with ServerProcess(warm_model, tmp_path / "registry", api_key="k") as server:
        # No adapters published yet: both agents are served by the base model (its directory name).
        app = build_app(server.url, api_key="k", planner_model=warm_model.name, solver_model=warm_model.name, temperature=0)
        for p in held:
            state = app.invoke({"question": p.question})
            (plan,) = evaluate.generate(model, tokenizer, [task.planner_messages(p.question)], temperature=0)
            (answer,) = evaluate.generate(model, tokenizer, [task.solver_messages(p.question, plan)], temperature=0)
            assert (state["plan"], state["answer"]) == (plan, answer)
