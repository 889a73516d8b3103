"""MCP servers and client sessions for the capture tests on either end of the supported range:
mcp 2.x (``MCPServer``, ``mcp.Client``) and mcp 1.x (``FastMCP``, an in-memory ``ClientSession``).

``build_server(name)``: tools ``add(a, b)``, ``multiply(a, b)`` and ``divide(a, b)`` (an error
result on division by zero). ``session(server)``: an async context manager yielding a connected
``ClientSession`` in this process. ``mcp_tool(session, name, description)``: a LangChain tool that
calls the MCP tool, the way ``langchain-mcp-adapters`` builds one (for environments without it).
"""

from __future__ import annotations

import importlib.util
from contextlib import asynccontextmanager
from typing import Any

V2 = importlib.util.find_spec("mcp.server.mcpserver") is not None


def build_server(name: str = "calc") -> Any:
    if V2:
        from mcp.server.mcpserver import MCPServer

        server = MCPServer(name)
    else:
        from mcp.server.fastmcp import FastMCP

        server = FastMCP(name)

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    @server.tool()
    def divide(a: float, b: float) -> float:
        """Divide a by b."""
        if b == 0:
            raise ValueError("division by zero")
        return a / b

    return server


@asynccontextmanager
async def session(server: Any):
    if V2:
        from mcp import Client

        async with Client(server) as client:
            yield client.session
    else:
        from mcp.shared.memory import create_connected_server_and_client_session

        async with create_connected_server_and_client_session(server) as s:
            yield s


def mcp_tool(session: Any, name: str, description: str) -> Any:
    """A LangChain tool whose body is one MCP ``tools/call`` (what langchain-mcp-adapters makes)."""
    from langchain_core.tools import StructuredTool
    from marft_bridge.integrations.mcp import result_text

    async def call(a: int, b: int) -> str:
        return result_text(await session.call_tool(name, {"a": a, "b": b}))[0]

    return StructuredTool.from_function(coroutine=call, name=name, description=description)
