"""A slot is a whole machine to its trajectory: a private copy-on-write root, root inside.

Every test goes through the public API on the local driver (the default). What a slot
writes anywhere (``/usr``, ``/etc``, ``/workspace``) is its own: its neighbour never sees
it, the next tenant never sees it, and the host's files never change.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import secrets
import zipfile
from pathlib import Path

import pytest
from support import bash, layered

from hermes_modal_tool import ExecutionResult

pytestmark = pytest.mark.usefixtures("needs_root")


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("a layered root needs the backend to run as root (idmapped mounts)")


def host_has(path: str) -> bool:
    """Whether the host (not a slot) has ``path``."""
    return os.path.lexists(path)


def host_text(path: str) -> str:
    """The host's file ``path`` as text ("" when it has none)."""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


async def call(backend, slot, tool, **args) -> ExecutionResult:
    [result] = await backend.execute_batch([(slot, tool, args)])
    return result


def wheel_bytes(name: str, value: str) -> bytes:
    """A minimal pure-Python wheel, built here (no network, no build tools)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VALUE = {value!r}\n")
        z.writestr(f"{name}-1.0.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{name}-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return buf.getvalue()


DEB = r"""set -e
mkdir -p pkg/DEBIAN pkg/usr/bin
printf 'Package: {name}\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@example.invalid>\nDescription: demo\n' > pkg/DEBIAN/control
printf '#!/bin/sh\necho {name}-ok\n' > pkg/usr/bin/{name}; chmod 755 pkg/usr/bin/{name}
dpkg-deb --build pkg demo.deb >/dev/null
dpkg -i demo.deb >/dev/null
{name}; dpkg -s {name} | grep '^Status'
"""


async def test_status_says_each_slot_has_a_layered_root(backend):
    pool = backend.get_status()["pools"][backend.default_profile]
    assert pool["filesystem"] == "overlay", pool.get("filesystem_note")
    assert layered(backend)


async def test_root_writes_anywhere_privately(backend):
    """Writes to /usr, /etc and /workspace: visible in the slot, invisible to its neighbour,
    gone after reset, never on the host."""
    tag = secrets.token_hex(4)
    a = await backend.acquire("writer")
    b = await backend.acquire("neighbour")
    assert a.sandbox_id == b.sandbox_id
    r = await bash(backend, a, f"id -u; echo {tag} > /usr/local/bin/tool-{tag}; chmod +x "
                               f"/usr/local/bin/tool-{tag}; echo {tag} > /etc/motd; "
                               f"mkdir -p /workspace && echo {tag} > /workspace/x; "
                               f"cat /usr/local/bin/tool-{tag} /etc/motd /workspace/x")
    assert r.success, r.error
    assert r.output.split() == ["0", tag, tag, tag]
    check = f"cat /usr/local/bin/tool-{tag} /workspace/x 2>&1; grep -c {tag} /etc/motd"
    r = await bash(backend, b, check)
    assert tag not in r.output.replace(f"tool-{tag}", "") and "No such file" in r.output
    assert not host_has(f"/usr/local/bin/tool-{tag}")
    assert tag not in host_text("/etc/motd")
    await backend.release(a, reset_workspace=True)
    again = await backend.acquire("next-tenant")
    assert again.slot_id == a.slot_id  # the last released slot is reused first
    r = await bash(backend, again, check)
    assert tag not in r.output.replace(f"tool-{tag}", "") and "No such file" in r.output


async def test_pip_install_into_the_system_site_packages(backend):
    name = "hmt_demo_" + secrets.token_hex(3)
    a = await backend.acquire("pip")
    b = await backend.acquire("neighbour")
    whl = f"/workspace/{name}-1.0-py3-none-any.whl"
    w = await call(backend, a, "write_file", path=whl, encoding="base64",
                   content=base64.b64encode(wheel_bytes(name, "wheel-ok")).decode())
    assert w.success, w.error
    r = await bash(backend, a, f"python3 -m pip install --no-index --no-deps {whl} 2>&1 | tail -1; "
                               f"python3 -c 'import {name} as m; print(m.VALUE, m.__file__)'",
                   timeout=120)
    assert r.success, (r.output, r.error)
    value, where = r.output.splitlines()[-1].split()
    assert value == "wheel-ok" and where.startswith("/usr/")  # the system site-packages
    assert not host_has(where)
    r = await bash(backend, b, f"python3 -c 'import {name}'")
    assert not r.success and "ModuleNotFoundError" in r.output


async def test_dpkg_install_of_a_local_deb(backend):
    name = "hmt-demo-" + secrets.token_hex(3)
    a = await backend.acquire("dpkg")
    b = await backend.acquire("neighbour")
    r = await bash(backend, a, DEB.replace("{name}", name), timeout=120)
    assert r.success, (r.output, r.error)
    assert r.output.splitlines() == [f"{name}-ok", "Status: install ok installed"]
    assert not host_has(f"/usr/bin/{name}")
    r = await bash(backend, b, f"command -v {name} || dpkg -s {name} 2>&1 | head -1")
    assert f"/usr/bin/{name}" not in r.output and "not installed" in r.output
    r = await bash(backend, a, "apt-config dump | grep '^APT::Sandbox::User'")
    assert r.output.strip() == 'APT::Sandbox::User "root";'


async def test_workdir_is_the_starting_directory_and_home_is_root(make_backend):
    backend = await make_backend(workdir="/workspace/project")
    slot = await backend.acquire("t")
    r = await bash(backend, slot, "pwd; echo $HOME; ls -d " + slot.workspace_dir)
    assert r.output.split() == ["/workspace/project", "/root", slot.workspace_dir]
    # Relative file tool paths stay relative to the workspace (the seed's layout).
    w = await call(backend, slot, "write_file", path="rel.txt", content="r")
    assert w.metadata["path"] == f"{slot.workspace_dir}/rel.txt"


async def test_file_tools_with_absolute_paths_in_the_slots_view(backend, slot):
    r = await call(backend, slot, "read_file", path="/etc/os-release", limit=1)
    assert r.success and r.output.startswith(("PRETTY_NAME", "NAME")), r
    w = await call(backend, slot, "write_file", path="/workspace/a.py", content="print(6 * 7)\n")
    assert w.success, w.error
    r = await bash(backend, slot, "python3 /workspace/a.py && echo made > /opt/made.txt")
    assert r.output == "42\n"
    r = await call(backend, slot, "list_files", path="/workspace")
    assert r.output.splitlines() == ["a.py"]
    art = await backend.read_artifact(slot, "/opt/made.txt")
    assert art["success"] and art["content"] == "made\n"
    listing = await backend.list_artifacts(slot, "/workspace")
    assert listing["entries"] == ["a.py"]
    archive = await backend.archive_artifacts(slot, "/workspace", archive_format="zip")
    assert archive["success"], archive
    names = zipfile.ZipFile(io.BytesIO(base64.b64decode(archive["archive_base64"]))).namelist()
    assert names == ["a.py"]
    assert not host_has("/opt/made.txt")


async def test_file_tools_have_the_slots_permissions(backend, slot):
    """The agent acts with the slot's filesystem uid: what the slot's root cannot read (a
    host file of an unmapped group without read bits for others), the tools cannot either."""
    r = await bash(backend, slot, "cat /etc/shadow")
    assert not r.success
    r = await call(backend, slot, "read_file", path="/etc/shadow")
    assert not r.success and "root:" not in r.output
    r = await call(backend, slot, "write_file", path="/etc/shadow", content="x")
    assert not r.success


async def test_poisoned_system_files_stay_in_the_slot(backend):
    """A slot that writes /etc/ld.so.preload and replaces /usr/bin/bash changes nothing for
    its neighbour, for the next tenant or for the agent."""
    a = await backend.acquire("poisoner")
    b = await backend.acquire("neighbour")
    r = await bash(backend, a, "echo /nonexistent/evil.so > /etc/ld.so.preload; "
                               "printf '#!/bin/sh\\necho owned\\n' > /tmp/fake; "
                               "cp /tmp/fake /usr/bin/bash; chmod 755 /usr/bin/bash; echo done")
    assert r.output.endswith("done\n"), r.output
    r = await bash(backend, b, "echo fine; cat /etc/ld.so.preload 2>&1")
    assert r.output.startswith("fine\n") and "evil" not in r.output
    await backend.release(a, reset_workspace=True)
    again = await backend.acquire("next")
    r = await bash(backend, again, "echo $BASH_VERSION; cat /etc/ld.so.preload 2>&1")
    assert r.output[0].isdigit() and "evil" not in r.output
    assert "evil" not in host_text("/etc/ld.so.preload")


async def test_root_only_host_files_and_other_trees_are_hidden(backend, slot):
    r = await bash(backend, slot, "ls -A /root /home /tmp; ls / ; "
                                  "cat /var/cache/debconf/passwords.dat 2>&1 | head -1")
    tops = set(r.output.split())
    assert not {"work", "farm", "old_root"} & tops
    assert "No such file" in r.output or not host_has("/var/cache/debconf/passwords.dat")


async def test_reset_drops_a_large_layer_without_waiting_for_it(backend):
    slot = await backend.acquire("big")
    r = await bash(backend, slot, "mkdir -p /usr/share/bulk && cd /usr/share/bulk && "
                                  "for d in $(seq 50); do mkdir $d; for f in $(seq 100); do "
                                  "head -c 40960 /dev/zero > $d/$f; done; done; du -sm . | cut -f1",
                   timeout=120)
    assert r.success and int(r.output) >= 190, r.output
    loop = asyncio.get_running_loop()
    start = loop.time()
    await backend.release(slot, reset_workspace=True)
    slot = await backend.acquire("after")
    released_in = loop.time() - start
    r = await bash(backend, slot, "ls /usr/share/bulk 2>&1")
    assert "No such file" in r.output
    assert released_in < 5.0  # generous: the benchmark measures the real figure


async def test_slot_disk_limit_is_watched_and_named(make_backend):
    """The fallback where the kernel cannot enforce ``slot_disk`` (here asked for)."""
    backend = await make_backend(slot_disk=64, disk_limit="watch")
    pool = backend.get_status()["pools"][backend.default_profile]
    assert pool["slot_disk"]["mib"] == 64 and pool["slot_disk"]["enforced"] == "watched"
    hog = await backend.acquire("hog")
    other = await backend.acquire("other")
    r = await bash(backend, hog, "for i in $(seq 200); do head -c 1048576 /dev/zero > /opt/f$i; "
                                 "done; sleep 3; echo end", timeout=60)
    assert not r.success and "slot_disk = 64 MiB" in r.error, (r.output, r.error)
    r = await bash(backend, hog, "rm -f /opt/f*; head -c 100M /dev/zero > /big 2>&1; echo rc=$?")
    assert "File size limit exceeded" in r.output  # no single file outgrows the limit
    r = await bash(backend, hog, "rm -f /opt/f* /big; echo cleaned")
    assert r.success and r.output == "cleaned\n"
    assert (await bash(backend, other, "echo ok")).output == "ok\n"


async def test_slot_disk_limit_is_enforced_and_named(make_backend):
    """Where the machine allows it, each layer is a file system of ``slot_disk`` MiB: the
    slot's writes past it fail with ENOSPC, and the result names the limit."""
    backend = await make_backend(slot_disk=64, disk_limit="kernel")
    pool = backend.get_status()["pools"][backend.default_profile]
    assert pool["slot_disk"]["mib"] == 64 and pool["slot_disk"]["enforced"].startswith("kernel")
    hog = await backend.acquire("hog")
    r = await bash(backend, hog, "for i in $(seq 100); do head -c 1048576 /dev/zero > /opt/f$i "
                                 "|| break; done; ls /opt/f* | wc -l", timeout=60)
    assert "No space left on device" in r.output, (r.output, r.error)
    assert 50 <= int(r.output.split()[-1]) <= 64, r.output
    assert not r.success and "slot_disk = 64 MiB" in r.error, (r.output, r.error)
    r = await bash(backend, hog, "rm -f /opt/f*; head -c 16M /dev/zero > /opt/g && echo wrote")
    assert r.success and r.output == "wrote\n", (r.output, r.error)
    # A layer that something else filled between two calls (a process the slot left
    # running) is not the next command's doing: that command keeps its exit code 0.
    r = await bash(backend, hog, "rm -f /opt/f* /opt/g; (sleep 1; for i in $(seq 100); do head -c 1048576 "
                                 "/dev/zero > /opt/h$i || break; done; echo full > /tmp/filled) "
                                 "> /dev/null 2>&1 & echo started")
    assert r.success and r.output == "started\n", (r.output, r.error)
    for _ in range(600):  # a file tool asks: no bash call ends while the layer fills
        [seen] = await backend.execute_batch([(hog, "read_file", {"path": "/tmp/filled"})])
        if seen.success:
            break
        await asyncio.sleep(0.1)
    assert seen.success and "full" in seen.output, seen
    r = await bash(backend, hog, "echo innocent")
    assert r.success and r.output == "innocent\n" and not r.error, (r.output, r.error)


async def test_workspace_only_mode_is_explicit(make_backend):
    backend = await make_backend(filesystem="workspace-only")
    pool = backend.get_status()["pools"][backend.default_profile]
    assert pool["filesystem"] == "workspace-only" and pool["filesystem_note"]
    slot = await backend.acquire("t")
    r = await bash(backend, slot, "id -u; touch /usr/x 2>&1")
    assert r.output.split()[0] != "0" and "Read-only" in r.output
