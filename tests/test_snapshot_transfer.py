"""Snapshots across sandboxes: 32 forks over 2 sandboxes, export then import elsewhere."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile

import pytest
from support import bash

from hermes_modal_tool import SnapshotError

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("snapshots need a layered root (the backend must run as root)")


STATE = """mkdir -p /workspace/app/sub && cd /workspace/app
echo v1 > sub/config.txt; ln -s sub/config.txt link; ln sub/config.txt hard
rm -f /etc/hostname.bak; echo hidden > /etc/zz; rm /etc/zz
mkdir -p /opt/cache && echo c > /opt/cache/x && rm -rf /opt/cache && mkdir /opt/cache && echo fresh > /opt/cache/y
export APP_MODE=test; f() { echo fn-ok; }
"""
CHECK = ("pwd; cat link; stat -c %h hard; ls /opt/cache; echo $APP_MODE; f; id -u; "
         "stat -c %u sub/config.txt; test -e /etc/zz || echo no-zz")
EXPECTED = ["/workspace/app", "v1", "2", "y", "test", "fn-ok", "0", "0", "no-zz"]


async def test_32_forks_across_two_sandboxes(make_backend):
    backend = await make_backend(slots_per_sandbox=17, min_sandboxes=2, max_sandboxes=2,
                                 acquire_timeout_s=60, execution_timeout_s=60)
    parent = await backend.acquire("parent")
    await bash(backend, parent, STATE)
    snap = await backend.snapshot(parent)
    forks = await backend.fork(snap, 32)
    by_sandbox = {}
    for f in forks:
        by_sandbox.setdefault(f.sandbox_id, []).append(f)
    assert sorted(len(v) for v in by_sandbox.values()) == [16, 16]
    # the frozen layer moved once to the other sandbox
    [listed] = backend.get_status()["snapshots"]
    assert len(listed["sandboxes"]) == 2
    results = await backend.execute_batch(
        [(f, "bash", {"command": CHECK + f"; echo {i} >> sub/config.txt; tail -1 sub/config.txt"})
         for i, f in enumerate(forks)])
    for i, r in enumerate(results):
        assert r.output.split() == EXPECTED + [str(i)], (forks[i].sandbox_id, r.output, r.error)
    await asyncio.gather(*(backend.release(f, reset_workspace=True) for f in forks))
    await backend.release_snapshot(snap)
    for sb in backend._pools[parent.profile]._sandboxes.values():
        listing = (await sb.request({"op": "snapshots"}, 10))["result"]["snapshots"]
        assert [s["users"] for s in listing] in ([], [1])  # only the parent's own layer uses one


async def test_export_then_import_on_another_backend_reproduces_the_state(make_backend):
    one = await make_backend(slots_per_sandbox=2, max_sandboxes=1)
    parent = await one.acquire("parent")
    await bash(one, parent, STATE)
    snap = await one.snapshot(parent)
    chunks = [c async for c in one.export_snapshot(snap)]
    data = b"".join(chunks)
    names = tarfile.open(fileobj=io.BytesIO(data)).getnames()
    assert names[0] == "hmt-snapshot.json" and any(n.endswith("sub/config.txt") for n in names)
    other = await make_backend(slots_per_sandbox=2, max_sandboxes=1)
    imported = await other.import_snapshot(data)
    assert imported.size_bytes > 0
    slot = await other.acquire("elsewhere", snapshot=imported)
    assert (await bash(other, slot, CHECK)).output.split() == EXPECTED
    # a chunked import works too
    again = await other.import_snapshot(iter(chunks))
    [s2] = await other.fork(again, 1)
    assert (await bash(other, s2, "cat /workspace/app/sub/config.txt")).output == "v1\n"


async def test_import_refuses_a_damaged_or_hostile_stream(make_backend):
    backend = await make_backend(slots_per_sandbox=2, max_sandboxes=1)
    with pytest.raises(SnapshotError, match="not a snapshot stream|import failed"):
        await backend.import_snapshot(b"not a tar at all" * 100)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        meta = b'{"format": 1, "mounts": ["/"], "layers": 1, "state": ""}'
        info = tarfile.TarInfo("hmt-snapshot.json")
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
        link = tarfile.TarInfo("L0/m0/escape")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)
        evil = tarfile.TarInfo("L0/m0/escape/passwd-hmt-test")
        evil.size = 1
        tar.addfile(evil, io.BytesIO(b"x"))
    with pytest.raises(SnapshotError, match="below a symbolic link|layer roots"):
        await backend.import_snapshot(buf.getvalue())
    assert not os.path.lexists("/etc/passwd-hmt-test")  # noqa: ASYNC240 - one stat
