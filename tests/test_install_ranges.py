"""Compatibility: the pyproject ranges must let users add marft-bridge to a LangGraph supervisor/swarm
app, an OpenAI Agents SDK app or a pydantic-ai app without forcing pins.

A real resolve (``pip install --dry-run`` in a fresh venv) takes minutes, so the fast tests check
the same thing against what is installed: the installed app stack (openai-agents, pydantic-ai,
langgraph-supervisor/swarm, langchain and everything they require) is one environment where
every requirement of every package in it holds; our ranges admit each version in it; and CI's
constraints file pins exactly that environment. ``MARFT_TEST_PIP_RESOLVE=1`` also runs the real
dry-run resolve from the pyproject ranges (no CI constraints).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
APPS = ["openai-agents", "pydantic-ai-slim", "langgraph-supervisor", "langgraph-swarm", "langchain", "smolagents",
        "openinference-instrumentation-smolagents"]
EXTRAS = ["langgraph", "otel", "mcp", "a2a", "serve", "dev"]  # what such apps install beside us


def our_ranges() -> dict[str, SpecifierSet]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    out: dict[str, SpecifierSet] = {}
    for r in map(Requirement, reqs):
        name = canonicalize_name(r.name)
        if name != "marft-bridge":
            out[name] = out.get(name, SpecifierSet()) & r.specifier
    return out


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def requirements_of(dist: str) -> list[Requirement]:
    env = {**default_environment(), "extra": ""}
    return [r for r in map(Requirement, metadata.requires(dist) or []) if r.marker is None or r.marker.evaluate(env)]


def app_stack() -> set[str]:
    """The apps and everything they require (markers evaluated here, no extras)."""
    seen, todo = set(), [canonicalize_name(a) for a in APPS]
    while todo:
        name = todo.pop()
        if name in seen or installed(name) is None:
            continue
        seen.add(name)
        todo += [canonicalize_name(r.name) for r in requirements_of(name)]
    return seen


def test_the_current_app_releases_are_installed_together():
    # openai-agents 0.24 needs websockets>=15 (CI once pinned an older one); its own pins hold here
    assert tuple(int(x) for x in installed("openai-agents").split(".")[:2]) >= (0, 24)
    assert installed("pydantic-ai-slim") and installed("langgraph-supervisor") and installed("langgraph-swarm")


def test_every_requirement_in_the_app_stack_holds():
    broken = []
    for dist in sorted(app_stack()):
        for r in requirements_of(dist):
            have = installed(r.name)
            if have is None or not r.specifier.contains(have, prereleases=True):
                broken.append(f"{dist} needs {r}, installed {have}")
    assert broken == []


def test_our_ranges_admit_the_app_stack():
    ranges = our_ranges()
    stack = app_stack()
    assert {"openai", "langgraph", "langchain-core", "pydantic", "websockets"} <= stack  # what we share with them
    refused = [f"{n} {installed(n)} not in our {ranges[n]}" for n in sorted(stack & set(ranges))
               if not ranges[n].contains(installed(n), prereleases=True)]
    assert refused == []


def test_ci_constraints_pin_an_environment_our_ranges_admit():
    ranges = our_ranges()
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;#]+)", line.strip())
        if m:
            pins[canonicalize_name(m.group(1).split("[")[0])] = m.group(2)
    assert pins, "constraints.txt pins nothing"
    refused = [f"{n}=={v} not in our {ranges[n]}" for n, v in sorted(pins.items())
               if n in ranges and not ranges[n].contains(v, prereleases=True)]
    assert refused == []
    drift = [f"{n}: pinned {pins[n]}, installed {installed(n)}" for n in sorted(app_stack() & set(pins))
             if installed(n) != pins[n] and not (n == "torch" and installed(n).startswith(pins[n]))]
    assert drift == []


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MARFT_TEST_PIP_RESOLVE"), reason="minutes: set MARFT_TEST_PIP_RESOLVE=1")
def test_pip_resolves_the_app_stacks_from_the_pyproject_ranges(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "v")], check=True)
    report = tmp_path / "report.json"
    cmd = [str(tmp_path / "v" / "bin" / "pip"), "install", "--dry-run", "--quiet", "--report", str(report),
           f"{ROOT}[langgraph,otel]", "langgraph-supervisor", "langgraph-swarm", "openai-agents", "pydantic-ai"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    assert tuple(int(x) for x in got["openai-agents"].split(".")[:2]) >= (0, 24)
    assert int(got["pydantic-ai"].split(".")[0]) >= 2 and got["pydantic-ai"] == got["pydantic-ai-slim"]


# The harnesses whose capture tests run in venvs of their own (.ci/run step 4): each resolves beside
# marft-bridge[langgraph,otel] from the pyproject ranges, to a real release (strands-agents and
# google-adk also have 0.0.1 placeholders a backtracking resolver can fall to).
HARNESSES = {"deepagents": (0, 7), "google-adk": (2, 0), "strands-agents": (1, 0), "smolagents": (1, 20)}


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MARFT_TEST_PIP_RESOLVE"), reason="minutes: set MARFT_TEST_PIP_RESOLVE=1")
@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_pip_resolves_each_harness_beside_us_from_the_pyproject_ranges(tmp_path, harness):
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "v")], check=True)
    report = tmp_path / "report.json"
    cmd = [str(tmp_path / "v" / "bin" / "pip"), "install", "--dry-run", "--quiet", "--report", str(report),
           f"{ROOT}[langgraph,otel]", harness]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    assert tuple(int(x) for x in got[harness].split(".")[:2]) >= HARNESSES[harness], got[harness]
