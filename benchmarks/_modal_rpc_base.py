"""What every part of ``modal_rpc.py`` shares: the run's profile name, the command and the
slot count, the config of the Modal backends it measures, the CPU log of its steps and a
step that writes to it, the server's RPC counts (``Meter``) and ``summary_ms``. Used by
``modal_rpc.py``, ``_modal_rpc_hops.py`` and ``_modal_rpc_render.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from _machine import log
from _proc import CpuStep, quantile

from hermes_modal_tool import ModalSandboxConfig
from hermes_modal_tool.testing.modal_server import LocalModalServer

PROFILE = f"mrpc{os.getpid()}"  # unique to this run: sandbox ids and cgroup names derive from it
COMMAND = "echo hi"
SLOTS = 8
CPU_LOG: list[dict[str, Any]] = []


# -- small helpers -----------------------------------------------------------------------
def summary_ms(xs: Sequence[float]) -> dict[str, float]:
    """Seconds in, a dict of milliseconds out."""
    return {"n": len(xs), "median": quantile(xs, 0.5) * 1e3, "p90": quantile(xs, 0.9) * 1e3,
            "p99": quantile(xs, 0.99) * 1e3, "mean": sum(xs) / max(len(xs), 1) * 1e3}


def per(counts: dict[str, int], n: int) -> dict[str, float]:
    return {k: v / n for k, v in sorted(counts.items())}


class Meter:
    """RPCs and stream messages the server received between :meth:`reset` and :meth:`read`."""

    def __init__(self, server: LocalModalServer) -> None:
        self.server = server

    def reset(self) -> None:
        self.server.reset_counts()

    def read(self) -> dict[str, dict[str, int]]:
        return {"rpcs": dict(self.server.rpc_counts),
                "stream_messages": dict(self.server.stream_messages)}


@contextlib.contextmanager
def step(label: str) -> Iterator[CpuStep]:
    """A measured step: its wall time and the CPU busy elsewhere go to the CPU log."""
    log(label)
    with CpuStep(label) as s:
        yield s
    r = s.result()
    CPU_LOG.append(r)
    log(f"{label}: {r['wall_s']:.1f} s (other processes: {r['other_cores_low']:.2f}.."
        f"{r['other_cores']:.2f} cores busy)")


def cfg(**kw: Any) -> ModalSandboxConfig:
    base: dict[str, Any] = {"name": PROFILE, "image": "python:3.11", "slots_per_sandbox": SLOTS,
                            "min_sandboxes": 1, "max_sandboxes": 2, "execution_timeout_s": 60,
                            "idle_timeout": 600}
    base.update(kw)
    return ModalSandboxConfig(**base)


async def settle() -> None:
    """Let streams that a start opens in the background reach the server."""
    await asyncio.sleep(0.2)
