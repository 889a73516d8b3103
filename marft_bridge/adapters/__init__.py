"""Deprecated alias of :mod:`marft_bridge.integrations` (renamed: "adapter" means a LoRA adapter
everywhere else in marft_bridge). Kept for one release; ``marft_bridge.adapters.X`` imports
``marft_bridge.integrations.X`` and warns."""

import importlib
import sys
import warnings

warnings.warn("marft_bridge.adapters is renamed marft_bridge.integrations; the old name goes away next release",
              DeprecationWarning, stacklevel=2)


class _Alias:
    """Finds ``marft_bridge.adapters.<name>`` as the module ``marft_bridge.integrations.<name>``."""

    prefix = __name__ + "."

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self.prefix):
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module("marft_bridge.integrations." + spec.name[len(self.prefix):])

    def exec_module(self, module):
        pass


sys.meta_path.append(_Alias())
