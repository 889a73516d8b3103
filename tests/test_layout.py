"""The package's layout as a contract, read from the source with ``ast`` (``test_import_graph``'s
reader): which wing may import which, what the root may hold, and how big a file or function may be.

Wings, lowest first: the root's shared core, ``store``, ``capture`` (the recorder every integration
shares), ``integrations``, ``trainers``, ``serving``, then the wings that wire them: ``ui``,
``service``, ``fitting``, ``demo``, ``benchmarks``. Data flows integrations → records → store →
trainers → registry → serving; a wing imports only the wings ``ALLOWED`` names for it (acyclicity
alone would let ``integrations`` import ``serving``).
"""

from __future__ import annotations

import ast

from test_import_graph import ROOT, edges, module_names

# The root modules that are the package itself rather than shared core: the facade, the CLI's
# entry and the old module paths.
ENTRY = {"marft_bridge", "marft_bridge.__main__", "marft_bridge.cli", "marft_bridge._moved"}
CORE = "core"
ALLOWED = {
    CORE: set(),
    "store": {CORE},
    "capture": {CORE, "store"},
    "integrations": {CORE, "capture"},
    "trainers": {CORE, "store"},
    "serving": {CORE, "store"},
    "ui": {CORE, "store", "serving"},
    "service": {CORE, "store", "capture", "trainers", "serving"},
    "fitting": {CORE, "store", "capture", "integrations", "trainers", "serving", "service"},
    "demo": {CORE, "store", "capture", "integrations", "trainers", "serving", "service", "fitting"},
    "benchmarks": {CORE, "store", "capture", "integrations", "trainers", "serving", "service", "fitting", "demo"},
    "adapters": {"integrations"},  # the deprecated alias of integrations/
}
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_INTEGRATION_FILE_LINES = 500, 80, 400


def wing(module: str) -> str:
    parts = module.split(".")
    if module in ENTRY:
        return "entry"
    if len(parts) > 1 and (ROOT / parts[1]).is_dir():
        return parts[1]
    return CORE


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for a, targets in graph.items():
        wa = wing(a)
        if wa == "entry":
            continue
        for b in targets:
            wb = wing(b)
            if wb != wa and wb not in ALLOWED.get(wa, set()):
                out.append(f"{a} -> {b} ({wa} may not import {wb})")
    return sorted(out)


def test_every_wing_is_in_the_contract():
    wings = {wing(m) for m in module_names()} - {"entry"}
    assert wings <= set(ALLOWED), wings - set(ALLOWED)


def test_wings_import_only_what_the_layering_allows():
    assert violations(edges(module_names())) == []


def test_the_layering_test_catches_an_integration_importing_serving():
    graph = edges(module_names())
    graph["marft_bridge.integrations.openai.client"] = graph["marft_bridge.integrations.openai.client"] | {
        "marft_bridge.serving.registry"}
    assert violations(graph) == ["marft_bridge.integrations.openai.client -> marft_bridge.serving.registry "
                                 "(integrations may not import serving)"]


def test_the_root_holds_only_what_two_or_more_wings_share():
    graph = edges(module_names())
    core = {m for m in graph if wing(m) == CORE}
    # a core module used by another core module serves that module's wings too
    users: dict[str, set[str]] = {m: set() for m in core}
    for a, targets in graph.items():
        for b in targets & core:
            users[b].add(a)

    def wings_of(m: str, seen: frozenset = frozenset()) -> set[str]:
        out = set()
        for u in users[m] - seen:
            out |= wings_of(u, seen | {m}) if u in core else {wing(u)} - {"entry"}
        return out

    lonely = {m: sorted(wings_of(m)) for m in sorted(core) if len(wings_of(m)) < 2}
    assert lonely == {}


def test_no_file_or_function_is_too_long():
    too_long = []
    for path in sorted(ROOT.rglob("*.py")):
        src = path.read_text()
        rel = path.relative_to(ROOT.parent)
        limit = MAX_INTEGRATION_FILE_LINES if "integrations" in rel.parts else MAX_FILE_LINES
        if len(src.splitlines()) > limit:
            too_long.append(f"{rel}: {len(src.splitlines())} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert too_long == []
