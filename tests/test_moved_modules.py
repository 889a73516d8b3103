"""Old module paths (before the wings were folders) still import for one release, as the very module
now at the new path, with a DeprecationWarning naming it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from marft_bridge._moved import MOVED

# Modules that import an optional extra at import time: checked where the extra is installed.
NEEDS = {"marft_bridge.serving.server": "fastapi", "marft_bridge.serving.routes": "fastapi"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_with_a_warning(old):
    pytest.importorskip(NEEDS.get(old, "marft_bridge"))
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is new


def test_from_import_of_an_old_submodule_name_works_in_a_fresh_process():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    from marft_bridge import recording\nexcept DeprecationWarning as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "marft_bridge.recording moved to marft_bridge.capture.recording; the old path goes away next release"


def test_a_name_nothing_moved_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("marft_bridge.no_such_module")


def test_the_capture_package_is_the_capture_block():
    import marft_bridge as mb
    import marft_bridge.capture.recording  # noqa: F401 - the subpackage is imported: still callable

    c = mb.capture()
    assert type(c).__name__ == "capture" and c.episode_ids == []
