"""Round two of the attack suite: control files, keyrings and names (checked on the victim's
side: what a slot can read or change of another slot, of the agent or of the host)."""

from __future__ import annotations

import ctypes
import os
import platform
import secrets
import stat
from pathlib import Path

import pytest
from support import SMALL, bash, layered, processes

from .helpers import call, killed, none_alive, victim_state

SYS_ADD_KEY = {"x86_64": 248, "aarch64": 217}.get(platform.machine())
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())
KEY_SPEC_SESSION_KEYRING = -3
# In a slot: add a key to its session keyring (argv[1] = its payload), or, without an
# argument, print the payload of every key its session keyring holds (keyctl read @s).
KEYS_PY = r"""
import ctypes, struct, sys
libc = ctypes.CDLL(None); libc.syscall.restype = ctypes.c_long
if len(sys.argv) > 1:
    p = sys.argv[1].encode()
    print("added", libc.syscall(ADD_KEY, b"user", b"hmt-slot-key", p, len(p), -3) > 0)
buf = ctypes.create_string_buffer(65536)
n = libc.syscall(KEYCTL, 11, -3, buf, 65536)
ids = struct.unpack("%di" % (n // 4), buf.raw[:n]) if n > 0 else ()
for k in ids:
    m = libc.syscall(KEYCTL, 11, k, buf, 65536)
    print("payload", buf.raw[:m] if m > 0 else m)
"""


def host_add_session_key(description: str, payload: bytes) -> int:
    """Add a ``user`` key to this (the backend's) process's session keyring."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    serial = libc.syscall(SYS_ADD_KEY, b"user", description.encode(), payload, len(payload),
                          KEY_SPEC_SESSION_KEYRING)
    if serial < 0:
        pytest.skip(f"cannot add a key here: {os.strerror(ctypes.get_errno())}")
    return serial


@pytest.mark.skipif(SYS_KEYCTL is None, reason="keyctl numbers unknown on this machine")
async def test_slots_get_their_own_session_keyring(mode_backend):
    """bwrap makes no session keyring: without one of its own, a slot reads (and can
    revoke) the keys of the session that started the backend, and other slots' keys."""
    host_payload = "host-secret-" + secrets.token_hex(4)
    host_add_session_key("hmt-host-key", host_payload.encode())
    backend = await mode_backend(**SMALL)  # its agent inherits this process's session keyring
    a = await backend.acquire("victim")
    b = await backend.acquire("attacker")
    script = KEYS_PY.replace("ADD_KEY", str(SYS_ADD_KEY)).replace("KEYCTL", str(SYS_KEYCTL))
    await call(backend, a, "write_file", path="keys.py", content=script)
    await call(backend, b, "write_file", path="keys.py", content=script)
    slot_payload = "slot-secret-" + secrets.token_hex(4)
    r = await bash(backend, a, f"python3 keys.py {slot_payload}")
    assert r.output.splitlines()[0] == "added True", r.output
    assert slot_payload in r.output and host_payload not in r.output  # its own key only
    r = await bash(backend, b, "python3 keys.py")
    assert slot_payload not in r.output and host_payload not in r.output, r.output


async def test_control_files_are_not_the_slots_to_change_or_others_to_read(mode_backend):
    """The agent's control directory of a slot is root's (the slot cannot write it, so it
    cannot plant a link the agent would follow); its files are readable by that slot's
    group only, never by other local users. Checked on the host, in every mode (without
    bwrap the slot sees the directory at its real path, not read-only-mounted)."""
    backend = await mode_backend(**{**SMALL, "max_sandboxes": 1})
    a, b = await backend.acquire("victim"), await backend.acquire("attacker")
    assert (await bash(backend, a, "echo victim-secret > secret.txt; mkdir d; echo x > d/f")).success
    assert (await bash(backend, b, "echo marker-b")).output == "marker-b\n"
    dirs = mode_backend.view.ctl_dirs(backend, b)
    assert dirs, "the attacker's control directory was not found on the host"

    def look() -> list:
        out = []
        for d in dirs:
            st = d.lstat()
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid(), (d, st)
            assert not st.st_mode & 0o022 and not st.st_mode & 0o007, oct(st.st_mode)
            for f in d.iterdir():
                fst = f.lstat()
                assert stat.S_ISREG(fst.st_mode) and not fst.st_mode & 0o007, (f, oct(fst.st_mode))
            out.append((st.st_mode, st.st_uid, st.st_gid, sorted(p.name for p in d.iterdir())))
        return out

    before = look()
    ctl = ("/run/hmt" if mode_backend.mode != "modal-nobwrap"
           else mode_backend.view.in_sandbox(backend, dirs[0]))
    r = await bash(backend, b, f"ls -ld {ctl}; touch {ctl}/x 2>&1; ln -sf /etc/passwd {ctl}/cmd 2>&1; "
                               f"ln -s /etc/passwd {ctl}/planted 2>&1; chmod 777 {ctl} 2>&1; echo done")
    assert r.output.rstrip().endswith("done") and "marker" not in r.output, r.output
    assert look() == before  # same owner, mode and entries; no file became a link
    assert (await bash(backend, b, "echo still-works")).output == "still-works\n"
    assert look() == before
    assert await victim_state(backend, a) == ["victim-secret", "d", "secret.txt", "x"]


async def test_names_that_are_not_utf8_come_back_printable(mode_backend):
    backend = await mode_backend(**SMALL)
    slot = await backend.acquire("odd-names")
    r = await bash(backend, slot, "touch \"$(printf 'report\\377\\376.txt')\" plain.txt; ls | wc -l")
    assert r.output.strip() == "2"
    for tool in ("list_files", "list_artifacts"):
        r = await call(backend, slot, tool)
        assert r.success, r.error
        r.output.encode("utf-8")  # valid UTF-8: printable, JSON-safe
        assert "report\\xff\\xfe.txt" in r.output and "plain.txt" in r.output
        details = r.metadata["entries"] if tool == "list_files" else r.metadata["details"]
        [odd] = [e for e in details if "raw_path" in e]
        import base64

        assert base64.b64decode(odd["raw_path"]) == b"report\xff\xfe.txt"


def agent_pids() -> list[int]:
    """This test's agents: agent processes among this process's descendants (on Modal
    the local control plane's container, a bwrap, is the agent's parent), not bwrap and
    not an agent's spawner (a fork of the agent: agent/shells/spawner.py)."""
    procs = processes()
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found, todo = [], [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            parent = procs.get(procs[pid].ppid)
            if (procs[pid].is_agent and not procs[pid].is_bwrap and procs[pid].comm.startswith("python")
                    and not (parent and parent.cmdline == procs[pid].cmdline)):  # not its spawner
                found.append(pid)
    return found


def agent_hwm_kib() -> int:
    """Peak resident memory (VmHWM, KiB) of this test's agents (one backend: one agent)."""
    best = 0
    for pid in agent_pids():
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("VmHWM:"):
                best = max(best, int(line.split()[1]))
    return best


async def test_per_call_buffers_are_bounded(mode_backend):
    """read_file(limit=1) of 64 MiB of short lines, a forged marker prefix followed by a
    flood, and read_artifact of 40 MB: the agent's peak memory grows by far less than what
    the slot made it handle; each result is capped; the neighbour still answers."""
    backend = await mode_backend(output_limit=5000)
    hog = await backend.acquire("hog")
    other = await backend.acquire("other")
    r = await bash(backend, hog, "yes | head -c 64M > lines; head -c 40M /dev/zero | tr '\\0' a > big; echo ok",
                   timeout=120)
    assert r.output == "ok\n", r.output
    assert len(agent_pids()) == 1, agent_pids()
    before = agent_hwm_kib()
    assert before > 10 * 1024, before  # a Python agent, not a bwrap
    r = await call(backend, hog, "read_file", path="lines", limit=1)
    assert r.success and r.output == "y\n" and r.metadata["total_lines"] == 32 * 1024 * 1024
    r = await call(backend, hog, "read_file", path="lines", offset=1000, limit=3)
    assert r.output == "y\ny\ny\n" and r.metadata["first_line"] == 1000
    art = await backend.read_artifact(hog, "big")
    assert art["success"] and len(art["content"]) == 5000 and art["truncated"]
    r = await bash(backend, hog, "printf '\\036%s ' \"${__hmt_h:0:8}\"; head -c 200M /dev/zero; echo end", timeout=120)
    assert r.metadata["truncated"] and len(r.output) < 6000
    grown_mib = (agent_hwm_kib() - before) / 1024
    assert grown_mib < 48, f"the agent grew by {grown_mib:.0f} MiB"
    assert (await bash(backend, other, "echo alive")).output == "alive\n"


def deep_tree(root: Path, depth: int) -> None:
    """A chain of ``depth`` directories below ``root`` (made through directory fds: no path
    is ever longer than one name)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as fh:
            fh.write("bottom")
    finally:
        os.close(fd)


async def test_deep_and_wide_trees_are_removed_by_the_host_and_the_agent(tmp_path):
    """A slot can leave a tree 100,000 levels deep or 25,000 directories wide. Removing it
    (the agent's wipes, and the host's own cleanup after a crash) needs no recursion and no
    open file per level: it works under a limit of 64 open files. (The two big trees are
    made in ``/dev/shm`` when it is there: on disk their 250,000 mkdirs and rmdirs alone
    take a minute or more of a busy machine's I/O and prove nothing more.)"""
    import asyncio
    import tempfile

    from hermes_modal_tool.agent.fs.trees import remove_tree

    base = Path(tempfile.mkdtemp(prefix="hmt-trees-", dir="/dev/shm")) if os.access(
        "/dev/shm", os.W_OK) else tmp_path
    try:
        await removed_without_recursion(base)
    finally:
        if base != tmp_path:
            await asyncio.to_thread(remove_tree, str(base))


async def removed_without_recursion(base: Path) -> None:
    import asyncio
    import resource

    from hermes_modal_tool.agent.fs.trees import remove_tree
    from hermes_modal_tool.drivers.local import LocalDriver

    deep, wide = base / "deep", base / "wide"
    deep.mkdir()
    wide.mkdir()
    await asyncio.to_thread(deep_tree, deep, 100_000)
    for i in range(25_000):
        (wide / str(i) / "x").mkdir(parents=True)
    driver = LocalDriver()
    await asyncio.to_thread(deep_tree, driver.state_root, 20_000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        await asyncio.to_thread(remove_tree, str(deep))
        await asyncio.to_thread(remove_tree, str(wide))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    await driver.aclose()  # the host's cleanup of a sandbox's state (shutil.rmtree failed)
    assert not deep.exists() and not wide.exists() and not driver.state_root.exists()


async def test_nothing_a_tenant_started_outlives_its_release(mode_backend):
    """A double-forked ``setsid`` process (a new session, so not in the shell's) and files
    in shared ``/tmp`` do not reach the slot's next tenant, in every mode: without bwrap
    (Modal) every process of the slot's uid is ended and what it owns in ``/tmp``,
    ``/var/tmp`` and ``/dev/shm`` removed."""
    backend = await mode_backend(**{**SMALL, "slots_per_sandbox": 1, "max_sandboxes": 1})
    tag = secrets.token_hex(6)
    first = await backend.acquire("first")
    r = await bash(backend, first, f"(setsid bash -c 'exec -a hmt-escapee-{tag} sleep 600' "
                                   f"</dev/null >/dev/null 2>&1 &); echo left > /tmp/hmt-left-{tag}; "
                                   f"mkdir /dev/shm/hmt-dir-{tag} && echo x > /dev/shm/hmt-dir-{tag}/f; "
                                   "sleep 0.5; echo started")
    assert r.output == "started\n", (r.output, r.error)
    escapee = [p for p, proc in processes().items() if f"hmt-escapee-{tag}".encode() in proc.cmdline]
    assert escapee, "the escapee never ran"
    await backend.release(first, reset_workspace=True)
    assert killed(escapee)  # gone, or on its way with SIGKILL: it runs nothing more
    second = await backend.acquire("second")
    assert second.slot_id == first.slot_id
    r = await bash(backend, second, f"ls /tmp/hmt-left-{tag} /dev/shm/hmt-dir-{tag} 2>&1; "
                                    f"pgrep -f hmt-escapee-{tag}; echo end")
    assert none_alive(escapee)  # the next tenant's first command ran after it was gone
    lines = r.output.splitlines()  # two misses and no pid from pgrep
    assert len(lines) == 3 and all("No such file" in line for line in lines[:2]), r.output
    assert lines[2] == "end", r.output


#: Python in the slot: make a System V segment with key ``KEY``, write ``TEXT`` into it.
SYSV_LEAVE = ("import ctypes; l = ctypes.CDLL(None); l.shmat.restype = ctypes.c_void_p; "
              "i = l.shmget(KEY, 4096, 0o1600); a = l.shmat(i, None, 0); "
              "ctypes.memmove(a, TEXT, len(TEXT)); print(i >= 0)")
#: ... and in the next tenant: read it back if it is still there.
SYSV_FIND = ("import ctypes; l = ctypes.CDLL(None); l.shmat.restype = ctypes.c_void_p; "
             "i = l.shmget(KEY, 0, 0); print('gone' if i < 0 else "
             "ctypes.string_at(l.shmat(i, None, 0), 16))")


async def test_system_v_ipc_of_a_tenant_does_not_reach_the_next_one(mode_backend):
    """A System V shared memory segment left by a tenant (with bubblewrap, in its own IPC
    namespace; without, in the sandbox's) is gone for the slot's next tenant, who runs
    as the same uid: a release removes the uid's System V objects."""
    backend = await mode_backend(**{**SMALL, "slots_per_sandbox": 1, "max_sandboxes": 1})
    key, text = 0x48D0 + secrets.randbelow(1000), f"hmt-{secrets.token_hex(4)}"
    first = await backend.acquire("first")
    leave = SYSV_LEAVE.replace("KEY", str(key)).replace("TEXT", repr(text.encode()))
    r = await bash(backend, first, f"python3 -c \"{leave}\"")
    assert r.output == "True\n", (r.output, r.error)
    await backend.release(first, reset_workspace=True)
    second = await backend.acquire("second")
    assert second.slot_id == first.slot_id
    r = await bash(backend, second, f"python3 -c \"{SYSV_FIND.replace('KEY', str(key))}\"")
    assert r.success and r.output == "gone\n", (r.output, r.error)


async def test_disk_measurement_never_follows_a_link_the_slot_swaps_in(mode_backend):
    """The agent measures a slot's layer while its command runs (``slot_disk``), with
    directory descriptors that never follow a link (``trees.walk_tree``). A slot that
    keeps swapping a directory of its layer for a symlink to ``/`` gets no false stop.
    (A path-based walk could be steered into the host's tree only in a narrow window
    between listing a directory and entering it, so this cannot force the old flaw; it
    checks that the walk holds up while the layer changes under it.)"""
    backend = await mode_backend(**SMALL, slot_disk=64, disk_limit="watch")
    disk = backend.get_status()["pools"][backend.default_profile]["caps"]["disk"]
    watched = layered(backend) or mode_backend.mode == "modal-nobwrap"  # its layer, or its uid's files
    assert disk["enforced"] == ("watched" if watched else "none"), disk
    slot = await backend.acquire("swapper")
    swap = ("mkdir -p d/e/f; end=$((SECONDS + 4)); while [ $SECONDS -lt $end ]; do "
            "mv d d.real; ln -s / d; rm d; mv d.real d; done; du -sm d | cut -f1")
    r = await bash(backend, slot, swap, timeout=30)
    assert r.success and "disk" not in (r.error or ""), (r.output, r.error, r.metadata)
    assert "limits_hit" not in r.metadata, r.metadata
