"""An MCP server: the sandbox tools for any Model Context Protocol client.

``hermes-modal-tool mcp`` serves ``bash``, ``read_file`` and ``write_file`` (their
names, descriptions and argument schemas from :data:`hermes_modal_tool.tools.TOOL_SPECS`,
the contract every adapter shares) plus ``list_files``, and ``expose_port`` /
``unexpose_port`` (previews of the slot's ports: :mod:`._mcp_previews`), over stdio (for desktop
clients: Claude Desktop, Cursor, Codex) or streamable HTTP on 127.0.0.1. It is built
on the official ``mcp`` Python SDK (its low-level ``Server``), installed with the
``mcp`` extra.

One slot per MCP session: the first tool call of a session acquires a slot, the
session's later calls run in it (``cd``, ``export`` and files persist), and it is
released (its workspace emptied) when the session ends (the stdio client closes
the pipe; an HTTP client ends its session or stays idle longer than the idle
lifetime), or after ``idle_lifetime_s`` without a call. A command still running
when its client disconnects or cancels the request is stopped (its processes are
killed) before the slot is released.

Tool results: ``bash`` returns the output then ``[exit code N]`` as text, and
``{"exit_code", "timed_out", "truncated"}`` as structured content; a timeout is exit
code 124, not an error. A failed file call (no such file, a bad path) or bad
arguments come back as a tool error (``isError``) the model reads. An unknown tool
name is a protocol error (``-32602``), as the spec asks.

Over HTTP, every request must carry ``Authorization: Bearer <token>`` (any local user
can reach 127.0.0.1): the token is made at each start, printed once on stderr and
written to a 0600 file, or read from ``--token-file``; other requests get 401 before
any session or tool call (:mod:`._mcp_auth`). ``--no-auth`` turns it off, with a warning.

Over HTTP, clients of the 2026-07-28 protocol revision that send each request on
its own (no session) get a slot per request, released after it.

Example (a client's config, stdio)::

    {"mcpServers": {"sandbox": {"command": "hermes-modal-tool", "args": ["mcp"]}}}
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ._mcp_auth import BearerAuth, new_token, read_token_file, write_token_file
from ._mcp_previews import PREVIEW_TOOL_SPECS, SessionPreviews
from .backend import ToolBackend
from .config import ModalSandboxConfig, SandboxConfig, load_profiles
from .errors import HermesModalToolError
from .previews import check_host
from .sessions import SlotSessions
from .slots import ExecutionResult
from .tools import LIST_FILES_SPEC, TOOL_SPECS, ToolSpec, read_file_text

__all__ = ["SlotToolServer", "mcp_command"]

log = logging.getLogger(__name__)

#: The tools served, in the order ``tools/list`` gives them.
MCP_TOOL_SPECS: dict[str, ToolSpec] = {**TOOL_SPECS, LIST_FILES_SPEC.name: LIST_FILES_SPEC, **PREVIEW_TOOL_SPECS}
DEFAULT_IDLE_LIFETIME_S = 3600.0
_KEY = "hermes_modal_tool.slot_key"


class SlotToolServer:
    """The tools of one backend as an MCP server, one slot per MCP session.

    Args:
        backend: the engine (running on the loop the server runs on).
        profile: the profile slots come from (default: the backend's default).
        timeout_s: default seconds per call (a bash call's own ``timeout`` wins;
            default: the profile's ``execution_timeout_s``).
        idle_lifetime_s: release a session's slot after this many seconds
            without a call (None: only when the session ends).
        preview_host: the host address ``expose_port``'s previews listen on (an IP
            address literal; default 127.0.0.1).

    Raises:
        ConfigError: an unknown ``profile``.
        UsageError: ``preview_host`` is not an IP address literal.

    Example:
        >>> server = SlotToolServer(backend)  # doctest: +SKIP
        >>> await server.serve_stdio()  # doctest: +SKIP
    """

    def __init__(self, backend: ToolBackend, *, profile: str | None = None,
                 timeout_s: float | None = None,
                 idle_lifetime_s: float | None = DEFAULT_IDLE_LIFETIME_S,
                 preview_host: str = "127.0.0.1") -> None:
        backend.profile(profile)  # ConfigError now, not at the first call
        self.backend = backend
        self.profile = profile
        self.timeout_s = timeout_s
        self.idle_lifetime_s = idle_lifetime_s
        self.sessions = SlotSessions(backend)
        self.previews = SessionPreviews(self.sessions, preview_host)
        self._busy: collections.Counter[str] = collections.Counter()
        self._shared_key: str | None = None
        self.server = self._build()

    # -- the MCP server -------------------------------------------------------------
    def _build(self) -> Any:
        from mcp.server.lowlevel import Server

        from ._version import __version__
        return Server("hermes-modal-tool", version=__version__,
                      instructions="Tools run in your own persistent Linux shell workspace (a slot).",
                      on_list_tools=self._list_tools, on_call_tool=self._call_tool)

    async def _list_tools(self, ctx: Any, params: Any) -> Any:
        import mcp_types as types

        return types.ListToolsResult(tools=[
            types.Tool(name=spec.name, description=spec.description, input_schema=spec.json_schema())
            for spec in MCP_TOOL_SPECS.values()])

    async def _call_tool(self, ctx: Any, params: Any) -> Any:
        import mcp_types as types
        from mcp.shared.exceptions import MCPError
        from pydantic import ValidationError

        spec = MCP_TOOL_SPECS.get(params.name)
        if spec is None:
            raise MCPError(code=types.INVALID_PARAMS,
                           message=f"unknown tool {params.name!r}; tools: {', '.join(MCP_TOOL_SPECS)}")
        try:
            args = spec.engine_args(dict(params.arguments or {}))
        except ValidationError as exc:
            return _error(f"invalid arguments for {spec.name}: {_first_errors(exc)}")
        key = self._key(ctx)
        if spec.name in PREVIEW_TOOL_SPECS and self._shared_key is None and (
                getattr(ctx.session._connection, "session_id", None) is None):
            return _error(f"{spec.name} needs an MCP session: a request sent on its own (no session) "
                          "gets a slot that is released, with its previews, once it is answered")
        self._busy[key] += 1
        try:
            if spec.name in PREVIEW_TOOL_SPECS:
                said, found = await self.previews.call(key, spec.name, args, self.profile)
                return types.CallToolResult(content=[types.TextContent(text=said)], structured_content=found)
            result = await self.sessions.execute(key, spec.name, args, timeout_s=self.timeout_s,
                                                 profile=self.profile)
        except HermesModalToolError as exc:  # a busy pool, a lost sandbox, a bad profile
            return _error(f"{type(exc).__name__}: {exc}")
        except OSError as exc:  # a preview's listener that cannot bind
            return _error(f"{spec.name}: the preview cannot listen: {exc.strerror or exc}")
        finally:
            self._busy[key] -= 1
            if not self._busy[key]:
                del self._busy[key]
        return _format(spec.name, result)

    def _key(self, ctx: Any) -> str:
        """The slot key of the request's MCP session (acquired lazily by SlotSessions)."""
        if self._shared_key is not None:
            return self._shared_key
        # The SDK gives a handler its connection only through the session object.
        connection = getattr(ctx.session, "_connection", None)
        if connection is None:
            raise RuntimeError("mcp SDK changed: a request's ServerSession has no _connection")
        key = connection.state.get(_KEY)
        if key is None:
            key = connection.state[_KEY] = f"mcp-{uuid.uuid4().hex[:12]}"
            connection.exit_stack.push_async_callback(self._release, key)
        return key

    async def _release(self, key: str) -> None:
        self.previews.forget(key)  # the release revokes them
        try:
            await self.sessions.close(key)
        except Exception as exc:  # logged: a release that failed must not hide the session's end
            log.warning("releasing the slot of MCP session %s failed: %s", key, exc)

    async def _reap_idle(self) -> None:
        lifetime = self.idle_lifetime_s
        if lifetime is None:
            return
        while True:
            await asyncio.sleep(min(max(lifetime / 4, 0.2), 30.0))
            for key, info in self.sessions.info().items():
                if info["idle_s"] > lifetime and not self._busy.get(key):
                    await self._release(key)

    # -- transports -------------------------------------------------------------------
    async def serve_stdio(self) -> None:
        """Serve one client over this process's stdin/stdout until it closes them.

        The process is one MCP session: one slot, released on return.
        """
        from mcp.server.stdio import stdio_server

        self._shared_key = f"mcp-stdio-{uuid.uuid4().hex[:12]}"
        reaper = asyncio.create_task(self._reap_idle(), name="mcp-idle-reaper")
        try:
            async with stdio_server() as (read, write):
                await self.server.run(read, write, self.server.create_initialization_options())
        finally:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
            await self.aclose()

    async def serve_http(self, port: int = 0,
                         on_ready: Callable[[str], None] | None = None, *, token: str | None) -> None:
        """Serve streamable HTTP at ``http://127.0.0.1:PORT/mcp`` until SIGINT/SIGTERM
        (or cancellation).

        Args:
            port: TCP port on 127.0.0.1 (0: a free one).
            on_ready: called with the URL once the socket listens.
            token: requests must carry ``Authorization: Bearer <token>`` (else 401,
                before any session or tool call: :mod:`._mcp_auth`); None serves anyone
                who can reach 127.0.0.1 (every local user).

        Raises:
            OSError: the port cannot be bound.
        """
        import uvicorn

        app = self.server.streamable_http_app(
            host="127.0.0.1", session_idle_timeout=self.idle_lifetime_s)
        if token is not None:
            app = BearerAuth(app, token)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
        userver = _quiet_server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, userver.stop)
        reaper = asyncio.create_task(self._reap_idle(), name="mcp-idle-reaper")
        try:
            if on_ready is not None:
                on_ready(url)  # the socket listens: connections wait for uvicorn to accept them
            await userver.serve(sockets=[sock])
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
            sock.close()
            await self.aclose()

    async def aclose(self) -> int:
        """Release every session's slot; return how many."""
        return await self.sessions.close_all()


def _quiet_server_class() -> type[Any]:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn without its own signal capture: ours stops it, then the backend."""

        def capture_signals(self) -> Any:
            import contextlib

            return contextlib.nullcontext()

        def stop(self) -> None:
            self.should_exit = True

    return QuietServer


def _quiet_server(config: Any) -> Any:
    return _quiet_server_class()(config)


def _error(text: str) -> Any:
    import mcp_types as types

    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def _first_errors(exc: Any) -> str:
    """Each argument's problem and the value given (``port: Input should be ... (got 0)``)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                     + ("" if e["type"] == "missing" or not e["loc"] else f" (got {e.get('input')!r:.80})")
                     for e in exc.errors())


def _format(tool: str, r: ExecutionResult) -> Any:
    import mcp_types as types

    if tool == "bash":
        rc = r.returncode
        status = f"exit code {rc}" if rc is not None else "error"
        if r.error and r.error != f"exit code {rc}":
            status += f": {r.error}"
        text = f"{r.output.rstrip(chr(10)) or '(no output)'}\n[{status}]"
        return types.CallToolResult(
            content=[types.TextContent(text=text)], is_error=rc is None,
            structured_content={"exit_code": rc, "timed_out": bool(r.metadata.get("timed_out")),
                                "truncated": bool(r.metadata.get("truncated"))})
    if not r.success:
        return _error(f"Error: {r.error}")
    text = read_file_text(r.output, r.metadata) if tool == "read_file" else r.output
    return types.CallToolResult(content=[types.TextContent(text=text or "(empty)")])


# -- the command ----------------------------------------------------------------------

def build_backend(driver: str, profiles_file: str | None, profile: str | None) -> tuple[ToolBackend, str]:
    """The backend the command serves: profiles from ``profiles_file`` (else the
    ``TERMINAL_MODAL_*`` environment), ``driver`` the default driver.

    Raises:
        ConfigError: a bad profiles file or variable, or an unknown ``profile``.
    """
    from .errors import ConfigError

    cls = ModalSandboxConfig if driver == "modal" else SandboxConfig
    profiles, default = load_profiles(profiles_file, cls=cls)
    name = profile or default
    if name not in profiles:
        raise ConfigError(f"--profile {name!r}: no such profile; profiles: {', '.join(profiles)}")
    backend = ToolBackend(profiles=profiles, default_profile=name,
                          app_name=os.environ.get("TERMINAL_MODAL_APP_NAME") or "hermes-mcp")
    return backend, name


@click.command("mcp")
@click.option("--transport", type=click.Choice(["stdio", "http"]), default="stdio", show_default=True,
              help="stdio for desktop clients; http for streamable HTTP on 127.0.0.1.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="HTTP port on 127.0.0.1 (0: a free one; the URL is printed to stderr).")
@click.option("--profiles-file", type=click.Path(dir_okay=False), envvar="TERMINAL_MODAL_PROFILES_FILE",
              help="A modal_profiles.yaml [TERMINAL_MODAL_PROFILES_FILE; default: one local profile].")
@click.option("--profile", help="Profile slots come from (default: the file's default).")
@click.option("--driver", type=click.Choice(["local", "modal"]), envvar="TERMINAL_ENV", default="local",
              show_default=True, help="Where profiles without a driver run [TERMINAL_ENV].")
@click.option("--timeout", type=click.FloatRange(0, 86400, min_open=True), envvar="TERMINAL_TIMEOUT",
              help="Default seconds per call [TERMINAL_TIMEOUT; default: the profile's].")
@click.option("--idle-lifetime", type=click.FloatRange(0, min_open=True), envvar="TERMINAL_LIFETIME_SECONDS",
              default=DEFAULT_IDLE_LIFETIME_S, show_default=True,
              help="Release a session's slot after this many idle seconds [TERMINAL_LIFETIME_SECONDS].")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help="http: the bearer token clients must send, read from this file (mode 0600); "
                   "default: a new token per start, printed once and written to a 0600 file.")
@click.option("--preview-host", default="127.0.0.1", show_default=True,
              help="The host address expose_port's preview URLs listen on (an IP address).")
@click.option("--no-auth", is_flag=True,
              help="http: accept requests without a token (any local user then runs commands in slots).")
def mcp_command(transport: str, port: int, profiles_file: str | None, profile: str | None, driver: str,
                timeout: float | None, idle_lifetime: float, token_file: str | None, preview_host: str,
                no_auth: bool) -> None:
    """Serve bash, read_file, write_file, list_files and expose_port/unexpose_port over MCP,
    one slot per session.

    stdio: add to a client's config, e.g. {"mcpServers": {"sandbox": {"command":
    "hermes-modal-tool", "args": ["mcp"]}}}. http: clients connect to
    http://127.0.0.1:PORT/mcp with the header "Authorization: Bearer <token>".
    """
    try:
        import mcp  # noqa: F401
    except ImportError:
        from .errors import install_hint

        raise click.ClickException(f"the mcp extra is not installed: {install_hint('mcp')}") from None
    if token_file and no_auth:
        raise click.UsageError("--token-file and --no-auth: choose one")
    token: str | None = None
    written: list[Path] = []
    try:
        check_host(preview_host, "--preview-host")
        if transport == "http" and not no_auth:
            token = read_token_file(token_file) if token_file else new_token()
        backend, name = build_backend(driver, profiles_file, profile)
    except HermesModalToolError as exc:
        raise click.ClickException(str(exc)) from None

    def ready(url: str) -> None:
        click.echo(f"hermes-modal-tool mcp: serving {url}", err=True)
        if token is None:
            click.echo("hermes-modal-tool mcp: WARNING: --no-auth: any local user can run commands "
                       "in these slots", err=True)
        elif token_file:
            click.echo(f"hermes-modal-tool mcp: clients send 'Authorization: Bearer <the token in "
                       f"{token_file}>'", err=True)
        else:
            written.append(write_token_file(token, int(url.rsplit(":", 1)[1].split("/")[0])))
            click.echo(f"hermes-modal-tool mcp: clients send 'Authorization: Bearer {token}' "
                       f"(the token is also in {written[0]}, mode 0600)", err=True)

    async def run() -> None:
        server = SlotToolServer(backend, profile=name, timeout_s=timeout, idle_lifetime_s=idle_lifetime,
                                preview_host=preview_host)
        try:
            if transport == "stdio":
                main = asyncio.current_task()
                assert main is not None
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
                await server.serve_stdio()
            else:
                await server.serve_http(port, on_ready=ready, token=token)
        finally:
            for path in written:
                path.unlink(missing_ok=True)
            await backend.stop()

    try:
        asyncio.run(run())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    except OSError as exc:
        raise click.ClickException(f"--port {port}: {exc.strerror or exc}") from None
    sys.exit(0)
