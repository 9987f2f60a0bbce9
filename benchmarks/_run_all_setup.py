"""How big ``run_all.py``'s measurements are in each mode (``Sizes``, ``SIZES``), and what
its measurements share: the run's profile name, the command timed, a started backend and
the local Modal control plane. Used by ``run_all.py``, ``_run_all_latency.py`` and
``_run_all_throughput.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hermes_modal_tool import SandboxConfig, ToolBackend

PROFILE = f"ra{os.getpid()}"
COMMAND = "echo hi"


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is, per mode."""

    lat_fast: int  # calls per fast system (ours, subprocess.run)
    lat_slow: int  # calls per slow system (exec per command, SWE-ReX)
    lat_blocks: int  # the systems take turns this many times
    slots: tuple[int, ...]  # throughput against slots: ours (local driver)
    modal_slots: tuple[int, ...]  # ... ours (Modal driver)
    exec_slots: tuple[int, ...]  # ... concurrent execs per command
    swerex_slots: tuple[int, ...]  # ... SWE-ReX sessions in threads
    tp_calls: int  # calls per throughput point (at least tp_rounds rounds)
    tp_rounds: int
    per_sandbox: int  # slots_per_sandbox of the slot sweep
    sps_slots: int  # slots of the slots_per_sandbox sweep
    sps_sandboxes: tuple[int, ...]
    sps_rounds: int
    swerex_sessions: int  # sessions for the SWE-ReX memory measurement
    engine: tuple[str, ...]
    modal_rpc: tuple[str, ...]
    load: tuple[str, ...]


SIZES = {
    "full": Sizes(2000, 200, 10, (1, 10, 50, 100, 200, 400), (1, 10, 50, 100, 200, 400),
                  (1, 10, 50), (1, 10, 50), 8000, 10, 100, 200, (1, 2, 4, 10, 50, 200), 40, 20,
                  (), (), ()),
    "quick": Sizes(300, 30, 5, (1, 10, 100, 400), (1, 10, 100), (1, 10), (1, 10), 1000, 5,
                   100, 200, (1, 10, 200), 5, 5, ("--quick",), ("--quick",), ("--quick",)),
    "smoke": Sizes(20, 3, 1, (1, 4), (1, 4), (1, 2), (1,), 40, 2, 4, 4, (1, 4), 2, 2,
                   ("--quick", "--sections", "e", "--slots", "10", "--per-sandbox", "10",
                    "--no-swerex"),
                   ("--quick", "--commands", "5", "--rounds", "1", "--starts", "1",
                    "--budget", "5"),
                   ("--quick", "--trajectories", "10", "--steps", "3",
                    "--slots-per-sandbox", "10")),
}


@contextlib.asynccontextmanager
async def backend(config: SandboxConfig) -> Any:
    """A started backend, stopped at the end (also when starting fails)."""
    b = ToolBackend(config)
    try:
        await b.start()
        yield b
    finally:
        await b.stop()


@contextlib.contextmanager
def modal_server() -> Iterator[Any]:
    """The local Modal control plane on a thread, with the SDK's environment pointed at it."""
    from hermes_modal_tool.testing.modal_server import serve_for_this_process

    with serve_for_this_process() as server:
        yield server
