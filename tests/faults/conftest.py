"""``faulty``: a started backend plus its :class:`faultkit.Footprint`; at the end of the
test the backend is stopped and nothing it created may be left: no process, cgroup,
mount or temporary directory (counted before, during and after)."""

from __future__ import annotations

import asyncio
import glob
import os
from typing import Any

import pytest

from hermes_modal_tool import ToolBackend

from .faultkit import Footprint, machine_globals

#: Two sandboxes of three slots: a fault in one sandbox has bystanders in the same one
#: (shell faults) and in the other (sandbox faults).
FAULT_DEFAULTS: dict[str, Any] = {
    "slots_per_sandbox": 3, "min_sandboxes": 2, "max_sandboxes": 2,
    "acquire_timeout_s": 15.0, "execution_timeout_s": 60.0, "scale_down_idle": False,
}


def _remove_cgroups(paths: list[str]) -> None:
    for path in paths:
        for sub in sorted(glob.glob(os.path.join(path, "slot_*"))) + [path]:
            try:
                os.rmdir(sub)
            except OSError:
                pass


@pytest.fixture
async def faulty(make_backend):
    made: list[Footprint] = []
    before = machine_globals()

    async def build(**fields: Any) -> tuple[ToolBackend, Footprint]:
        backend = await make_backend(**{**FAULT_DEFAULTS, **fields})
        fp = Footprint(backend, make_backend.leftovers.token)
        fp.learn()
        made.append(fp)
        # Warm every slot's shell so the footprint is complete, then check it is seen.
        running = fp.count()
        assert running["dirs"] and len(fp.agents()) == backend.get_status()["sandboxes"], running
        return backend, fp

    yield build

    for fp in made:
        make_backend.note(fp.backend)
        await asyncio.wait_for(fp.backend.stop(), 30)
    for fp in made:
        left = await fp.settled_count()
        _remove_cgroups(left["cgroups"])  # report a leak, but do not keep it on the machine
        assert not any(left.values()), f"left behind after stop(): {left}"
        assert not fp.agents_seen & {p.pid for p in left["processes"]}
    after = machine_globals()
    for kind in ("tmp", "cgroups"):
        names = {r.rsplit("/", 1)[-1] for fp in made for r in (fp.state_root, fp.ctl_root) if r}
        ours = [p for p in after[kind] - before[kind] if any(n in p for n in names)]
        assert not ours, f"new {kind} of this test left after stop(): {ours}"
