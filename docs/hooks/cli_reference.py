"""mkdocs hook: write docs/reference/cli.md's body from the ``marft`` argparse parsers at build time.

The page holds a marker (``<!-- cli-reference -->``) that is replaced by one section per command and
subcommand: its usage line, its description and a table of its arguments, all read from
``marft_bridge.cli.build_parser()``; the reference cannot drift from the code. ``tests/test_docs.py``
checks that every subcommand gets a section.
"""

from __future__ import annotations

import argparse
import html

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"


def iter_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Yield ``(path, parser, help)`` for every subcommand, depth first, in registration order."""
    for action in parser._actions:  # argparse has no public walk over subparsers
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help for a in action._choices_actions}
        for name, sub in action.choices.items():
            yield path + (name,), sub, helps.get(name)
            yield from iter_commands(sub, path + (name,))


def _cell(text: str) -> str:
    """Markdown table cell: one line, ``|`` escaped, HTML (``<agent>`` in help texts) escaped."""
    return html.escape(" ".join(str(text).split()), quote=False).replace("|", "\\|")


def _arguments_table(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        name = ", ".join(action.option_strings) or (action.metavar or action.dest)
        if action.option_strings and action.nargs != 0:
            metavar = formatter._format_args(action, action.dest.upper())
            name = f"{name} {metavar}"
        help_text = formatter._expand_help(action) if action.help else ""
        default = action.default
        mentioned = "%(default)" in (action.help or "") or "default" in help_text.lower()
        if action.option_strings and default not in (None, False, argparse.SUPPRESS) and not mentioned:
            help_text = f"{help_text} (default: {default})".strip()
        rows.append(f"| `{_cell(name)}` | {_cell(help_text)} |")
    if not rows:
        return []
    return ["| argument | what it does |", "|---|---|", *rows, ""]


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The reference as Markdown: one ``##``/``###`` section per command, in the parser's order."""
    if parser is None:
        from marft_bridge.cli import build_parser

        parser = build_parser()
    out = [f"The `{parser.prog}` command: {parser.description}", ""]
    for path, sub, help_text in iter_commands(parser):
        out += [f"{'#' * (len(path) + 1)} {parser.prog} {' '.join(path)}", ""]
        text = sub.description or help_text
        if text:
            out += [_cell(text), ""]
        out += ["```text", sub.format_usage().strip(), "```", ""]
        out += _arguments_table(sub)
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs hook signature
    if page.file.src_uri == PAGE and MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
