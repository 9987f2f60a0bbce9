"""An agent that stops answering (SIGSTOP) while a batch waits on it: the host gives up on
that sandbox's calls at their deadline, the other sandbox's calls are untouched, and the
sandbox answers again once it runs.

A batch's calls to one sandbox share one deadline on the host (``_call_group.py``): the
longest wait of its calls, its timeout plus ``HOST_GRACE_S`` (1 s here, so 1 + 1 s).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from hermes_modal_tool import _pool_calls

from .test_faults import six_slots


async def test_a_hung_agent_fails_its_calls_at_the_deadline_and_only_those(faulty, monkeypatch):
    monkeypatch.setattr(_pool_calls, "HOST_GRACE_S", 1.0)
    backend, fp = await faulty()
    by = await six_slots(backend)
    (hung_id, hung), (_, fine) = sorted(by.items())
    slots = hung + fine
    batch = [(s, "bash", {"command": f"echo {s.trajectory_id}"}) for s in slots]
    # The control: every call answers while the agent runs.
    rs = await asyncio.wait_for(backend.execute_batch(batch, timeout_s=1), 15)
    assert [r.output for r in rs] == [f"{s.trajectory_id}\n" for s in slots], rs
    pid = fp.agents()[hung_id]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        rs = await asyncio.wait_for(backend.execute_batch(batch, timeout_s=1), 15)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    for s, r in zip(slots, rs, strict=True):
        if s in hung:
            assert not r.success and "did not answer within 2s" in (r.error or ""), r
        else:
            assert r.output == f"{s.trajectory_id}\n", r
    assert 1.5 < took < 8, f"the batch came back after {took:.1f}s, its deadline was 2s"
    # Running again, the agent answers the next batch (the calls the host gave up on were
    # cancelled, and their late answers are dropped).
    rs = await asyncio.wait_for(backend.execute_batch(
        [(s, "bash", {"command": "cat owner"}) for s in slots], timeout_s=5), 15)
    assert [r.output for r in rs] == [f"{s.trajectory_id}\n" for s in slots], rs
