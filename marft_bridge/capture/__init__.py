"""The capture wing's core, shared by every integration: the episode being recorded and the recorder
(``recording``), the integrations' per-process state and the current episode/task
(``episode_context``), and the OpenAI message shapes (``messages``).

The package shares its name with the public entry point ``marft_bridge.capture(store=...)`` (the
block that records every top-level run started in it, ``integrations.session.capture``): calling the
package is calling that, so ``mb.capture(...)`` works whether or not this package was imported.
"""

from __future__ import annotations

from .._lazy import call_through

call_through(__name__, "marft_bridge.integrations.session", "capture")
