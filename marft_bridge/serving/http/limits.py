"""uvicorn under hostile clients, for ``marft serve`` and ``marft ui``: read deadlines, a keep-alive
timeout and a concurrency limit, with the command-line flags that set them.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) and answers 503 past
``limit_concurrency``, but it has no read timeout: a connection that sends nothing, half its
headers or half its body stays open for ever, and enough of them exhaust the server's file
descriptors (slowloris). ``limited_h11_protocol`` is uvicorn's h11 protocol with two deadlines, as
nginx's ``client_header_timeout`` / ``client_body_timeout`` and Go's ``ReadHeaderTimeout``: a request's
headers must be complete within ``header_timeout`` of the connection opening (or of the previous
response), and its body within ``body_timeout`` of its headers. Past a deadline the connection is
closed, with a ``408`` when part of a request had come and no answer was started. While the
application works on a request nothing is timed: generating may take long.

The deadlines extend uvicorn's own h11 protocol class, so they are version-gated: outside the range
tested (``SUPPORTED_UVICORN``) the server runs uvicorn's plain h11 protocol with a warning (keep-alive
timeout and concurrency limit still apply, the read deadlines do not), never a server that fails.
"""

from __future__ import annotations

import argparse
import logging
import re

log = logging.getLogger("marft_bridge.serving.http.limits")
# [lowest, highest) uvicorn version whose H11Protocol the deadlines were written against (tested: 0.54).
SUPPORTED_UVICORN = ((0, 30), (1, 0))

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def positive(kind: type):
    """An argparse type: ``kind`` (int, float) of a value above zero."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def add_flags(parser: argparse.ArgumentParser, *, limit_concurrency: int) -> None:
    g = parser.add_argument_group("connection limits (against stalled and abandoned clients)")
    seconds, count = positive(float), positive(int)
    g.add_argument("--header-timeout", type=seconds, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this of the connection opening (or of the "
                        "previous response); else the connection is closed (408 if it had started)")
    g.add_argument("--body-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="a request's body must arrive within this of its headers; else 408 and the connection "
                        "is closed")
    g.add_argument("--keep-alive-timeout", type=seconds, default=5.0, metavar="SECONDS",
                   help="an idle keep-alive connection is closed after this")
    g.add_argument("--limit-concurrency", type=count, default=limit_concurrency, metavar="N",
                   help="open connections at most; a request beyond them gets 503")


def run(app, args: argparse.Namespace) -> None:
    """``uvicorn.run`` on ``args.host``/``args.port`` with the limits of ``add_flags``."""
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                http=limited_h11_protocol(args.header_timeout, args.body_timeout),
                timeout_keep_alive=args.keep_alive_timeout, limit_concurrency=args.limit_concurrency)


def uvicorn_supported(version: str) -> bool:
    m = re.match(r"(\d+)\.(\d+)", version)
    return bool(m) and SUPPORTED_UVICORN[0] <= (int(m[1]), int(m[2])) < SUPPORTED_UVICORN[1]


def limited_h11_protocol(header_timeout: float, body_timeout: float) -> type | str:
    """uvicorn's ``H11Protocol`` with the read deadlines above (a class for ``uvicorn.Config(http=...)``);
    ``"h11"`` (uvicorn's own, no deadlines, with a warning) on a uvicorn outside ``SUPPORTED_UVICORN``."""
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if not uvicorn_supported(uvicorn.__version__):
        log.warning("uvicorn %s is outside the range marft's read deadlines support (%s to below %s): serving "
                    "without header/body read timeouts", uvicorn.__version__,
                    *(".".join(map(str, v)) for v in SUPPORTED_UVICORN))
        return "h11"

    class LimitedH11Protocol(H11Protocol):
        _deadline = None  # the armed timer
        _phase: tuple = (None, None)  # ("headers" | "body" | None, the request cycle it is for)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._track()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _track(self) -> None:
            """Arm the deadline of what the client owes now: headers (nothing received yet, or a
            keep-alive connection between requests) or the rest of a body; none while the request
            is with the application."""
            state = self.conn.their_state
            phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if (phase, self.cycle) == self._phase:
                return  # the same deadline still runs: progress within it does not extend it
            self._phase = (phase, self.cycle)
            self._disarm()
            if phase is not None and not self.transport.is_closing():
                timeout = header_timeout if phase == "headers" else body_timeout
                self._deadline = self.loop.call_later(timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            phase, cycle = self._phase
            started = phase == "body" or bool(self.conn.trailing_data[0])  # part of a request came
            answering = phase == "body" and cycle is not None and cycle.response_started
            if started and not answering:
                self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()  # the application, if it waits for the body, sees a disconnect

    return LimitedH11Protocol
