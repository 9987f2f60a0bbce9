"""Resource attacks: each is stopped by its configured limit or timeout, the result says
which, and the sandbox and its other slots keep working.

Each slot's memory defaults to a fair share of its sandbox's. Memory-backed writable
places (``/dev/shm``, and without a layered root ``/tmp``, ``/var/tmp``, ``/run``,
``/home``, ``/root``, ``/mnt``) are tmpfs capped at half the slot's memory each and
charged to its memory cgroup; the disk-backed ones by ``slot_disk`` when set.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from support import bash, layered, processes, settle

from .conftest import MODES
from .helpers import fresh_shell_only, host_can_fork, none_alive, pids_of_uid, slot_owner

PIDS = 32


def enforced(backend, cap: str) -> str:
    """What ``get_status()`` says enforces ``cap`` (``"memory"``, ``"pids"``) here."""
    return str(backend.get_status()["pools"][backend.default_profile]["caps"][cap]["enforced"])


async def test_fork_bomb_hits_the_pids_limit(make_backend):
    backend = await make_backend(pids_limit=PIDS, slot_memory=256)
    pids = enforced(backend, "pids")
    if pids.startswith("none"):  # a normal user's agent without cgroups (rlimit mode)
        pytest.skip(f"no process limit here (caps.pids.enforced: {pids!r}): a fork bomb is not "
                    "bounded on such a host (README, 'What they need'); not run")
    bomb = await backend.acquire("bomb")
    other = await backend.acquire("other")
    owner = await slot_owner(backend, bomb)
    r = await bash(backend, bomb, "bomb() { bomb | bomb & }; bomb; sleep 2; "
                                  "for i in $(seq 64); do sleep 30 & done; exit 1", timeout=4)
    assert r.metadata.get("limits_hit") == ["pids"], (r.error, r.metadata)
    assert "pids_limit" in r.error and "process limit" in r.error
    assert len(owner.pids()) <= PIDS + 2  # its init and bwrap are counted too
    # The other slot and the host still fork.
    r = await bash(backend, other, "for i in 1 2 3; do /bin/true & done; wait; echo ok")
    assert r.output == "ok\n"
    assert host_can_fork()
    before = owner.pids()
    await backend.release(bomb, reset_workspace=True)
    assert await settle(lambda: none_alive(before))
    assert await settle(lambda: fresh_shell_only(owner)), [processes().get(p) for p in owner.pids()]
    again = await backend.acquire("after")
    assert (await bash(backend, again, "echo fresh")).output == "fresh\n"


async def test_memory_bomb_hits_the_slot_memory_limit(make_backend):
    backend = await make_backend(slot_memory=128)
    # A slot cgroup's memory.max (the shell killed, "memory limit" reported) where there
    # are cgroups; RLIMIT_AS per process in the rlimit fallback (a normal user's agent).
    per_process = enforced(backend, "memory").startswith("RLIMIT_AS")
    hog = await backend.acquire("hog")
    other = await backend.acquire("other")
    for cmd in ("python3 -c 'x = bytearray(512 * 1024 * 1024); print(len(x))'",
                "python3 -c 'x = []\nwhile True: x.append(bytearray(16 * 1024 * 1024))'",
                "a=x; while :; do a=$a$a; done"):
        r = await bash(backend, hog, cmd, timeout=20)
        if per_process:  # the documented fallback: the process's own allocation fails
            assert not r.success and any(
                w in r.output for w in ("MemoryError", "cannot allocate")), (cmd, r.error, r.output[-300:])
        else:
            assert not r.success and "memory limit" in r.error, (cmd, r.error)
        assert not r.metadata["timed_out"]
    assert (await bash(backend, hog, "echo recovered")).output == "recovered\n"
    assert (await bash(backend, other, "echo ok")).output == "ok\n"


def kernel_disk(backend) -> bool:
    """Whether the kernel enforces ``slot_disk`` (agent/fs/slotdisk.py) rather than a watch."""
    return enforced(backend, "disk").startswith("kernel")


async def test_tmp_filler_gets_enospc_and_the_host_tmp_is_untouched(mode_backend):
    """Every writable place is capped: memory-backed ones (``/dev/shm``, and ``/tmp`` ...
    without a layered root) by their size, the layered root's disk-backed ones by
    ``slot_disk`` (no file may grow past it). Without bwrap (the sandbox's shared ``/tmp``,
    ``/var/tmp`` and ``/dev/shm``) no file outgrows ``slot_disk`` and the watcher stops
    a command whose files there and in its workspace add up past it."""
    backend = await mode_backend(slot_memory=256, slot_disk=128, slots_per_sandbox=2, max_sandboxes=1)
    slot = await backend.acquire("filler")
    other = await backend.acquire("other")
    nobwrap = mode_backend.mode == "modal-nobwrap"
    token = uuid.uuid4().hex[:12]  # names only this run's slot writes (not the machine's free space)
    for path in ("/tmp", "/var/tmp", "/dev/shm") + (() if nobwrap else ("/run",)):
        name = f"{path}/fill-{token}"
        r = await bash(backend, slot, f"head -c 1G /dev/zero > {name}; echo rc=$?", timeout=90)
        assert not r.metadata["timed_out"], (path, r.output)  # 128 MiB on a loaded machine: slow
        # The disk watch (the documented fallback) may stop the command before the file size
        # limit does; either way the slot is held to slot_disk.
        watched = "disk" in r.metadata.get("limits_hit", [])
        if layered(backend) and path != "/dev/shm" and kernel_disk(backend):  # the layer is full
            assert "No space left on device" in r.output and "rc=1" in r.output, (path, r.output)
        elif watched:
            assert "slot_disk" in r.error, (path, r.output, r.error)
        elif layered(backend) or nobwrap:  # the file size limit (slot_disk) comes first
            assert "File size limit exceeded" in r.output, (path, r.output, r.error)
        else:
            assert "No space left on device" in r.output and "rc=1" in r.output, (path, r.output)
        # What the slot wrote: something (the positive control), and no more than its cap
        # (the watch lets a little more through before it stops the command).
        written = (await bash(backend, slot, f"du -sm {name} | cut -f1")).stdout.strip()
        assert written.isdigit() and 0 < int(written) <= (130 if watched else 128), (path, written, r.error)
        if not nobwrap:  # its own /tmp, /var/tmp, /dev/shm, /run: not the host's
            assert not await asyncio.to_thread(os.path.lexists, name), f"the slot's {name} is on the host"
        r = await bash(backend, slot, f"rm {name} && ! test -e {name} && echo gone")
        assert r.output == "gone\n", (path, r.output, r.error)
    if nobwrap:  # 3 x 60 MiB, each file under the limit, together past it
        r = await bash(backend, slot, "for d in /tmp /var/tmp /dev/shm; do head -c 60M /dev/zero > $d/part-$$; "
                                      "done; sleep 3; echo never", timeout=20)
        assert "disk" in r.metadata.get("limits_hit", []) and "slot_disk" in r.error, (r.output, r.error)
        assert "never" not in r.output
        assert (await bash(backend, slot, "rm -f /tmp/part-* /var/tmp/part-* /dev/shm/part-*; echo ok")).output == "ok\n"
    assert (await bash(backend, slot, "echo alive")).output == "alive\n"
    assert (await bash(backend, other, "echo ok")).output == "ok\n"


async def test_output_flood_is_capped_and_others_keep_working(make_backend):
    backend = await make_backend(output_limit=2000)
    flood = await backend.acquire("flood")
    other = await backend.acquire("other")
    results = await backend.execute_batch([
        (flood, "bash", {"command": "yes 'flood flood flood' | head -c 1G; echo; echo tail-end",
                         "timeout": 60}),
        (other, "bash", {"command": "for i in $(seq 200); do echo line$i; done", "timeout": 60}),
    ])
    r, o = results
    assert r.success and r.metadata["truncated"]
    assert len(r.output) < 2200 and r.output.endswith("tail-end\n") and "truncated" in r.output
    assert o.output == "".join(f"line{i}\n" for i in range(1, 201)) and not o.metadata["truncated"]
    # An endless flood stops at the timeout.
    r = await bash(backend, flood, "yes", timeout=2)
    assert r.metadata["timed_out"] and "timed out after 2s" in r.error and len(r.output) < 2200
    assert (await bash(backend, flood, "echo after")).output == "after\n"


async def test_command_that_never_reads_stdin_or_waits_for_input(backend, slot):
    big = "x" * (5 * 1024 * 1024)
    r = await bash(backend, slot, "sleep 0.1; echo done", stdin=big)
    assert r.output == "done\n"
    r = await bash(backend, slot, "read -r line; echo \"got:$line\"; cat; echo eof")
    assert r.output == "got:\neof\n"  # stdin is /dev/null: no command can wait on it
    r = await bash(backend, slot, "python3 -c 'import sys; print(len(sys.stdin.read()))'")
    assert r.output == "0\n"
    # No controlling terminal: a read of /dev/tty fails at once (ENXIO), never waits.
    r = await bash(backend, slot, "cat < /dev/tty 2>&1; echo rc=$?", timeout=5)
    assert not r.metadata["timed_out"] and r.output.endswith("rc=1\n"), r.output
    # Positive control: a process given a terminal (a PTY session) does read /dev/tty.
    proc = await backend.start_process(slot, "head -n1 < /dev/tty | tr a-z A-Z; echo rc=$?")
    await proc.write("typed\n")
    assert b"TYPED" in await proc.read_until(b"rc=0")
    assert await proc.wait(timeout_s=20) == 0


async def test_busy_loops_stop_at_the_timeout(backend, two_slots):
    a, b = two_slots
    owner = await slot_owner(backend, b)
    for cmd in ("while :; do :; done", "python3 -c 'while True: pass'",
                "trap '' TERM INT; python3 -c 'import signal\nsignal.signal(15, signal.SIG_IGN)\nwhile 1: pass'",
                "sh -c 'while :; do :; done' & sh -c 'while :; do :; done'"):
        r, other = await backend.execute_batch([(b, "bash", {"command": cmd, "timeout": 1}),
                                                (a, "bash", {"command": "cat secret.txt"})])
        assert r.metadata["timed_out"] and r.metadata["returncode"] == 124, cmd
        assert "timed out after 1s" in r.error
        assert other.output == "victim-secret\n"

        def spinning() -> list:
            procs = processes()
            return [procs[p].comm for p in owner.pids()
                    if p in procs and procs[p].comm in ("python3", "sh")]

        assert await settle(lambda: not spinning()), spinning()
    assert (await bash(backend, b, "echo responsive")).output.endswith("responsive\n")


#: Every tmpfs a slot sees (its memory-backed places), each counted once and only its
#: own part (``du -x``); a bind of one directory of a tmpfs counts that directory only.
TMPFS_USED = ("du -smxc $(awk '{for (i = 7; i <= NF; i++) if ($i == \"-\") {if ($(i + 1) == "
              "\"tmpfs\") print $5; break}}' /proc/self/mountinfo | sort -u) 2>/dev/null | tail -1")


#: What the slot running it owns in the sandbox's shared memory-backed places (MiB):
#: without bwrap, where slots share ``/dev/shm`` (a tmpfs on Modal).
OWNED_IN_SHM = ("find /dev/shm -xdev -user $(id -u) -printf '%b\\n' 2>/dev/null "
                "| awk '{s += $1} END {print int(s * 512 / 1048576)}'")


@pytest.mark.parametrize("filesystem", ["auto", "workspace-only"])
async def test_default_slot_memory_is_a_fair_share(mode_backend, filesystem):
    """``memory=512`` for two slots and no ``slot_memory``: a slot that fills every
    writable place it has (and tries to mount a tmpfs of its own) holds at most its
    share in memory-backed places (measured in the slot, over every tmpfs it sees), so
    its neighbour's allocation succeeds; status says how that is enforced. Without
    cgroups (Modal) one capped tmpfs per slot holds all its places, and a slot with a
    layered root cannot mount. Without bwrap (no mount namespace) slots write to the
    sandbox's shared ``/tmp``, ``/var/tmp`` and ``/dev/shm``: what a slot owns in the
    memory-backed ones (``/dev/shm``) is watched against its share; past it its
    processes are stopped and those files removed, the result says so, and the
    neighbour can still write its own share there; a release removes what it left."""
    backend = await mode_backend(memory=512, slots_per_sandbox=2, max_sandboxes=1,
                                 filesystem=filesystem)
    pool = backend.get_status()["pools"][backend.default_profile]
    caps = pool["caps"]
    assert caps["memory"]["mib"] == 256, caps
    enforced = caps["tmpfs"]["enforced"]
    nobwrap = mode_backend.mode == "modal-nobwrap"
    if nobwrap:
        assert enforced.startswith("watched: ") and "memory / slots_per_sandbox" in enforced, caps
        assert caps["tmpfs"]["places"] == ["/dev/shm"] and caps["tmpfs"]["mib"] == 256, caps
    elif pool["limits"] == "rlimit":  # Modal: no cgroups in its containers
        assert ("one size-capped tmpfs per slot" in enforced if pool["filesystem"] == "workspace-only"
                else "cannot mount" in enforced), caps
    else:
        assert "memory cgroup" in enforced, caps
    hog, neighbour = await backend.acquire("hog"), await backend.acquire("neighbour")
    places = " ".join(caps["tmpfs"]["places"] + ["/dev", "/data", "/tmp", "/var/tmp", "/dev/shm"])
    fill = (f"for d in {places}; do head -c 400M /dev/zero > $d/fill-$$ 2>/dev/null; done; "
            "mkdir -p extra && mount -t tmpfs -o size=1g none extra 2>/dev/null && "
            "head -c 400M /dev/zero > extra/fill 2>/dev/null; echo filled")
    r = await bash(backend, hog, fill, timeout=60)
    if nobwrap:  # stopped at its share of the sandbox's /dev/shm, and told so
        assert "memory limit" in r.error and "/dev/shm" in r.error and "256 MiB" in r.error, r.error
        assert "memory / slots_per_sandbox" in r.error and "filled" not in r.output, r.output
        assert "memory" in r.metadata["limits_hit"], r.metadata
    else:
        assert r.output.endswith("filled\n") or "memory limit" in (r.error or ""), (r.output, r.error)
    r = await bash(backend, neighbour, "python3 -c 'x = bytearray(150 * 1024 * 1024); "
                                       "x[::4096] = b\"y\" * len(x[::4096]); print(len(x))'", timeout=60)
    assert r.success and r.output == f"{150 * 1024 * 1024}\n", (r.output, r.error)
    if nobwrap:
        used = await bash(backend, hog, OWNED_IN_SHM)
        r = await bash(backend, neighbour, "head -c 200M /dev/zero > /dev/shm/mine && "
                                           "du -m /dev/shm/mine | cut -f1; rm -f /dev/shm/mine")
        assert r.output == "200\n", (r.output, r.error)
    else:
        used = await bash(backend, hog, TMPFS_USED)
    assert used.success and int(used.output.split()[0]) <= 256, used.output
    if nobwrap:  # what it left in the shared places goes with it
        await backend.release(hog, reset_workspace=True)
        left = [p for p in ("/tmp", "/var/tmp", "/dev/shm")
                if any(mode_backend.view.host_path(backend, p).glob("fill-*"))]
        assert not left, left


#: A process of the slot that outlives its command and fills ``/dev/shm`` a second later:
#: a file, or one deleted while still open (no walk of the directories sees it).
LATE_FILLERS = {
    "file": "head -c 400M /dev/zero > /dev/shm/bg",
    "deleted-open": "exec 3> /dev/shm/bg; rm /dev/shm/bg; head -c 400M /dev/zero >&3",
}


@pytest.mark.parametrize("filler", list(LATE_FILLERS))
async def test_a_process_filling_dev_shm_after_its_command_returned_is_held(mode_backend, filler):
    """A slot's process that outlives its command (``setsid``) and fills ``/dev/shm``
    later cannot take its neighbour's memory: with bwrap it fills its own capped tmpfs;
    without (the sandbox's shared ``/dev/shm``) the watch, which runs while the slot is
    in use, stops it past its share, removes its files and the slot's next result says
    so. The neighbour can still write its own share there."""
    backend = await mode_backend(memory=512, slots_per_sandbox=2, max_sandboxes=1)
    caps = backend.get_status()["pools"][backend.default_profile]["caps"]
    nobwrap = mode_backend.mode == "modal-nobwrap"
    hog, neighbour = await backend.acquire("hog"), await backend.acquire("neighbour")
    r = await bash(backend, hog, f"setsid -f sh -c 'sleep 1; {LATE_FILLERS[filler]}; sleep 120' "
                                 "> /dev/null 2>&1; echo started")
    assert r.output == "started\n", (r.output, r.error)
    if nobwrap:  # the filler runs, then the watch ends it (and, a file, removes it)
        uid = int((await bash(backend, hog, "id -u")).output)  # no user namespace here

        def filler_alive() -> bool:
            procs = processes()
            return any(b"sleep 120" in procs[p].cmdline for p in pids_of_uid(uid) if p in procs)

        assert await settle(filler_alive, 5)
        assert await settle(lambda: not filler_alive(), 15)
        # the purge removes the files once the killed processes are gone: a moment later
        bg = mode_backend.view.host_path(backend, "/dev/shm") / "bg"
        assert await settle(lambda: not bg.exists(), 5)
    else:
        await asyncio.sleep(3.5)
    own = 200 if nobwrap else caps["tmpfs"]["mib"] - 16
    r = await bash(backend, neighbour, f"head -c {own}M /dev/zero > /dev/shm/mine && "
                                       "du -m /dev/shm/mine | cut -f1; rm -f /dev/shm/mine")
    assert r.output == f"{own}\n", (r.output, r.error)
    r = await bash(backend, hog, "pgrep -u $(id -u) -f 'sleep 120' >/dev/null || echo gone; " + OWNED_IN_SHM)
    if nobwrap:
        assert "memory limit" in r.error and "after its command had returned" in r.error, r.error
        assert ("(deleted, still open)" in r.error) == (filler == "deleted-open"), r.error
        assert "memory" in r.metadata["limits_hit"] and r.output.split() == ["gone", "0"], r.output
    else:
        assert r.success and int(r.output.split()[-1]) <= caps["tmpfs"]["mib"], (r.output, r.error)
    assert (await bash(backend, hog, "echo alive")).output == "alive\n"


#: Shared memory on no place: a memfd, and System V segments (each touched, then detached:
#: they stay resident, and the address-space rlimit bounds only what is attached).
OFF_PLACE_FILLERS = {
    "memfd": ("python3 -c \"import os, time; fd = os.memfd_create(str(1)); "
              "[os.write(fd, bytes(1 << 20)) for _ in range(400)]; time.sleep(300)\""),
    "System V shared memory": (
        "python3 -c \"import ctypes, time; l = ctypes.CDLL(None); l.shmat.restype = ctypes.c_void_p; "
        "touch = lambda a: (ctypes.memset(a, 1, 100 << 20), l.shmdt(ctypes.c_void_p(a))); "
        "[touch(l.shmat(l.shmget(0, 100 << 20, 0o1600), None, 0)) for _ in range(4)]; "
        "time.sleep(300)\""),
}


@pytest.mark.parametrize("filler", list(OFF_PLACE_FILLERS))
async def test_shared_memory_on_no_place_counts_against_the_share_without_bwrap(
        request, make_backend, filler):
    """Without bwrap (Modal), slots share the sandbox's IPC namespace and shared memory:
    a slot's background process that fills a ``memfd`` or System V segments past its
    share (on no place the file walk sees) is stopped by the watch, its segments (which
    outlive processes) are removed, and its next result names what it held. Checked
    from the neighbour, in the same IPC namespace: none of the hog's segments is left."""
    request.getfixturevalue("modal_server")
    backend = await make_backend(memory=512, slots_per_sandbox=2, max_sandboxes=1,
                                 **MODES["modal-nobwrap"])
    hog, neighbour = await backend.acquire("hog"), await backend.acquire("neighbour")
    uid = int((await bash(backend, hog, "id -u")).output)
    r = await bash(backend, hog, f"setsid -f sh -c 'sleep 1; {OFF_PLACE_FILLERS[filler]}; "
                                 "sleep 120' > /dev/null 2>&1; echo started")
    assert r.output == "started\n", (r.output, r.error)

    def filler_alive() -> bool:
        procs = processes()
        return any(b"sleep 120" in procs[p].cmdline for p in pids_of_uid(uid) if p in procs)

    assert await settle(filler_alive, 5)
    assert await settle(lambda: not filler_alive(), 20)

    async def hogs_segments() -> str:
        table = await bash(backend, neighbour, "cat /proc/sysvipc/shm")
        assert table.success, table
        return "".join(line + "\n" for line in table.output.splitlines()[1:]
                       if str(uid) in line.split()[7:10:2])  # its uid or cuid

    for _ in range(100):  # its processes are stopped first, then its segments removed
        left = await hogs_segments()
        if not left:
            break
        await asyncio.sleep(0.05)
    assert not left, left
    r = await bash(backend, hog, "echo alive")
    assert "memory limit" in r.error and filler in r.error, r.error
    assert "memory" in r.metadata["limits_hit"] and r.output == "alive\n", (r.output, r.error)
