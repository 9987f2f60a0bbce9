"""Rounds of trivial commands over held slots, shared by the throughput measurements of
``engine.py`` (section b), ``modal_rpc.py`` (section b) and ``run_all.py`` (throughput
against slots): one ``execute_batch`` per round with one ``echo i`` per slot, the way a
batch of trajectories takes one step each.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


async def warm_up(b: Any, slots: Sequence[Any], rounds: int = 3) -> None:
    """``rounds`` rounds of ``true`` in every slot (the first starts each slot's shell).

    Raises:
        RuntimeError: a call failed (its ExecutionResult).
    """
    for _ in range(rounds):
        rs = await b.execute_batch([(s, "bash", {"command": "true"}) for s in slots])
        if not all(r.success for r in rs):
            raise RuntimeError(next(r for r in rs if not r.success))


async def echo_rounds(b: Any, slots: Sequence[Any], rounds: int) -> tuple[float, int]:
    """``rounds`` rounds of ``echo i`` (round ``i``) in every slot; returns (wall seconds,
    outputs that were not ``i``)."""
    wrong = 0
    t0 = time.perf_counter()
    for i in range(rounds):
        rs = await b.execute_batch([(s, "bash", {"command": f"echo {i}"}) for s in slots])
        wrong += sum(r.output != f"{i}\n" for r in rs)
    return time.perf_counter() - t0, wrong
