"""The agent's side of the host's stream: frames in, messages to the agent (a call batch
marked as one), and shutdown when the stream ends or breaks.

Stdlib-only, Python 3.8.
"""

import asyncio
import sys

from .. import protocol
from .calls import BATCH_KEY, COMPACT_KEY, Batch


class InProtocol(asyncio.Protocol):
    """Reads the host's frames (``protocol.FrameDecoder``); a bad frame ends the agent."""

    def __init__(self, agent):
        self.agent = agent
        self.decoder = protocol.FrameDecoder()

    def data_received(self, data):
        try:
            messages = self.decoder.feed(data)
        except protocol.ProtocolError as exc:
            sys.stderr.write("hermes-modal-tool agent: %s\n" % exc)
            self.agent.own(self.agent.shutdown())
            return
        if self.agent.heartbeat is not None:
            self.agent.heartbeat.heard = True
        if any(msg.get("op") == "calls" for msg in messages):
            messages = list(_expand(messages))
        calls = [msg for msg in messages if msg.get("op") == "call"]
        compact = any(msg.get(COMPACT_KEY) for msg in calls)
        if len(calls) > 1 or compact:
            batch = Batch(len(calls), compact=compact)
            for msg in calls:
                msg[BATCH_KEY] = batch
        for msg in messages:
            self.agent.on_message(msg)

    def eof_received(self):
        self.agent.own(self.agent.shutdown())

    def connection_lost(self, exc):
        self.agent.own(self.agent.shutdown())


def _expand(messages):
    """Each ``calls`` frame's entries as ``call`` messages (marked: their results go back
    in ``results`` frames); other messages as they are. A malformed entry is skipped."""
    for msg in messages:
        if msg.get("op") != "calls":
            yield msg
            continue
        for entry in msg.get("calls") or ():
            if isinstance(entry, list) and len(entry) == 5:
                mid, slot, tool, args, timeout = entry
                yield {"op": "call", "id": mid, "slot": slot, "tool": tool, "args": args,
                       "timeout": timeout, COMPACT_KEY: True}
