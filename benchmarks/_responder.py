"""A stand-in for a sandbox's agent on the far end of real pipes, for ``host_calls.py
--pipes``: it reads the host's frames on stdin and answers each ``calls`` frame with the
``results`` frame an agent sends for those ``echo i`` commands (compact, as
``agent/main.py`` sends them), on stdout.

    python _responder.py PARTS SPREAD_MS

``PARTS``: the frames a batch's results are split into (an agent under load sends a
batch's results in several: those that ended within its hold, ``agent/calls.HOLD_S``);
``SPREAD_MS``: each part goes after a random delay of up to this many milliseconds (0:
at once), so that the host's reads come apart in time as they do from busy agents.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from typing import Any

from hermes_modal_tool import protocol


def results(msg: dict[str, Any]) -> list[list[Any]]:
    """The compact results of a ``calls`` frame's ``echo i`` commands."""
    return [[c[0], {"output": c[3]["command"][5:] + "\n", "returncode": 0, "duration_s": 0.00123}]
            for c in msg["calls"]]


async def serve(parts: int, spread_s: float) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    decoder = protocol.FrameDecoder()

    def send(res: list[list[Any]]) -> None:
        os.write(1, protocol.encode({"id": 0, "results": res}))

    while data := await reader.read(1 << 20):
        for msg in decoder.feed(data):
            if msg.get("op") != "calls":
                continue
            res = results(msg)
            step = max(1, -(-len(res) // parts))
            for i in range(0, len(res), step):
                if spread_s:
                    loop.call_later(random.uniform(0, spread_s), send, res[i:i + step])
                else:
                    send(res[i:i + step])


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), float(sys.argv[2]) / 1000))
