"""The MCP server's preview tools: ``expose_port`` and ``unexpose_port``.

``expose_port {port, path="/"}`` makes a TCP port of the session's slot reachable from
the host through a preview (:meth:`~hermes_modal_tool.backend.ToolBackend.expose`, on
the server's ``preview_host``, 127.0.0.1 by default) and answers with

- ``ticket_url``: for a person's browser; a single-use ticket (valid 5 minutes) that the
  preview trades for a cookie, redirecting to ``path``;
- ``url`` and ``headers``: for programmatic clients, the plain URL of ``path`` and the
  ``Authorization: Bearer <token>`` header every request must carry;

as text and as structured content (``{"port", "url", "ticket_url", "token", "headers"}``).
A port already exposed in the session keeps its preview (same URL and token; a new
ticket). ``unexpose_port {port?}`` revokes the session's preview of ``port`` (all of
them when absent). Every preview of a slot is revoked when the slot is released: the
MCP session ends, it idles past the idle lifetime, or the server stops.

The token reaches the MCP client (and so the model): it opens only the slot's own port,
which the session already controls, and dies with the session.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from .backend import ToolBackend
from .previews import TICKET_TTL_S, Preview, check_host
from .sessions import SlotSessions
from .tools import ToolSpec

__all__ = ["EXPOSE_PORT_SPEC", "UNEXPOSE_PORT_SPEC", "PREVIEW_TOOL_SPECS", "SessionPreviews"]

EXPOSE_PORT_DESCRIPTION = (
    "Make a TCP port of your workspace (a server you started, e.g. with `background: true`, "
    "listening on 127.0.0.1 or all addresses inside the workspace) reachable from the user's "
    "machine through an authenticated URL. Returns `ticket_url` for a person to open in a "
    "browser (works once, within 5 minutes; it sets a cookie), and the plain `url` with the "
    "`Authorization: Bearer <token>` header for programmatic clients. Requests without the "
    "token are refused (401). The URL lasts until `unexpose_port` or the end of this session. "
    "Calling it again for the same port gives a new ticket URL for the same preview.")

UNEXPOSE_PORT_DESCRIPTION = (
    "Stop exposing a port made reachable with `expose_port` (all exposed ports when `port` "
    "is left empty): its URL stops answering and its open connections close.")


def _port_field(description: str, default: Any = ...) -> Any:
    return Field(default, ge=1, le=65535, description=description)


class ExposePortArgs(BaseModel):
    """Arguments of the MCP ``expose_port`` tool."""

    model_config = ConfigDict(extra="forbid")

    port: StrictInt = _port_field("The TCP port inside your workspace (1-65535), e.g. 8000.")
    path: str = Field(default="/", max_length=2000,
                      description="The path the ticket URL opens, starting with `/`, e.g. `/index.html`.")

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/") or any(c.isspace() or not c.isprintable() for c in value):
            raise ValueError("must start with '/' and hold no spaces or control characters")
        return value


class UnexposePortArgs(BaseModel):
    """Arguments of the MCP ``unexpose_port`` tool."""

    model_config = ConfigDict(extra="forbid")

    port: StrictInt | None = _port_field("The exposed port to stop exposing; empty for all.", None)


EXPOSE_PORT_SPEC = ToolSpec("expose_port", EXPOSE_PORT_DESCRIPTION, ExposePortArgs)
UNEXPOSE_PORT_SPEC = ToolSpec("unexpose_port", UNEXPOSE_PORT_DESCRIPTION, UnexposePortArgs)
#: The MCP server's preview tools (the other adapters do not offer them).
PREVIEW_TOOL_SPECS: dict[str, ToolSpec] = {s.name: s for s in (EXPOSE_PORT_SPEC, UNEXPOSE_PORT_SPEC)}


class SessionPreviews:
    """The previews of each MCP session's slot, one per port.

    Args:
        sessions: the server's slot map (a call acquires the session's slot like any tool).
        host: the host address previews listen on (an IP address literal).

    Raises:
        UsageError: ``host`` is not an IP address literal.
    """

    def __init__(self, sessions: SlotSessions, host: str = "127.0.0.1") -> None:
        self.sessions = sessions
        self.backend: ToolBackend = sessions.backend
        self.host = check_host(host, "--preview-host")
        self._held: dict[str, dict[int, Preview]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def call(self, key: str, tool: str, args: dict[str, Any],
                   profile: str | None) -> tuple[str, dict[str, Any]]:
        """Run ``expose_port`` or ``unexpose_port`` for session ``key``: the text the model
        reads and the structured result.

        Raises:
            HermesModalToolError: no slot (a busy pool, a lost sandbox), a bad preview host.
            OSError: the listener cannot bind.
        """
        async with self._locks.setdefault(key, asyncio.Lock()):  # one preview per port
            return await self._call(key, tool, args, profile)

    async def _call(self, key: str, tool: str, args: dict[str, Any],
                    profile: str | None) -> tuple[str, dict[str, Any]]:
        slot = await self.sessions.slot(key, profile)
        held = self._held.setdefault(key, {})
        for port in [p for p, preview in held.items() if preview.revoked or preview.slot_id != slot.slot_id]:
            del held[port]  # revoked with a slot this session no longer holds
        if tool == "unexpose_port":
            ports = [args["port"]] if "port" in args else sorted(held)
            gone = [held.pop(p) for p in ports if p in held]
            for preview in gone:
                await self.backend.unexpose(preview)
            revoked = sorted(p.port for p in gone)
            text = (f"stopped exposing port(s) {', '.join(map(str, revoked))}" if revoked
                    else f"port {ports[0]} was not exposed" if "port" in args else "no port was exposed")
            return text, {"revoked": revoked}
        port, path = args["port"], args.get("path", "/")
        if port not in held:
            held[port] = await self.backend.expose(slot, port, host=self.host)
        preview = held[port]
        result = {"port": port, "url": preview.url.rstrip("/") + path, "ticket_url": preview.ticket_url(path),
                  "token": preview.token, "headers": preview.headers}
        return _exposed_text(result), result

    def forget(self, key: str) -> None:
        """Drop ``key``'s previews from the map (its slot's release revokes them)."""
        self._held.pop(key, None)
        self._locks.pop(key, None)


def _exposed_text(result: dict[str, Any]) -> str:
    return (f"Port {result['port']} of your workspace is exposed.\n"
            f"Open in a browser (works once, within {TICKET_TTL_S / 60:g} minutes; it sets a cookie): "
            f"{result['ticket_url']}\n"
            f"Programmatic clients: {result['url']} with the header "
            f"'Authorization: Bearer {result['token']}'\n"
            "Requests without the token get 401. It lasts until unexpose_port or the end of this session.")
