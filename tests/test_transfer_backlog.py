"""The agent's rule for download chunks (``agent/files/streamout.hold_back``), on a real
pipe: a chunk goes while less than a chunk waits for the host, looks again right after
the flush when what waits is this loop pass's own frames, and waits (for the host's next
request, or 1 ms) while the pipe to the host holds a chunk it has not read."""

from __future__ import annotations

import asyncio
import fcntl
import os
from types import SimpleNamespace

from hermes_modal_tool.agent.files import streamout


async def test_a_download_chunk_waits_while_a_chunk_waits_for_the_host():
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    fcntl.fcntl(w, 1031, 1024 * 1024)  # F_SETPIPE_SZ, as the agent widens its stdout
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(w, "wb", 0))
    agent = SimpleNamespace(loop=loop, out=transport, outbox=[], flush_soon=False)
    chunk = b"c" * streamout.PIPE_BACKLOG
    try:
        assert streamout.hold_back(agent, lambda: None) is None  # nothing waits: it goes
        agent.outbox, agent.flush_soon = [chunk], True  # this pass's frame, flushed at once
        handle = streamout.hold_back(agent, lambda: None)
        assert handle is not None and not isinstance(handle, asyncio.TimerHandle)  # right after the flush
        handle.cancel()
        agent.outbox, agent.flush_soon = [], False
        os.write(w, chunk)  # a chunk in the pipe, not yet read by the host
        handle = streamout.hold_back(agent, lambda: None)
        assert isinstance(handle, asyncio.TimerHandle), handle  # it waits
        handle.cancel()
        got = 0
        while got < len(chunk):  # the host reads it
            got += len(os.read(r, 1 << 20))
        assert streamout.hold_back(agent, lambda: None) is None  # it goes again
    finally:
        transport.close()
        os.close(r)
