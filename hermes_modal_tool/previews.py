"""Previews: a slot's TCP port reachable from the host through an authenticated URL.

``await backend.expose(slot, port)`` starts a listener on ``127.0.0.1`` (or the address
given) and returns a :class:`Preview`: its ``url``, and a ``token`` every request must
carry, as ``Authorization: Bearer <token>``, or as a cookie obtained with a single-use
ticket (``preview.ticket_url()``: the proxy takes the ticket, sets the cookie and
redirects to the same URL without it). A request without valid credentials is answered
401 (none given) or 403 (wrong ones) and the slot is never connected to.

An authenticated request is forwarded, with the token's header and the previews'
cookies taken out, over a ``tunnel`` of the sandbox's protocol stream: the agent opens
the TCP connection to ``127.0.0.1:port`` inside the slot's network namespace
(``agent/net/tunnels.py``), so the slot never reaches the host, whatever its network
mode. Each plain HTTP request goes on a connection of its own (``Connection: close`` to
the slot), so each is checked; a WebSocket (``Upgrade``) is checked once, then its bytes
pass both ways until either side closes.

Revocation: ``backend.unexpose(...)``, the slot's release and ``backend.stop()`` close
the listener (new connections are refused) and every connection it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from ._transfer_wire import _cancel, _where
from .errors import SandboxError, UsageError
from .slots import Slot

if TYPE_CHECKING:
    from ._backend_view import BackendView
    from .sandbox import Sandbox

#: The query parameter that carries a single-use ticket.
TICKET_PARAM = "hmt_ticket"
#: Seconds a ticket can be used after it was made.
TICKET_TTL_S = 300.0
#: Largest request head (request line and headers), bytes.
MAX_HEAD_BYTES = 32 * 1024
#: Seconds a client has to send its request head.
HEAD_WAIT_S = 30.0
#: Unanswered writes and reads per tunnel (each at most 64 KiB).
WINDOW = 4
#: Bytes per write into a tunnel.
CHUNK_BYTES = 64 * 1024
#: Seconds the agent has to answer one tunnel request (a read is answered within 20 s).
ASK_WAIT_S = 60.0
_COOKIE_PREFIX = "hmt_preview_"
#: What a client (or a slot) that goes away or speaks nonsense ends a connection with.
_CLIENT_ERRORS = (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                  ConnectionError, ValueError, SandboxError)
log = logging.getLogger(__name__)


@dataclass
class Preview:
    """One exposed port of a slot.

    Attributes:
        url: ``http://<host>:<port>/`` of the listener (no credentials in it).
        token: the exposure's secret, sent as ``Authorization: Bearer <token>``.
        slot_id: the slot's id; ``port``: the TCP port inside the slot.
        revoked: True once unexposed (release, ``unexpose``, ``stop``).
    """

    url: str
    token: str
    slot_id: str
    port: int
    revoked: bool = False
    _cookie_name: str = ""
    _tickets: dict[str, float] = field(default_factory=dict, repr=False)  # nonces used -> expiry
    _cookies: set[str] = field(default_factory=set, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        """The header that authenticates a request: ``{"Authorization": "Bearer <token>"}``."""
        return {"Authorization": f"Bearer {self.token}"}

    def ticket(self) -> str:
        """A new single-use ticket (valid :data:`TICKET_TTL_S` seconds), to send as the
        query parameter :data:`TICKET_PARAM` (see :meth:`ticket_url`).

        A ticket is ``nonce.expiry.mac``, signed with the preview's token (HMAC-SHA256):
        the listener checks it without having seen it made (it may run in another host
        process, ``host_processes``), and remembers each nonce it took until it expires.

        Raises:
            UsageError: the preview is revoked.
        """
        if self.revoked:
            raise UsageError(f"the preview of port {self.port} of slot {self.slot_id} is revoked")
        body = f"{secrets.token_urlsafe(12)}.{int(time.time() + TICKET_TTL_S)}"
        return f"{body}.{self._sign(body)}"

    def _sign(self, body: str) -> str:
        return hmac.new(self.token.encode(), body.encode(), "sha256").hexdigest()[:32]

    def _redeem(self, ticket: str) -> bool:
        """Whether ``ticket`` is one of this preview's, unexpired and not used before; it
        counts as used from now on."""
        nonce, _, rest = ticket.partition(".")
        until_text, _, mac = rest.partition(".")
        if not until_text.isdigit() or not hmac.compare_digest(mac, self._sign(f"{nonce}.{until_text}")):
            return False
        now = time.time()
        for old, until in list(self._tickets.items()):
            if until < now:
                del self._tickets[old]
        if int(until_text) < now or nonce in self._tickets:
            return False
        self._tickets[nonce] = float(until_text)
        return True

    def ticket_url(self, path: str = "/") -> str:
        """A URL with a new single-use ticket, for a browser: the first request trades it
        for a cookie (``HttpOnly``, ``SameSite=Lax``) and is redirected to ``path``.

        Raises:
            UsageError: the preview is revoked, or ``path`` does not start with ``/``.
        """
        if not isinstance(path, str) or not path.startswith("/"):
            raise UsageError(f"ticket_url: path must start with '/', got {path!r:.80}")
        sep = "&" if "?" in path else "?"
        return self.url.rstrip("/") + path + sep + urlencode({TICKET_PARAM: self.ticket()})


def check_host(host: Any, where: str = "expose(host=...)") -> str:
    """``host`` as the IP address text to listen on.

    Raises:
        UsageError: not an IPv4 or IPv6 address literal (named with ``where``).
    """
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        raise UsageError(f"{where}: the preview's host must be an IP address, got {host!r:.80}") from None


def _check_port(port: Any, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536 or (
            port == 0 and what == "port"):
        raise UsageError(f"expose: {what} must be a whole number from {1 if what == 'port' else 0} "
                         f"to 65535, got {port!r:.80}")
    return port


class _Exposure:
    """A preview's listener and the connections it made."""

    def __init__(self, backend: BackendView, slot: Slot, preview: Preview) -> None:
        self.backend, self.slot, self.preview = backend, slot, preview
        self.server: asyncio.base_events.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client connection. Its work runs in a task of its own, the one
        :meth:`revoke` cancels (a cancelled connection handler would make asyncio log an
        error on Python 3.11)."""
        if self.preview.revoked:
            writer.close()
            return
        inner = asyncio.ensure_future(self._serve(reader, writer))
        self.tasks.add(inner)
        try:
            await asyncio.wait([inner])
        finally:
            self.tasks.discard(inner)
            if not inner.done():
                inner.cancel()
                await asyncio.gather(inner, return_exceptions=True)
            elif not inner.cancelled():
                exc = inner.exception()
                if exc is not None and not isinstance(exc, _CLIENT_ERRORS):
                    log.warning("preview of port %d of slot %s: %r", self.preview.port,
                                self.preview.slot_id, exc)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_WAIT_S)
        parsed = _parse_head(head)
        if parsed is None:
            return _answer(writer, 400, "Bad Request", "malformed request\n")
        method, target, version, headers = parsed
        verdict = self._auth(target, headers)
        if verdict == "ticket":
            return self._trade_ticket(writer, target)
        if verdict != "ok":
            code, why = (401, "Unauthorized") if verdict == "none" else (403, "Forbidden")
            return _answer(writer, code, why, f"{why.lower()}: this preview needs its token\n",
                           [("WWW-Authenticate", 'Bearer realm="preview"')])
        upgrade = any(k.lower() == "upgrade" for k, _ in headers) and any(
            k.lower() == "connection" and "upgrade" in v.lower() for k, v in headers)
        out = [(k, v) for k, v in headers if not self._ours(k, v)]
        out = [(k, _strip_cookies(v) if k.lower() == "cookie" else v) for k, v in out]
        out = [(k, v) for k, v in out if not (k.lower() == "cookie" and not v)]
        if not upgrade:
            out = [(k, v) for k, v in out if k.lower() not in ("connection", "keep-alive")]
            out.append(("Connection", "close"))
        data = (f"{method} {target} {version}\r\n".encode("latin-1")
                + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in out) + b"\r\n")
        await self._splice(reader, writer, data)

    def _ours(self, key: str, value: str) -> bool:
        """The token's own header (taken out before the request reaches the slot)."""
        return key.lower() == "authorization" and _bearer(value) is not None and hmac.compare_digest(
            _bearer(value) or "", self.preview.token)

    def _auth(self, target: str, headers: list[tuple[str, str]]) -> str:
        """``ok``, ``ticket`` (a valid ticket to trade), ``bad`` or ``none``."""
        given = False
        for key, value in headers:
            low = key.lower()
            if low == "authorization" and _bearer(value) is not None:
                given = True
                if hmac.compare_digest(_bearer(value) or "", self.preview.token):
                    return "ok"
            elif low == "cookie":
                for name, val in _cookie_pairs(value):
                    if name == self.preview._cookie_name:
                        given = True
                        if any(hmac.compare_digest(val, c) for c in self.preview._cookies):
                            return "ok"
        for name, val in parse_qsl(urlsplit(target).query, keep_blank_values=True):
            if name == TICKET_PARAM:
                given = True
                if self.preview._redeem(val):  # single use
                    return "ticket"
        return "bad" if given else "none"

    def _trade_ticket(self, writer: asyncio.StreamWriter, target: str) -> None:
        cookie = secrets.token_urlsafe(32)
        self.preview._cookies.add(cookie)
        parts = urlsplit(target)
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                           if k != TICKET_PARAM])
        location = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~") + (f"?{query}" if query else "")
        _answer(writer, 303, "See Other", "", [
            ("Location", location),
            ("Set-Cookie", f"{self.preview._cookie_name}={cookie}; Path=/; HttpOnly; SameSite=Lax"),
            ("Cache-Control", "no-store")])

    async def _splice(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        sb, index = _where(self.backend, self.slot)
        try:
            opened = await sb.request({"op": "tunnel", "slot": index, "port": self.preview.port}, ASK_WAIT_S)
        except SandboxError as exc:
            return _answer(writer, 502, "Bad Gateway", f"the slot's sandbox did not answer: {exc}\n")
        if not opened.get("ok"):
            return _answer(writer, 502, "Bad Gateway", f"{opened.get('error')}\n")
        tid = opened["result"]["tunnel"]
        up = asyncio.ensure_future(_upstream(sb, tid, reader, head))
        down = asyncio.ensure_future(_downstream(sb, tid, writer))
        try:
            await down  # the slot's side ended: the client's connection ends too
        finally:
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)
            down.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sb.request({"op": "tunnel", "tunnel": tid, "close": True}, 10.0), 15.0)

    async def revoke(self) -> None:
        self.preview.revoked = True
        self.preview._tickets.clear()
        self.preview._cookies.clear()
        if self.server is not None:
            self.server.close()
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=20.0)


async def _ask(sb: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    reply = await sb.request(message, ASK_WAIT_S)
    if not reply.get("ok"):
        raise ConnectionError(str(reply.get("error")))
    result = reply.get("result") or {}
    result["blob"] = reply.get("blob", b"")
    return result


async def _upstream(sb: Sandbox, tid: str, reader: asyncio.StreamReader, head: bytes) -> None:
    """The client's bytes into the tunnel, at most :data:`WINDOW` writes unanswered."""
    inflight: deque[asyncio.Future[dict[str, Any]]] = deque()
    try:
        data = head
        while data:
            inflight.append(asyncio.ensure_future(_ask(sb, {"op": "tunnel", "tunnel": tid, "blob": data})))
            if len(inflight) >= WINDOW:
                await inflight.popleft()
            data = await reader.read(CHUNK_BYTES)
        while inflight:
            await inflight.popleft()
        await _ask(sb, {"op": "tunnel", "tunnel": tid, "end": True})
    finally:
        await _cancel(inflight)


async def _downstream(sb: Sandbox, tid: str, writer: asyncio.StreamWriter) -> None:
    """The slot's bytes to the client, at most :data:`WINDOW` reads asked ahead; each
    written (and drained: a slow client slows the slot's socket, nothing else) in order."""
    inflight: deque[asyncio.Future[dict[str, Any]]] = deque()
    try:
        while True:
            while len(inflight) < WINDOW:
                inflight.append(asyncio.ensure_future(_ask(sb, {"op": "tunnel", "tunnel": tid, "read": True})))
            try:
                got = await inflight.popleft()
            except (ConnectionError, SandboxError):
                return
            if got["blob"]:
                writer.write(got["blob"])
                await writer.drain()
            if got.get("eof"):
                return
    finally:
        await _cancel(inflight)


def _bearer(value: str) -> str | None:
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _cookie_pairs(value: str) -> list[tuple[str, str]]:
    pairs = []
    for part in value.split(";"):
        name, eq, val = part.strip().partition("=")
        if eq:
            pairs.append((name.strip(), val.strip()))
    return pairs


def _strip_cookies(value: str) -> str:
    """A Cookie header without the previews' cookies (of this preview or any other)."""
    return "; ".join(p.strip() for p in value.split(";")
                     if p.strip() and not p.strip().startswith(_COOKIE_PREFIX))


def _parse_head(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]] | None:
    """``(method, target, version, [(name, value), ...])`` of an HTTP/1.x request head,
    or None when it is not one (bad request line, a header line without a colon, a
    folded line, a character outside Latin-1)."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        return None
    lines = text[:-4].split("\r\n")
    words = lines[0].split(" ")
    if len(words) != 3 or not words[0].isalpha() or not words[2].startswith("HTTP/1.") or not (
            words[1].startswith("/")):
        return None
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or any(c in name for c in " \t\r\n") or (
                "\r" in value or "\n" in value):
            return None
        headers.append((name, value.strip()))
    return words[0], words[1], words[2], headers


def _answer(writer: asyncio.StreamWriter, code: int, reason: str, body: str,
            extra: list[tuple[str, str]] | None = None) -> None:
    data = body.encode()
    lines = [f"HTTP/1.1 {code} {reason}", "Content-Type: text/plain; charset=utf-8",
             f"Content-Length: {len(data)}", "Connection: close", *(f"{k}: {v}" for k, v in extra or ())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)


class PreviewMethods:
    """``expose`` and ``unexpose`` of :class:`~hermes_modal_tool.backend.ToolBackend`."""

    _pools: Any

    def _previews(self) -> list[_Exposure]:
        found = self.__dict__.get("_preview_list")
        if found is None:
            found = self.__dict__["_preview_list"] = []
        return found

    async def expose(self, slot: Slot, port: int, *, host: str = "127.0.0.1",
                     listen_port: int = 0) -> Preview:
        """Make TCP ``port`` of ``slot`` reachable at an authenticated URL on the host.

        Args:
            slot: a held slot (any network mode: the agent connects inside the slot's
                network namespace).
            port: the port inside the slot (1-65535), on its ``127.0.0.1`` (a server on
                all its addresses answers there too). Nothing needs to listen yet: a
                request before the server is up is answered 502.
            host: the host's IP address to listen on (default ``127.0.0.1``; an address
                literal, not a name).
            listen_port: the host's port (default 0: one the kernel picks).

        Returns:
            A :class:`Preview` (``url``, ``token``, ``headers``, ``ticket_url()``), valid
            until :meth:`unexpose`, the slot's release or ``stop()``.

        Raises:
            UsageError: a bad ``port``, ``host`` or ``listen_port`` (named), a slot not held.
            OSError: the listener cannot bind (``host`` is not this machine's, the port taken).
        """
        if not isinstance(slot, Slot):
            raise UsageError(f"expose() takes a Slot, got {type(slot).__name__}")
        port = _check_port(port, "port")
        listen_port = _check_port(listen_port, "listen_port")
        host = check_host(host)
        self._check_open()  # type: ignore[attr-defined]
        _where(self, slot)  # type: ignore[arg-type]  # held, of this backend
        preview = Preview(url="", token=secrets.token_urlsafe(32), slot_id=slot.slot_id, port=port)
        exposure = _Exposure(self, slot, preview)  # type: ignore[arg-type]
        exposure.server = await asyncio.start_server(exposure.handle, host, listen_port,
                                                     limit=MAX_HEAD_BYTES)
        bound = exposure.server.sockets[0].getsockname()[1]
        preview.url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}/"
        preview._cookie_name = f"{_COOKIE_PREFIX}{bound}"
        self._previews().append(exposure)
        return preview

    async def unexpose(self, target: Slot | Preview, port: int | None = None) -> int:
        """Revoke previews: ``target`` a :class:`Preview`, or a slot (its previews of
        ``port``, or all of them when ``port`` is None). The listeners close (new
        connections are refused) and their open connections end. Returns how many
        previews were revoked (0: none matched; revoking twice is fine)."""
        if isinstance(target, Preview):
            match = [e for e in self._previews() if e.preview is target]
        elif isinstance(target, Slot):
            match = [e for e in self._previews() if e.slot is target and port in (None, e.preview.port)]
        else:
            raise UsageError(f"unexpose() takes a Slot or a Preview, got {type(target).__name__}")
        return await _revoke(self._previews(), match)

    async def _unexpose_all(self, slot: Slot | None = None) -> None:
        """Revoke the previews of ``slot`` (its release), or all (``stop()``)."""
        match = [e for e in self._previews() if slot is None or e.slot is slot]
        await _revoke(self._previews(), match)


async def _revoke(held: list[_Exposure], match: list[_Exposure]) -> int:
    for exposure in match:
        held.remove(exposure)
    await asyncio.gather(*(e.revoke() for e in match), return_exceptions=True)
    return len(match)
