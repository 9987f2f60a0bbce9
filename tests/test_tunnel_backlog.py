"""The agent's rule for a tunnel's read answers (``agent/net/tunnels.py``), on a real pipe,
as ``test_transfer_backlog`` checks it for downloads: an answer goes while less than
``BULK_BACKLOG`` of frames wait; when what waits is this loop pass's frames and their
flush is due at once, it looks again right after the flush (before, it always waited
``BULK_RETRY_S``: a preview's download went at most one chunk per millisecond then);
when the transport's own buffer holds that much, it waits ``BULK_RETRY_S``."""

from __future__ import annotations

import asyncio
import fcntl
import os
from types import SimpleNamespace

from hermes_modal_tool import protocol
from hermes_modal_tool.agent.net import tunnels


class _Paused:
    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def test_a_read_answer_looks_again_after_the_flush_not_a_millisecond_later():
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    fcntl.fcntl(w, 1031, 1024 * 1024)  # F_SETPIPE_SZ, as the agent widens its stdout
    fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(w, "wb", 0))
    agent = SimpleNamespace(loop=loop, out=transport, outbox=[], flush_soon=False)
    agent.send = lambda msg: agent.outbox.append(protocol.encode(msg))
    tunnel = tunnels.Tunnel(agent, 0, "t1")
    tunnel.transport = _Paused()
    try:
        tunnel.buf = bytearray(b"x" * tunnels.CHUNK_BYTES)
        tunnel.request({"id": 1, "read": True})
        assert len(agent.outbox) == 1 and tunnel.retry is None  # nothing waits: it goes
        tunnel.buf = bytearray(b"y" * tunnels.CHUNK_BYTES)
        agent.outbox.append(b"f" * tunnels.BULK_BACKLOG)  # this pass's frames ...
        agent.flush_soon = True  # ... flushed at once
        tunnel.request({"id": 2, "read": True})
        assert tunnel.retry is not None and not isinstance(tunnel.retry, asyncio.TimerHandle)
        tunnel.retry.cancel()
        tunnel.retry = None
        agent.outbox, agent.flush_soon = [], False
        transport.write(b"b" * (1024 * 1024 + tunnels.BULK_BACKLOG))  # the pipe full, the rest buffered
        assert transport.get_write_buffer_size() >= tunnels.BULK_BACKLOG
        agent.flush_soon = True
        tunnel.request({"id": 3, "read": True})
        assert isinstance(tunnel.retry, asyncio.TimerHandle)  # the host is behind: it waits
    finally:
        for _mid, timer in tunnel.reads:
            timer.cancel()
        if tunnel.retry is not None:
            tunnel.retry.cancel()
        transport.abort()
        os.close(r)
