"""``--app MODULE:NAME`` loads the module the working directory holds: a same-named module imported
earlier from another folder (two examples each with an ``app.py``) is replaced, not reused."""

from __future__ import annotations

import sys

import pytest

from marft_bridge.errors import MarftError
from marft_bridge.fitting.settings import load_callable


def _write_app(folder, answer):
    folder.mkdir()
    (folder / "app.py").write_text(f"def build_app(endpoint=None):\n    return {answer!r}\n")


def test_module_in_the_working_directory_wins_over_a_cached_same_named_one(tmp_path, monkeypatch):
    _write_app(tmp_path / "first", "first")
    _write_app(tmp_path / "second", "second")
    monkeypatch.delitem(sys.modules, "app", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "first"))
    import app  # noqa: F401 - an earlier example's module, cached under the same name

    assert sys.modules["app"].build_app() == "first"
    sys.path.remove(str(tmp_path / "first"))
    monkeypatch.chdir(tmp_path / "second")
    monkeypatch.syspath_prepend(str(tmp_path / "second"))
    try:
        assert load_callable("app:build_app", "--app")() == "second"
        assert load_callable("app:build_app", "--app")() == "second"  # and stays loaded, not re-imported
    finally:
        sys.modules.pop("app", None)


def test_a_file_path_loads_that_file(tmp_path):
    _write_app(tmp_path / "third", "third")
    assert load_callable(f"{tmp_path / 'third' / 'app.py'}:build_app", "--app")() == "third"


@pytest.mark.parametrize("spec, message", [("app", "expected MODULE:NAME"),
                                           ("no_such_module_here:fn", "cannot load --app"),
                                           ("json:no_such_name", "cannot load --app"),
                                           ("json:__doc__", "not a function")])
def test_a_bad_spec_is_a_clear_error(spec, message):
    with pytest.raises(MarftError, match=message):
        load_callable(spec, "--app")
