"""Nothing leaks between slots, or from the host into a slot.

Each slot runs in its own namespaces as its own uid: it sees only its own
workspace, its own processes, an empty home, no host environment, and (with
``network=False``) only loopback. Network checks only read interfaces or connect
to a documentation address with no route; no traffic leaves the machine.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest
from support import bash, layered, slot_host_process

from hermes_modal_tool import ExecutionResult


async def call(backend, slot, tool, **args) -> ExecutionResult:
    [result] = await backend.execute_batch([(slot, tool, args)])
    return result


@pytest.fixture
async def two_slots(backend):
    """Two slots of the same sandbox, with a secret file in the first."""
    a = await backend.acquire("traj-a")
    b = await backend.acquire("traj-b")
    assert a.sandbox_id == b.sandbox_id and a.workspace_dir != b.workspace_dir
    r = await bash(backend, a, "echo top-secret > secret.txt; mkdir d; echo x > d/f")
    assert r.success
    return a, b


# -- slot against slot -----------------------------------------------------------------

async def test_slot_sees_only_its_own_workspace(backend, two_slots):
    a, b = two_slots
    r = await bash(backend, b, "ls -A /data")
    assert r.output.split() == [Path(b.workspace_dir).name]


async def test_slot_cannot_read_another_slots_files(backend, two_slots):
    a, b = two_slots
    attempts = [
        f"cat {a.workspace_dir}/secret.txt",
        f"cat ../{Path(a.workspace_dir).name}/secret.txt",
        f"ln -s {a.workspace_dir}/secret.txt link && cat link",
        f"ln -s ../{Path(a.workspace_dir).name} dirlink && cat dirlink/secret.txt",
        f"cd / && cat .{a.workspace_dir}/secret.txt",
        "cat /proc/*/root/data/*/secret.txt",
        "find / -name secret.txt -xdev -exec cat {} + 2>/dev/null",
    ]
    for cmd in attempts:
        r = await bash(backend, b, cmd + " 2>&1")
        assert "top-secret" not in r.output, cmd


async def test_slot_cannot_write_another_slots_files(backend, two_slots):
    a, b = two_slots
    for cmd in (f"echo pwned > {a.workspace_dir}/secret.txt",
                f"echo pwned > {a.workspace_dir}/new.txt",
                f"mkdir -p {a.workspace_dir} && echo pwned > {a.workspace_dir}/new.txt",
                f"rm -rf {a.workspace_dir}/d"):
        await bash(backend, b, cmd)
    r = await bash(backend, a, "cat secret.txt; ls -A")
    assert r.output.split() == ["top-secret", "d", "secret.txt"]


async def test_file_tools_see_only_the_slots_own_view(backend, two_slots):
    """File tools resolve paths in the slot's own root: absolute paths work, and nothing of
    another slot (or of the host beyond the slot's copy-on-write view) is reachable."""
    a, b = two_slots
    other = a.workspace_dir
    await bash(backend, b, f"ln -s {other}/secret.txt abs_link; ln -s ../../etc/passwd rel_link; "
                           f"ln -s /etc etc_dir; ln -s {other} other_dir; ln -s inside ok_link; "
                           f"echo mine > inside")
    refused = [
        ("read_file", {"path": f"{other}/secret.txt"}),
        ("read_file", {"path": "../" + Path(other).name + "/secret.txt"}),
        ("read_file", {"path": "abs_link"}),
        ("read_file", {"path": "other_dir/secret.txt"}),
        ("read_artifact", {"path": "abs_link"}),
        ("list_files", {"path": other}),
        ("archive_artifacts", {"path": "other_dir"}),
        ("write_file", {"path": "other_dir/x.txt", "content": "pwned"}),  # b's own copy
    ]
    results = await backend.execute_batch([(b, tool, args) for tool, args in refused])
    for (tool, args), r in zip(refused, results, strict=True):
        assert "top-secret" not in r.output and "secret.txt" not in r.output, (tool, args)
        if tool != "write_file":
            assert not r.success, (tool, args, r.output[:200])
    # The slot's own root: absolute paths, links inside it, writes anywhere in it.
    own = [("read_file", {"path": "/etc/passwd"}), ("read_file", {"path": "rel_link"}),
           ("read_file", {"path": "etc_dir/passwd"}), ("list_files", {"path": "/"}),
           ("write_file", {"path": "etc_dir/pwned", "content": "mine"}),
           ("write_file", {"path": "../x.txt", "content": "mine"}),
           ("read_file", {"path": "ok_link"})]
    results = await backend.execute_batch([(b, tool, args) for tool, args in own])
    for (tool, args), r in zip(own, results, strict=True):
        assert r.success, (tool, args, r.error)
    assert results[0].output.startswith("root:") and results[-1].output == "mine\n"
    assert results[5].metadata["path"] == str(Path(b.workspace_dir).parent / "x.txt")
    # Nothing of it reached the host or the other slot.
    assert not host_has("/etc/pwned")
    r = await bash(backend, a, "cat secret.txt; ls -A; ls /etc/pwned 2>&1; ls /data")
    assert r.output.split()[:3] == ["top-secret", "d", "secret.txt"]
    assert "No such file" in r.output and "x.txt" not in r.output


async def test_slots_run_as_different_users(backend, two_slots):
    a, b = two_slots
    # Root inside each slot, mapped to a different unprivileged uid outside (as the host
    # sees the slots' processes: their /proc/self/uid_map names the parent namespace's).
    # Without a layered root (workspace-only) a slot is its host uid inside too. A normal
    # user's agent has one uid to give (README, "What they need"): there every slot runs
    # as that user, each in a pid namespace of its own.
    ra, rb = await backend.execute_batch([(a, "bash", {"command": "id -u"}),
                                          (b, "bash", {"command": "id -u"})])
    (uida, nsa), (uidb, nsb) = await slot_host_process(backend, a), await slot_host_process(backend, b)
    assert nsa != nsb
    if os.geteuid() != 0:
        assert uida == uidb == os.geteuid() and (ra.output, rb.output) == (f"{uida}\n", f"{uidb}\n")
        return
    assert uida != uidb and 0 not in (uida, uidb)
    if layered(backend):
        assert ra.output == rb.output == "0\n"
    else:
        assert (ra.output, rb.output) == (f"{uida}\n", f"{uidb}\n")


async def test_slots_have_private_tmp(backend, two_slots):
    a, b = two_slots
    r = await bash(backend, a, "echo a-tmp > /tmp/shared-name; echo a-shm > /dev/shm/shm-name; "
                               "cat /tmp/shared-name /dev/shm/shm-name")
    assert r.output == "a-tmp\na-shm\n", r.output  # positive control: the write worked
    r = await bash(backend, b, "cat /tmp/shared-name /dev/shm/shm-name 2>&1; ls -A /tmp /dev/shm")
    assert "a-tmp" not in r.output and "a-shm" not in r.output and "-name" not in r.output.replace(
        "/tmp/shared-name", "").replace("/dev/shm/shm-name", ""), r.output


async def test_slot_sees_only_its_own_processes(backend, two_slots):
    a, b = two_slots
    r = await bash(backend, a, "sleep 30", background=True)
    assert r.success
    r = await bash(backend, b, "ps -eo args=")
    assert "sleep" not in r.output
    assert "hermes_modal_tool" not in r.output  # not the agent either
    r = await bash(backend, b, "ls /proc | grep -c '^[0-9]'")
    assert int(r.output) <= 4, r.output  # init, bash, the pipeline
    await bash(backend, b, "pkill -f 'sleep 30'; kill -9 -1; echo done")
    r = await bash(backend, a, "ps -eo args=")
    assert "sleep 30" in r.output


async def test_slot_cannot_see_host_processes(backend, slot):
    r = await bash(backend, slot, "ps -eo pid=,args=")
    lines = r.output.strip().splitlines()
    assert len(lines) <= 4, r.output
    assert str(os.getpid()) not in [line.split()[0] for line in lines]
    assert "pytest" not in r.output


async def test_another_backend_does_not_touch_this_backends_slots(make_backend):
    """Two backends on one machine (two training runs): one's resets and stop must
    not touch the other's slots, even when their profiles have the same name."""
    first = await make_backend()
    second = await make_backend()
    s1 = await first.acquire("run-1")
    s2 = await second.acquire("run-2")
    assert s1.workspace_dir == s2.workspace_dir  # same slot number in each
    long_call = asyncio.ensure_future(bash(first, s1, "sleep 3; echo survived", timeout=10))
    await asyncio.sleep(0.5)
    assert (await bash(second, s2, "echo hi")).success
    await second.release(s2, reset_workspace=True)
    await second.stop()
    r = await long_call
    assert r.success and r.output == "survived\n", (r.error, r.output)
    assert (await bash(first, s1, "echo still")).output == "still\n"


# -- host against slot -------------------------------------------------------------------

@pytest.fixture
def home_canary():
    """A canary file in the host's home directory (and in /root); returns its content."""
    token = secrets.token_hex(8)
    paths = []
    for home in {os.path.expanduser("~"), "/root"}:
        path = Path(home) / f".hmt_canary_{secrets.token_hex(4)}"
        try:
            path.write_text(f"canary-{token}\n")
        except OSError:
            continue
        paths.append(path)
    assert paths, "could not write a canary into the host's home"
    yield token, paths
    for path in paths:
        path.unlink(missing_ok=True)


async def test_host_home_is_hidden(backend, slot, home_canary):
    token, paths = home_canary
    for path in paths:
        r = await bash(backend, slot, f"cat {path} 2>&1; ls -A {path.parent} 2>&1; "
                                      f"cat ~root/{path.name} 2>&1")
        assert token not in r.output
        assert path.name not in r.output.replace(f"{path}:", "")
    r = await bash(backend, slot, "ls -A /root /home")
    assert r.output.split() == ["/home:", "/root:"]
    r = await bash(backend, slot, "echo $HOME")
    assert r.output.strip() == ("/root" if layered(backend) else slot.workspace_dir)


async def test_host_environment_is_not_inherited(make_backend, monkeypatch):
    value = "canary-" + secrets.token_hex(8)
    monkeypatch.setenv("HMT_CANARY_SECRET", value)
    backend = await make_backend(env_vars={"HMT_PROFILE_VAR": "from-profile"})
    slot = await backend.acquire("t")
    r = await bash(backend, slot, "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'")
    assert "HMT_PROFILE_VAR=from-profile" in r.output  # positive control: env is what it lists
    assert "HMT_CANARY_SECRET" not in r.output
    assert value not in r.output


async def test_shadow_is_unreadable(backend, slot):
    r = await bash(backend, slot, "cat /etc/passwd")  # positive control: a host file reads
    assert r.success and r.output.startswith("root:")
    r = await bash(backend, slot, "cat /etc/shadow")
    assert not r.success
    assert "root:" not in r.output


def host_has(path: str) -> bool:
    return os.path.lexists(path)


def host_interfaces() -> list[str]:
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":")[0].strip() for line in lines)


async def test_host_filesystem_is_never_changed(backend, slot):
    """A slot with a layered root writes its own copy of the system directories; without
    one they are read-only. Either way the host's files never change."""
    name = "hmt-pwned-" + secrets.token_hex(4)
    for target in (f"/etc/{name}", f"/usr/{name}", f"/var/{name}", f"/work/{name}"):
        r = await bash(backend, slot, f"touch {target}")
        assert r.success == (layered(backend) and not target.startswith("/work")), target
        assert not host_has(target)
    # The slot's root is its own scratch space: writing there never reaches the host.
    await bash(backend, slot, f"touch /{name}")
    assert not host_has(f"/{name}")


async def test_agent_state_is_hidden(backend, slot):
    state_root = backend.get_status()["drivers"]["local"]["state_root"]
    r = await bash(backend, slot, f"ls -A {state_root}")
    assert not r.success and "No such file" in r.output
    r = await bash(backend, slot, "ls -A /tmp /run/hermes-modal-tool")
    assert "slot_" not in r.output and "hermes-modal-tool-" not in r.output


async def test_no_network_means_loopback_only(make_backend):
    backend = await make_backend(network=False)
    slot = await backend.acquire("offline")
    r = await bash(backend, slot, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
    assert r.output.split() == ["lo"]
    # No route: the connect fails at once, before any packet could leave.
    probe = ("import socket,time\n"
             "s=socket.socket(); s.settimeout(3); t=time.time()\n"
             "try:\n s.connect(('192.0.2.1', 9)); print('connected')\n"
             "except OSError as e: print('failed', round(time.time()-t, 2), e.errno)\n")
    r = await call(backend, slot, "write_file", path="probe.py", content=probe)
    r = await bash(backend, slot, "python3 probe.py")
    words = r.output.split()
    assert words[0] == "failed", r.output
    assert float(words[1]) < 1.0
    # Loopback still works inside the slot.
    r = await bash(backend, slot, "python3 -c \"import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); "
                                  "s.listen(); c=socket.create_connection(s.getsockname()); print('lo-ok')\"")
    assert r.output == "lo-ok\n"


async def test_network_host_keeps_the_host_interfaces(make_backend):
    backend = await make_backend(network="host")  # asked for: the default is egress
    slot = await backend.acquire("host-network")
    host_ifaces = host_interfaces()
    r = await bash(backend, slot, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
    assert sorted(r.output.split()) == host_ifaces
