"""The stream's own speed: what the framed stream between the host and a sandbox's agent
carries for a transfer's traffic (chunks of :data:`~._transfer_wire.CHUNK_BYTES` in
binary frames, :data:`~._transfer_wire.DEPTH` in flight up, :data:`~._transfer_wire.DOWN_DEPTH`
asked ahead down, one request and one reply each),
with no file, thread or checksum on either end (the agent's side:
``agent/files/streamprobe.py``). ``benchmarks/transfer.py`` prints it beside ``cp``: the
ceiling a transfer is measured against.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from . import _transfer_wire as wire
from .errors import TransferError, UsageError
from .slots import Slot

if TYPE_CHECKING:
    from ._backend_view import BackendView


async def stream_speed(backend: BackendView, slot: Slot, nbytes: int) -> dict[str, float]:
    """Move ``nbytes`` (> 0) up to the agent and down again as a transfer would, and
    return ``{"up_MBps", "down_MBps"}`` (10^6 bytes per second each way).

    Raises:
        UsageError: ``slot`` is not a slot of ``backend``, or ``nbytes`` is not a whole
            number > 0.
        TransferError: the agent refused the probe, or its sandbox died.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise UsageError(f"stream_speed: nbytes must be a whole number > 0, got {nbytes!r}")
    sb, index = wire._where(backend, slot)
    what = f"stream probe of slot {slot.slot_id}"
    block = bytes(range(256)) * (wire.CHUNK_BYTES // 256)

    async def chunks() -> AsyncIterator[bytes]:
        left = nbytes
        while left > 0:
            yield block if left >= len(block) else block[:left]
            left -= len(block)

    opened = await wire._ask(sb, {"op": "upload", "slot": index, "kind": "probe"}, what)
    t0 = time.perf_counter()
    end = await wire._send(sb, opened["stream"], chunks(), what)
    up_s = time.perf_counter() - t0
    if end.get("bytes") != nbytes:
        raise TransferError(f"{what}: the agent got {end.get('bytes')} bytes of {nbytes}")
    opened = await wire._ask(sb, {"op": "download", "slot": index, "kind": "probe", "size": nbytes}, what)
    sid = opened["stream"]
    inflight: deque[asyncio.Future] = deque()
    got = 0
    t0 = time.perf_counter()
    try:
        while True:
            while len(inflight) < wire.DOWN_DEPTH:
                inflight.append(asyncio.ensure_future(wire._ask(sb, {"op": "download", "stream": sid}, what)))
            reply = await inflight.popleft()
            got += len(reply.get("blob", b""))
            if reply.get("eof") or got > nbytes:
                break
    finally:
        await wire._cancel(inflight)
        await wire._close(sb, "download", sid)
    down_s = time.perf_counter() - t0
    if got != nbytes:
        raise TransferError(f"{what}: got {got} bytes of {nbytes} from the agent")
    return {"up_MBps": nbytes / 1e6 / up_s, "down_MBps": nbytes / 1e6 / down_s}
