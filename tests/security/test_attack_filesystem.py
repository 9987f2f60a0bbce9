"""Filesystem attacks from inside a slot: each must fail to read or change anything
outside the slot's own workspace (another slot's files, the host's files, the
engine's state and secrets), checked on the victim's side, not only by exit codes.
"""

from __future__ import annotations

import base64
import io
import os
import secrets
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
from support import bash, layered

from .helpers import call, exists, host_workspace, victim_state

VICTIM = ["victim-secret", "d", "secret.txt", "x"]


@pytest.fixture
def host_canary():
    """A root-owned canary directory in a host directory slots see read-only (/srv or /opt)."""
    base = next((d for d in ("/srv", "/opt", "/var/lib") if Path(d).is_dir()), None)
    path = Path(tempfile.mkdtemp(prefix="hmt-canary-", dir=base))
    token = "canary-" + secrets.token_hex(8)
    (path / "file").write_text(token + "\n")
    os.chmod(path, 0o755)
    yield path, token
    shutil.rmtree(path, ignore_errors=True)


def assert_canary_intact(path: Path, token: str) -> None:
    assert sorted(p.name for p in path.iterdir()) == ["file"]
    assert (path / "file").read_text() == token + "\n"


async def test_other_slot_by_absolute_dotdot_and_proc_paths(backend, two_slots):
    a, b = two_slots
    other = a.workspace_dir
    name = Path(other).name
    reads = [
        f"cat {other}/secret.txt", f"cat ../{name}/secret.txt", f"cat /data/../data/{name}/secret.txt",
        f"cat /proc/1/root{other}/secret.txt", f"cat /proc/self/root{other}/secret.txt",
        f"cat /proc/*/cwd/../{name}/secret.txt", "cat /proc/*/root/data/*/secret.txt",
        "grep -rs 'victim-secre[t]' /data /tmp /var/tmp /run /dev/shm /mnt /home /root",
        f"cd /; cd data/{name} && cat secret.txt", f"ls -laR /data {other}",
    ]
    for cmd in reads:
        r = await bash(backend, b, cmd + " 2>&1", timeout=30)
        assert "victim-secret" not in r.output and not r.metadata["timed_out"], cmd
    writes = [
        f"echo pwned > {other}/secret.txt", f"echo pwned > ../{name}/new",
        f"mkdir -p {other}/d && echo pwned > {other}/d/f", f"rm -rf {other} ../{name}",
        f"echo pwned > /proc/1/root{other}/secret.txt", f"mv ../{name} ../moved",
        f"chmod 777 {other}", f"touch /proc/1/cwd/../{name}/x",
    ]
    for cmd in writes:
        await bash(backend, b, cmd)
    assert await victim_state(backend, a) == VICTIM
    assert sorted(p.name for p in host_workspace(backend, a).iterdir()) == ["d", "secret.txt"]


async def test_symlinks_pointing_out_via_bash(backend, two_slots, host_canary):
    a, b = two_slots
    canary, token = host_canary
    await bash(backend, b, f"ln -s {a.workspace_dir} other; ln -s {canary} cdir; "
                           f"ln -s {canary}/file cfile; ln -s /etc/shadow shadow")
    r = await bash(backend, b, "cat other/secret.txt shadow 2>&1; ls other 2>&1")
    assert "victim-secret" not in r.output and "root:" not in r.output
    # With a layered root the host's directories are the slot's own copy: writing through
    # the links succeeds there and never reaches the host; another slot is never reachable.
    for cmd in ("echo pwned > cfile", "echo pwned > cdir/new", "rm -f cdir/file",
                "echo pwned > other/new", "cp /etc/hostname cdir/"):
        r = await bash(backend, b, cmd)
        assert r.success == (layered(backend) and "other" not in cmd), cmd
    assert_canary_intact(canary, token)
    assert await victim_state(backend, a) == VICTIM


async def test_symlinks_pointing_out_via_file_tools(backend, two_slots, host_canary):
    a, b = two_slots
    canary, token = host_canary
    await bash(backend, b, f"ln -s {canary} cdir; ln -s {canary}/file cfile; ln -s /etc/passwd pw; "
                           f"ln -s ../../../{canary} rel; mkdir sub; ln -s ../../.. sub/up; "
                           f"ln -s {a.workspace_dir} other; echo mine > mine")
    calls = [
        ("read_file", {"path": "cfile"}), ("read_file", {"path": "cdir/file"}),
        ("read_file", {"path": "rel/file"}), ("read_file", {"path": "sub/up/etc/passwd"}),
        ("read_file", {"path": "pw", "encoding": "base64"}), ("read_artifact", {"path": "cfile"}),
        ("read_artifact", {"path": "other/secret.txt"}), ("list_files", {"path": "cdir"}),
        ("list_artifacts", {"path": "sub/up", "recursive": True}),
        ("write_file", {"path": "cfile", "content": "pwned"}),
        ("write_file", {"path": "cdir/new", "content": "pwned"}),
        ("write_file", {"path": "rel/new", "content": "pwned"}),
        ("write_file", {"path": "cfile", "content": "pwned", "append": True}),
        ("write_file", {"path": "other/secret.txt", "content": "pwned"}),
        ("write_file", {"path": "sub/up/x", "content": "pwned"}),
        ("archive_artifacts", {"path": "cdir"}), ("archive_artifacts", {"path": "sub/up"}),
    ]
    results = await backend.execute_batch([(b, tool, args) for tool, args in calls])
    own_view = layered(backend)  # the canary and /etc are the slot's own (copy-on-write) view
    for (tool, args), r in zip(calls, results, strict=True):
        blob = r.output + str(r.metadata)
        assert "victim-secret" not in blob, (tool, args)
        # A write through "other" lands in the slot's own root (checked below: the victim
        # is untouched); everything else of another slot is out of reach.
        if not own_view or ("other" in args["path"] and tool != "write_file"):
            assert not r.success, (tool, args, r.output[:200])
            assert token not in blob and "root:" not in blob
    # Archiving the workspace keeps the links as links and never reads through them.
    for fmt in ("tar.gz", "tar", "zip"):
        r = await call(backend, b, "archive_artifacts", path=".", archive_format=fmt)
        assert r.success, r.error
        data = base64.b64decode(r.metadata["archive_base64"])
        assert token.encode() not in data and b"root:" not in data and b"victim-secret" not in data
        if fmt == "zip":
            assert sorted(zipfile.ZipFile(io.BytesIO(data)).namelist()) == ["mine"]
        else:
            with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                kinds = {m.name: m.type for m in tf.getmembers()}
            assert kinds["mine"] == tarfile.REGTYPE and kinds["cfile"] == tarfile.SYMTYPE
    assert_canary_intact(canary, token)
    assert await victim_state(backend, a) == VICTIM


RACE = r"""
import ctypes, os, sys, time
target, end = sys.argv[1], time.time() + float(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("d", exist_ok=True); open("d/file", "w").write("inside\n")
os.symlink(target, "dl")
n = 0
while time.time() < end:
    n += 1
    # f: a regular file, then (atomically) a link to the host canary file
    with open("f.tmp", "w") as fh:
        fh.write("inside\n")
    os.replace("f.tmp", "f")
    os.symlink(target + "/file", "f.lnk")
    os.replace("f.lnk", "f")
    # d: a real directory and a link to the canary directory swap places atomically
    if libc.renameat2(-100, b"d", -100, b"dl", 2) != 0:  # RENAME_EXCHANGE
        os.rename("d", "dx"); os.rename("dl", "d"); os.rename("dx", "dl")
print("swaps", n)
"""


async def test_symlink_swapped_in_between_check_and_use(backend, two_slots, host_canary):
    """A loop replaces files and directories with links to a host directory while the
    file tools run over and over: none returns, archives or changes anything outside."""
    a, b = two_slots
    canary, token = host_canary
    await call(backend, b, "write_file", path="race.py", content=RACE)
    r = await bash(backend, b, f"python3 race.py {canary} 60", background=True)
    assert r.success, r.error
    # The swapping has begun once `dl` was seen as a link (an `ls -l` of it can race with
    # the swap: a link when stat'ed, a directory when read).
    r = await bash(backend, b, "for i in $(seq 100); do [ -L dl ] && echo swapping && break; "
                               "sleep 0.05; done")
    assert "swapping" in r.output, r.output
    calls = []
    for i in range(60):
        calls += [("read_file", {"path": "f"}), ("read_file", {"path": "d/file"}),
                  ("read_artifact", {"path": "f"}),
                  ("write_file", {"path": "f", "content": f"w{i}"}),
                  ("write_file", {"path": "d/file", "content": f"w{i}"}),
                  ("write_file", {"path": "d/new", "content": f"w{i}"}),
                  ("list_files", {"path": "d"})]
        if i % 6 == 0:
            calls.append(("archive_artifacts", {"path": ".", "archive_format": "tar"}))
    seen_ok = seen_refused = 0
    for _ in range(3):
        results = await backend.execute_batch([(b, tool, args) for tool, args in calls], timeout_s=60)
        for (tool, args), res in zip(calls, results, strict=True):
            blob = res.output + str(res.metadata.get("content", ""))
            assert token not in blob or layered(backend), (tool, args)
            if tool == "archive_artifacts" and res.success and not layered(backend):
                assert token.encode() not in base64.b64decode(res.metadata["archive_base64"])
            seen_ok += res.success
            seen_refused += not res.success
        assert_canary_intact(canary, token)
    # The tools did run against the workspace between swaps, and met the links too.
    assert seen_ok > 0 and (seen_refused > 0 or layered(backend)), (seen_ok, seen_refused)
    r = await bash(backend, b, "pgrep -f race.py >/dev/null && echo racing; cat .background/*.log")
    assert r.output.startswith("racing\n") and "Traceback" not in r.output, r.output
    await bash(backend, b, "pkill -f race.py; true")
    assert_canary_intact(canary, token)
    assert await victim_state(backend, a) == VICTIM


async def test_hard_links_to_foreign_files(backend, two_slots, host_canary):
    a, b = two_slots
    canary, token = host_canary
    for src in ("/etc/shadow", "/etc/passwd", f"{canary}/file", f"{a.workspace_dir}/secret.txt"):
        r = await bash(backend, b, f"ln {src} hl 2>&1; cat hl 2>&1; echo pwned >> hl 2>&1; rm -f hl")
        assert "victim-secret" not in r.output
        if not layered(backend) or src == "/etc/shadow":  # else: the slot's own copy
            assert token not in r.output and "root:" not in r.output
    assert_canary_intact(canary, token)
    # A file in the workspace that the slot does not own (planted by the host as root)
    # is refused by the file tools, and a hard link to it changes nothing.
    ws = host_workspace(backend, b)
    planted = ws / "planted"
    planted.write_text("root-owned " + token + "\n")
    os.chown(planted, 0, 0)
    os.chmod(planted, 0o644)
    os.link(planted, ws / "planted-link")
    for tool, args in (("read_file", {"path": "planted"}), ("read_file", {"path": "planted-link"}),
                       ("read_artifact", {"path": "planted-link"}),
                       ("write_file", {"path": "planted", "content": "pwned"}),
                       ("write_file", {"path": "planted-link", "content": "pwned", "append": True})):
        r = await call(backend, b, tool, **args)
        if layered(backend) and tool != "write_file":
            continue  # the slot's permissions: a file of an unmapped owner, readable by others
        assert not r.success, (tool, args)
        assert token not in r.output
    r = await bash(backend, b, "echo pwned > planted; echo pwned >> planted-link")
    assert not r.success
    assert planted.read_text() == "root-owned " + token + "\n"
    planted.unlink()
    (ws / "planted-link").unlink()


async def test_mount_bind_and_namespace_tricks(backend, slot, host_canary):
    canary, token = host_canary
    name = "hmt-pwned-" + secrets.token_hex(4)
    attempts = [
        "mount -t tmpfs none /mnt",
        f"mount --bind {slot.workspace_dir} {canary}",
        "mount -o remount,rw /etc",
        f"unshare -Urm sh -c 'mount -o remount,rw /etc && touch /etc/{name}'",
        f"unshare -Urm sh -c 'mount -o remount,rw,bind /etc && touch /etc/{name}'",
        f"unshare -Urm sh -c 'mount -t tmpfs x {canary} && echo pwned > {canary}/file'",
        f"unshare -Urm sh -c 'umount -l /etc; touch /etc/{name}'",
        f"unshare -Urm sh -c 'echo pwned > {canary}/file'",
        "unshare -Urm sh -c 'cat /etc/shadow'",
        "nsenter -t 1 -m -u -n -i -p cat /etc/shadow",
        f"chroot / touch /etc/{name}",
    ]
    for cmd in attempts:
        r = await bash(backend, slot, cmd + " 2>&1")
        assert "root:$" not in r.output and not exists(f"/etc/{name}"), cmd
    assert_canary_intact(canary, token)
    if not layered(backend):
        r = await bash(backend, slot, f"cat {canary}/file")
        assert r.output == token + "\n"  # the slot still sees the host's (read-only) view


async def test_shadow_unreadable_every_way(backend, slot):
    for cmd in ("cat /etc/shadow", "cat /proc/1/root/etc/shadow", "unshare -r cat /etc/shadow",
                "python3 -c \"print(open('/etc/shadow').read())\"", "cp /etc/shadow . && cat shadow"):
        r = await bash(backend, slot, cmd + " 2>&1")
        assert "root:" not in r.output, cmd
    r = await call(backend, slot, "read_file", path="/etc/shadow")
    assert not r.success and "root:" not in r.output


@pytest.fixture
def home_canaries():
    """Canaries in /root and in a new home under /home on the host."""
    token = "home-canary-" + secrets.token_hex(8)
    user_home = Path("/home") / ("hmtuser" + secrets.token_hex(3))
    user_home.mkdir()
    paths = [Path("/root") / f".hmt_canary_{secrets.token_hex(4)}", user_home / ".ssh_key"]
    for p in paths:
        p.write_text(token + "\n")
    yield token, paths
    paths[0].unlink(missing_ok=True)
    shutil.rmtree(user_home, ignore_errors=True)


async def test_host_home_directories_are_hidden(backend, slot, home_canaries):
    token, paths = home_canaries
    for p in paths:
        r = await bash(backend, slot, f"cat {p} 2>&1; ls -A {p.parent} 2>&1; find /home /root 2>&1; "
                                      f"cat /proc/1/root{p} 2>&1")
        assert token not in r.output and p.name not in r.output.replace(str(p), ""), p
        r = await call(backend, slot, "read_file", path=str(p))
        assert not r.success and token not in r.output
    for p in paths:
        await bash(backend, slot, f"echo pwned > {p}; rm -rf {p.parent}/*")
        assert p.read_text() == token + "\n"


@pytest.fixture
def secret_file(monkeypatch):
    base = next((d for d in ("/opt", "/srv", "/var/lib") if Path(d).is_dir()), None)
    sdir = Path(tempfile.mkdtemp(prefix="hmt-secrets-", dir=base))
    value = "sk-secretfile-" + secrets.token_hex(8)
    (sdir / "key.env").write_text(f"KEY={value}\n")
    monkeypatch.setenv("HERMES_MODAL_TOOL_SECRETS_DIR", str(sdir))
    yield sdir, value
    shutil.rmtree(sdir, ignore_errors=True)


async def test_secrets_dir_and_engine_state_are_hidden(make_backend, secret_file):
    sdir, value = secret_file
    backend = await make_backend()  # this profile uses no secret
    slot = await backend.acquire("t")
    state_root = backend.get_status()["drivers"]["local"]["state_root"]
    pattern = f"'{value[:3]}[{value[3]}]{value[4:]}'"
    cmds = [f"cat {sdir}/key.env; ls -A {sdir}", f"ls -A {state_root}; ls -A /tmp /dev/shm /run",
            "cat /tmp/hermes-modal-tool-*/*/ws/*/* /dev/shm/hermes-modal-tool-*/*/*/*",
            "cat /proc/1/environ /proc/*/environ | tr '\\0' '\\n'",
            # Decisive and fast on any machine: where the value is (exactly), the files
            # beside it, and the small trees a slot owns; not a scan of the whole of /opt
            # (8 GB of wheels on this machine: over 30 s with a cold page cache).
            f"grep -rs {pattern} {sdir} /tmp /dev/shm /run /home /root /data; "
            f"grep -s {pattern} {sdir.parent}/*"]
    for cmd in cmds:
        r = await bash(backend, slot, cmd + " 2>&1", timeout=30)
        assert not r.metadata["timed_out"], cmd
        assert value not in r.output and "key.env" not in r.output.replace(f"{sdir}/key.env:", ""), cmd
        assert "slot_" not in r.output.replace(slot.workspace_dir, ""), cmd
    r = await bash(backend, slot, f"ls -A {sdir.parent}")
    assert r.success and sdir.name not in r.output, r.output  # not even its name
    r = await call(backend, slot, "read_file", path=f"{sdir}/key.env")
    assert not r.success and value not in r.output
    # Writing into the (hidden) secrets and state directories reaches nothing on the host.
    await bash(backend, slot, f"echo pwned > {sdir}/key.env; mkdir -p {state_root}/x")
    assert (sdir / "key.env").read_text() == f"KEY={value}\n"
    assert not exists(f"{state_root}/x")


async def test_relative_secrets_dir_is_hidden_too(mode_backend, secret_file, monkeypatch):
    """A relative HERMES_MODAL_TOOL_SECRETS_DIR is made absolute once, so the directory the
    engine reads is the one it hides from slots of profiles without secrets (on Modal too,
    where the local control plane's containers have the host's root)."""
    sdir, value = secret_file
    monkeypatch.chdir(sdir.parent)
    monkeypatch.setenv("HERMES_MODAL_TOOL_SECRETS_DIR", sdir.name)
    backend = await mode_backend()  # this profile uses no secret
    slot = await backend.acquire("t")
    # The files beside it, not a scan of the whole of /opt (see the test above).
    r = await bash(backend, slot, f"cat {sdir}/key.env; ls -A {sdir}; grep -s KEY= {sdir.parent}/*; "
                                  f"ls -A {sdir.parent}")
    assert not r.metadata["timed_out"]
    assert value not in r.output and "key.env" not in r.output.replace(f"{sdir}/key.env:", "")
    r = await call(backend, slot, "read_file", path=f"{sdir}/key.env")
    assert not r.success and value not in r.output


async def test_fifo_and_special_files_do_not_hang_the_agent(backend, two_slots):
    """A FIFO where the file tools expect a file must not block the agent (which serves
    every slot of the sandbox)."""
    a, b = two_slots
    await bash(backend, b, "mkfifo fifo; mkdir dd; mkfifo dd/f2; truncate -s 20G sparse")
    calls = [(b, "write_file", {"path": "fifo", "content": "x"}),
             (b, "write_file", {"path": "dd/f2", "content": "x", "append": True}),
             (b, "read_file", {"path": "fifo"}), (b, "read_artifact", {"path": "dd/f2"}),
             (b, "archive_artifacts", {"path": "dd"}),
             (a, "bash", {"command": "cat secret.txt"})]
    results = await backend.execute_batch(calls, timeout_s=15)
    for (_, tool, args), r in zip(calls[:4], results, strict=False):
        assert not r.success and "not a regular file" in (r.error or ""), (tool, args, r.error)
    assert results[4].success  # the FIFO is skipped, never opened for reading
    assert results[5].output == "victim-secret\n"
    # A 20 GB sparse file cannot make the agent build a 20 GB archive in memory.
    r = await call(backend, b, "archive_artifacts", path=".")
    assert not r.success and "limit" in r.error
    assert (await bash(backend, a, "echo fine")).output == "fine\n"
