"""``marft ui``: a read-only local web viewer of the trace store (episodes, their dependency graph D,
tokens and rewards), training runs (metrics.jsonl) and the adapter registry. ``app.create_app``
builds the FastAPI app; the page and its assets live in ``static/`` (hand-written JS and SVG, no
network at run time)."""
