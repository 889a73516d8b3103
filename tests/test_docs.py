"""The documentation's code runs, and its generated CLI reference covers every command.

Every ```python block of docs/**/*.md and README.md runs, unless the line before it is an HTML
comment ``<!-- not run: REASON -->`` (a fragment, or something that needs a server this suite does
not start). The blocks of one page share one namespace and run in order, in a fresh process whose
working directory is an empty temporary folder, as a reader pasting them into a session would.
Pages run two at a time. README.md's quickstart is the same code as docs/index.md's (checked
here), so it runs once.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->\s*$")
PAGE_TIMEOUT_S = 240

# Runs one page's blocks in one namespace; a failing block names its page and line in the traceback.
RUNNER = """
import json, sys
blocks = json.load(sys.stdin)
ns = {"__name__": "__main__"}
for path, line, source in blocks:
    exec(compile("\\n" * (line - 1) + source, path, "exec"), ns)
"""


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


def blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(first line of the code, code, reason it is not run or None)`` for each python block."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        line = text.count("\n", 0, m.start(1)) + 1
        out.append((line, m.group(1), skip.group(1) if skip else None))
    return out


def runnable(path: Path) -> list[tuple[int, str]]:
    return [(line, code) for line, code, skip in blocks(path) if skip is None]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# README.md's quickstart is docs/index.md's (asserted below): run once, from the docs.
RUN_PAGES = [p for p in pages() if runnable(p) and p.name != "README.md"]


def run_page(path: Path) -> dict:
    payload = json.dumps([[rel(path), line, code] for line, code in runnable(path)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MARFT_STORE", None)  # examples that open the default store must get a fresh one
    with tempfile.TemporaryDirectory(prefix="marft-docs-") as cwd:
        try:
            proc = subprocess.run([sys.executable, "-c", RUNNER], input=payload, capture_output=True, text=True,
                                  cwd=cwd, env=env, timeout=PAGE_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            return {"rc": "timeout", "output": f"{e.stdout or ''}\n{e.stderr or ''}"}
    return {"rc": proc.returncode, "output": proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]}


@pytest.fixture(scope="module")
def page_runs() -> dict[str, dict]:
    with cf.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {rel(p): pool.submit(run_page, p) for p in RUN_PAGES}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("page", [rel(p) for p in RUN_PAGES])
def test_page_examples_run(page, page_runs):
    result = page_runs[page]
    assert result["rc"] == 0, f"{page}: its python blocks failed (rc {result['rc']}):\n{result['output']}"


def test_the_examples_that_run_are_the_pages_that_matter():
    # The runner must not pass by running nothing: these pages carry working code.
    must = {"docs/index.md", "docs/getting-started/quickstart.md", "docs/getting-started/serving.md",
            "docs/capture/dependency-graph.md", "docs/store/index.md", "docs/store/export-import.md",
            "docs/training/options.md"}
    assert must <= {rel(p) for p in RUN_PAGES}
    assert sum(len(runnable(p)) for p in RUN_PAGES) >= len(must)


def test_every_skipped_block_says_why():
    for path in pages():
        for line, _, skip in blocks(path):
            assert skip is None or len(skip) >= 10, f"{rel(path)}:{line}: 'not run' needs a reason"


def test_readme_quickstart_is_the_docs_quickstart():
    readme = [code for _, code in runnable(ROOT / "README.md")]
    index = [code for _, code in runnable(DOCS / "index.md")]
    assert len(readme) == 1 and readme == index


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text


def test_block_extraction_and_skip_marker(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n<!-- not run: needs a vLLM server -->\n```python\nboom()\n```\n"
                    "\n```text\nnot python\n```\n")
    assert blocks(page) == [(4, "x = 1\n", None), (9, "boom()\n", "needs a vLLM server")]


def _cli_hook():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_covers_every_subcommand():
    from marft_bridge.cli import build_parser

    hook = _cli_hook()
    parser = build_parser()
    text = hook.render(parser)
    commands = [" ".join(path) for path, _, _ in hook.iter_commands(parser)]
    top = {c for c in commands if " " not in c}
    assert {"traces", "serve", "adapters", "train", "plot", "service", "demo", "ui", "vllm"} <= top
    assert any(" " in c for c in commands)  # nested subcommands (traces list, adapters publish, ...) too
    headings = set(re.findall(r"^#{2,} marft (.+)$", text, re.M))
    assert headings == set(commands)
    # Every option of every command is in its section, e.g. `traces list --store`.
    for path, sub, _ in hook.iter_commands(parser):
        section = text.split(f" marft {' '.join(path)}\n", 1)[1].split("\n#", 1)[0]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in section or f", {flag}" in section, f"marft {' '.join(path)}: {flag} missing"


def test_cli_reference_page_is_filled_by_the_hook():
    hook = _cli_hook()
    source = (DOCS / hook.PAGE).read_text()
    assert hook.MARKER in source

    class File:
        src_uri = hook.PAGE

    class Page:
        file = File()

    out = hook.on_page_markdown(source, Page(), None, None)
    assert hook.MARKER not in out and "## marft traces" in out and "### marft traces list" in out
