"""A reset answers once the old tenant is killed, and reuses the dropped layer's
directories: neither lets the next tenant see anything of the last one.

The reset of a slot with a layered root answers as soon as the kill is sent; the old
sandbox's teardown (its processes' end, the swap to a fresh layer) finishes while the
slot stays busy, so a call for the slot made right after ``release`` waits for it. The
dropped layer's directories are emptied and kept (``agent/fs/layerspares.py``) for a later
layer of any slot: only the tenant's ``upper`` holds what it wrote, and that is deleted.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from support import bash, layered

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("slots of their own uid and root need the backend to run as root")


BUSY_TENANT = ("cd /; (while :; do date +%N >> /etc/busy; done &) ; "
               "(sleep 300 &) ; sleep 0.2; test -s /etc/busy && echo writing")
LOOK = ("test -e /etc/busy && echo busy-file || echo no-busy-file; "
        "pgrep -x sleep >/dev/null && echo old-sleep || echo no-sleep; "
        "ls -A /root /tmp | grep -v -e : -e '^$'; stat -c '%a %u' /; echo end")


async def test_a_call_right_after_release_sees_none_of_the_killed_tenant(make_backend):
    # One slot: the next acquire gets the slot that was just released, at once.
    backend = await make_backend(slots_per_sandbox=1, min_sandboxes=1, max_sandboxes=1)
    if not layered(backend):
        pytest.skip("no layered root here")
    for round_ in range(5):
        slot = await backend.acquire(f"busy-{round_}")
        r = await bash(backend, slot, LOOK)
        assert r.output == "no-busy-file\nno-sleep\n755 0\nend\n", (round_, r.output)
        r = await bash(backend, slot, BUSY_TENANT + "; echo s >/root/s; chmod 700 /")
        assert r.output == "writing\n", r
        await backend.release(slot, reset_workspace=True)


async def test_dropped_layers_directories_are_reused_and_nothing_piles_up(make_backend):
    # The layers' directories on the state's disk (with slot_disk enforced by the kernel each
    # layer is a file system of its own instead, freed whole: agent/fs/slotdisk.py).
    backend = await make_backend(slots_per_sandbox=3, min_sandboxes=1, max_sandboxes=1,
                                 disk_limit="watch")
    if not layered(backend):
        pytest.skip("no layered root here")
    pool = next(iter(backend._pools.values()))
    [sandbox] = pool._sandboxes.values()
    state = next(d for d in backend._drivers.values()).state_root / sandbox.sandbox_id

    def layers() -> dict[int, list[str]]:
        return {i: sorted(n for n in os.listdir(state / "fs" / f"slot_{i}") if n.startswith("layer-"))
                for i in range(2)}

    # A layer directory is known by its inode: a reused one turns up under a new name.
    names_of: dict[int, set[str]] = {}
    for round_ in range(12):
        slots = [await backend.acquire(f"t{round_}-{i}") for i in range(2)]
        for slot in slots:
            r = await bash(backend, slot, LOOK)
            assert r.output == "no-busy-file\nno-sleep\n755 0\nend\n", (round_, r.output)
            r = await bash(backend, slot, "mkdir -p /usr/share/t/a/b && echo x >/usr/share/t/a/b/f "
                                          "&& echo x >/etc/busy && chmod 777 / && echo ok")
            assert r.output == "ok\n", r
        for i, names in layers().items():
            for name in names:
                try:
                    names_of.setdefault(os.stat(state / "fs" / f"slot_{i}" / name).st_ino, set()).add(
                        f"slot_{i}/{name}")
                except FileNotFoundError:  # dropped meanwhile
                    pass
        for slot in slots:
            await backend.release(slot, reset_workspace=True)
    for _ in range(100):  # the layer work of the last resets runs in the background
        spare = sorted(os.listdir(state / "spare"))
        now = layers()
        if not os.listdir(state / "trash") and all(len(v) <= 2 for v in now.values()):
            break
        await asyncio.sleep(0.05)
    # Each used slot: the layer in use and its standby; the rest was reused or deleted.
    assert all(len(v) <= 2 for v in now.values()), now
    assert not os.listdir(state / "trash")
    # How many are kept at the end depends on how the layers and standby threads met
    # (a standby built before a drop was kept makes its own); never more than KEEP.
    assert len(spare) <= 8, spare
    reused = [names for names in names_of.values() if len(names) > 1]
    assert reused, names_of
    for name in spare:  # kept: the layer directory, overlay's empty work and the mount point
        try:
            kept = (sorted(os.listdir(state / "spare" / name)), os.listdir(state / "spare" / name / "work"),
                    os.listdir(state / "spare" / name / "merged"))
        except FileNotFoundError:  # taken for a standby layer since it was listed (background work)
            continue
        assert kept == (["merged", "work"], [], []), (name, kept)
