"""An MCP tool server with capture, for the ``mcp_tools`` example.

    python examples/mcp_tools/server.py --port 9200 --store traces.db

Tools: ``add``, ``divide`` (an error result on division by zero) and ``summarize`` (asks the
client's model through MCP sampling). ``instrument_server`` records every ``tools/call`` into
the caller's episode, using the trace context the instrumented client sends in ``_meta``.
"""

import argparse
import asyncio
import signal
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.resolve import Resolve, Sample
from mcp_types import CreateMessageResult, SamplingMessage, TextContent


def ask_client(text: str) -> Sample:
    return Sample([SamplingMessage(role="user", content=TextContent(type="text", text=f"Summarize: {text}"))],
                  max_tokens=32, temperature=0.0, system_prompt="You summarize.")


def build_server(name: str = "calc", delay_ms: float = 0.0) -> MCPServer:
    """The example tools; ``delay_ms``: ``add`` first waits that long (a backend that takes time,
    for benchmarks)."""
    server = MCPServer(name)

    @server.tool()
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        if delay_ms > 0:
            await asyncio.sleep(delay_ms / 1000)
        return a + b

    @server.tool()
    def divide(a: float, b: float) -> float:
        """Divide a by b."""
        if b == 0:
            raise ValueError("division by zero")
        return a / b

    @server.tool()
    def summarize(text: str, summary: Annotated[CreateMessageResult, Resolve(ask_client)]) -> str:
        """Summarize a text with the client's model."""
        return f"summary: {summary.content.text}"

    return server


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    import marft_bridge as mb
    from marft_bridge.integrations.mcp import instrument_server
    from marft_bridge.integrations.crossprocess.propagation import flush_joins

    ap = argparse.ArgumentParser(description="Serve the example MCP tools on 127.0.0.1 with capture.")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--store", required=True, help="trace store URL or SQLite path shared with the client")
    ap.add_argument("--no-capture", action="store_true", help="serve without capture (for benchmarks)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="`add` waits this long first (for benchmarks)")
    args = ap.parse_args(argv)
    server = build_server(delay_ms=args.delay_ms)
    store = mb.TraceStore.open(args.store)
    if not args.no_capture:
        instrument_server(server, store=store)
    app = server.streamable_http_app(host="127.0.0.1")
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning"))

    async def serve() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(uv, "should_exit", True))
        await uv.serve()

    asyncio.run(serve())
    flush_joins(timeout=30)  # halves still waiting for their caller's half
    store.close()


if __name__ == "__main__":
    main()
