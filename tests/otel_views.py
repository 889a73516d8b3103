"""What the OpenTelemetry intake tests share: the one episode a test's spans made, its D as labels,
and a route from a process's one global tracer provider (Google ADK and Strands trace only through
it; it can be set once per process) to the current test's span processor."""

from __future__ import annotations

from opentelemetry.sdk.trace import SpanProcessor


def only_episode(store):
    store.flush()
    (ep,) = list(store.episodes())
    return ep


def view(ep) -> list[tuple[str, list[str]]]:
    """``agent:kind:text`` per action (text cut to 10), with its dependencies the same way."""
    names = {a.id: f"{a.agent}:{a.kind}:{a.output.text[:10]}" for a in ep.actions}
    return [(names[a.id], sorted(names[d] for d in a.depends_on)) for a in ep.actions]


class Route(SpanProcessor):
    """A processor on the global provider that hands each ended span to ``target`` (the current
    test's ``EpisodeSpanProcessor``; None between tests)."""

    target: SpanProcessor | None = None

    def on_end(self, span):
        if self.target is not None:
            self.target.on_end(span)
