"""The bearer token of ``hermes-modal-tool mcp --transport http``.

Any local user can reach 127.0.0.1, so the HTTP transport answers only requests that
carry ``Authorization: Bearer <token>``: a token generated at each start (printed once
on stderr and written to a file only its owner can read, mode 0600) or read from
``--token-file``. The comparison takes the same time whatever the guess
(:func:`hmac.compare_digest`); every other request gets ``401`` before it reaches the
MCP server (no session, no slot, no tool call). ``--no-auth`` turns this off, with a
warning.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from .errors import ConfigError

#: Where a generated token's file goes (``mcp-<port>.token``) unless $XDG_RUNTIME_DIR is set.
TOKEN_DIR = Path.home() / ".cache" / "hermes-modal-tool"


def read_token_file(path: str) -> str:
    """The token in ``path`` (``--token-file``; surrounding whitespace dropped).

    Raises:
        ConfigError: the file cannot be read, is empty, or others than its owner may
            read or write it (a token anyone can read authenticates no one).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"--token-file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode) or mode & 0o077:
            raise ConfigError(f"--token-file {path}: mode {stat.filemode(mode)}; it must be a regular "
                              "file only its owner can read (chmod 600)")
        token = fh.read(4096).decode("utf-8", "replace").strip()
    if len(token) < 16:
        raise ConfigError(f"--token-file {path}: the token must be at least 16 characters, got {len(token)}")
    return token


def new_token() -> str:
    """A fresh token (43 URL-safe characters: 256 random bits)."""
    return secrets.token_urlsafe(32)


def write_token_file(token: str, port: int) -> Path:
    """Write ``token`` to ``mcp-<port>.token`` (mode 0600, created so: never readable by
    others, even for a moment) under ``$XDG_RUNTIME_DIR/hermes-modal-tool`` or
    :data:`TOKEN_DIR` (made 0700); return its path."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "hermes-modal-tool" if runtime else TOKEN_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"mcp-{port}.token"
    tmp = folder / f".mcp-{port}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


class BearerAuth:
    """ASGI middleware: HTTP requests without ``Authorization: Bearer <token>`` get 401.

    Args:
        app: the ASGI app it guards.
        token: the expected token (str).
    """

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = b"Bearer " + token.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                given = value
                break
        if scope["type"] == "http" and hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket or anything else: closed unanswered
            return
        body = (b'{"error": "unauthorized: send the header Authorization: Bearer <token> (the token '
                b'hermes-modal-tool mcp printed and wrote to its token file)"}')
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b'Bearer realm="hermes-modal-tool"'),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
