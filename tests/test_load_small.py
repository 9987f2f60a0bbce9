"""The load benchmark (benchmarks/load.py) at a small size: 40 trajectories x 10 steps of
mixed work (builtins, python3 processes, write_file + cat, failures, timeouts), every
result checked; nothing lost or misrouted, and nothing left after stop()."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "load.py"
_spec = importlib.util.spec_from_file_location("hmt_load_benchmark", _PATH)
load = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = load
_spec.loader.exec_module(load)


@pytest.mark.parametrize("mode", ["tasks", "lockstep"])
async def test_small_load_loses_and_misroutes_nothing(mode):
    start = time.monotonic()
    # 1 timeout in 40 steps: a few at this size, so the timeout path is exercised.
    res = await load.run_load(trajectories=40, steps=10, slots_per_sandbox=10, mode=mode,
                              timeout_every=40, pss_every=1.0)
    took = time.monotonic() - start
    report = load.render(res)
    assert res["calls"] >= 40 * 10, report
    assert res["ok"] == res["calls"], report
    assert res["lost"] == res["misrouted"] == res["wrong"] == 0, report
    assert res["by_kind"].get("timeout", 0) >= 1 and res["by_kind"].get("process", 0) >= 1, report
    assert res["status"]["sandboxes_died"] == 0, report
    assert res["status"]["timeouts"] == res["by_kind"]["timeout"], report
    assert res["clean"], report
    # No bound on the time here (it failed at 34.4 s against 30 s with three suites at once
    # on this 2-core machine): how fast is benchmarks/load.py's to say, not a test's.
    print(f"small load ({mode}): {took:.1f}s\n{report}")
