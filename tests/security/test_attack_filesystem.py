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


@pytest.fixture
def hidden_canary():
    """A world-readable canary in a host directory hidden from every slot (a new home under
    ``/home``: slots see ``/home`` empty, in every filesystem mode), so only the slot's
    isolation keeps it from a slot, never its permissions. Yields ``(dir, name, token)``."""
    home = Path("/home") / ("hmt-hidden-" + secrets.token_hex(4))
    home.mkdir(mode=0o755)
    name = "canary-" + secrets.token_hex(4) + ".txt"
    token = "hidden-canary-" + secrets.token_hex(8)
    (home / name).write_text(token + "\n")
    os.chmod(home / name, 0o644)
    # Positive control: any host user could read it, so a leak would show.
    assert (home / name).stat().st_mode & 0o004 and home.stat().st_mode & 0o005 == 0o005
    yield home, name, token
    shutil.rmtree(home, ignore_errors=True)


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


@pytest.fixture(params=["overlay", "workspace-only"])
async def fs_two_slots(request, make_backend):
    """Two slots of one sandbox (``a`` holds a secret file, ``b`` attacks) in each local
    filesystem mode: a layered root of the slot's own, and the host's root read-only."""
    backend = await make_backend(filesystem=request.param)
    a = await backend.acquire("victim")
    b = await backend.acquire("attacker")
    assert a.sandbox_id == b.sandbox_id and layered(backend) == (request.param == "overlay")
    r = await bash(backend, a, "echo victim-secret > secret.txt; mkdir d; echo x > d/f")
    assert r.success, r.error
    return backend, a, b


def leaked(r, *secrets_: str) -> list[str]:
    """Which of ``secrets_`` a result shows: in its output, error, metadata or archive."""
    blob = (r.output or "") + (r.error or "") + str(r.metadata)
    if r.metadata.get("archive_base64"):
        blob += base64.b64decode(r.metadata["archive_base64"]).decode("latin-1")
    return [s for s in secrets_ if s in blob]


async def test_symlinks_pointing_out_via_file_tools(fs_two_slots, hidden_canary):
    """Links to a host directory hidden from slots and to another slot's workspace: no file
    tool call returns, lists or archives anything behind them, in either filesystem mode."""
    backend, a, b = fs_two_slots
    home, name, token = hidden_canary
    depth = "../" * 6
    r = await bash(backend, b, f"ln -s {home} cdir; ln -s {home}/{name} cfile; "
                               f"ln -s {depth}{str(home).lstrip('/')} rel; mkdir sub; "
                               f"ln -s ../../.. sub/up; ln -s {a.workspace_dir} other; "
                               f"echo mine > mine; for l in cfile cdir other; do readlink $l; done")
    assert r.output.split() == [f"{home}/{name}", str(home), a.workspace_dir], r.output
    up = f"sub/up{home}"  # the slot's root, then the hidden directory
    looks = [
        ("read_file", {"path": "cfile"}), ("read_file", {"path": f"cdir/{name}"}),
        ("read_file", {"path": f"rel/{name}"}), ("read_file", {"path": f"{up}/{name}"}),
        ("read_file", {"path": f"{home}/{name}"}),
        ("read_file", {"path": "cfile", "encoding": "base64"}), ("read_artifact", {"path": "cfile"}),
        ("read_artifact", {"path": "other/secret.txt"}), ("read_file", {"path": "other/secret.txt"}),
        ("list_files", {"path": "cdir"}), ("list_files", {"path": "other"}),
        ("list_artifacts", {"path": up, "recursive": True}),
        ("list_artifacts", {"path": "other", "recursive": True}),
        ("archive_artifacts", {"path": "cdir"}), ("archive_artifacts", {"path": up}),
        ("archive_artifacts", {"path": "other"}),
    ]
    writes = [
        ("write_file", {"path": "cfile", "content": "pwned"}),
        ("write_file", {"path": "cdir/new", "content": "pwned"}),
        ("write_file", {"path": "rel/new", "content": "pwned"}),
        ("write_file", {"path": "cfile", "content": "pwned", "append": True}),
        ("write_file", {"path": "other/secret.txt", "content": "pwned"}),
    ]
    # Nothing is behind the links in the slot's view: every look fails and shows nothing.
    results = await backend.execute_batch([(b, tool, args) for tool, args in looks])
    for (tool, args), r in zip(looks, results, strict=True):
        # (An error may name a link's target, which the slot wrote; a listing may not
        # name what is behind it.)
        hidden = (token, "victim-secret") + ((name,) if tool.startswith(("list", "archive")) else ())
        assert not leaked(r, *hidden), (tool, args, r.output[:200], r.error)
        assert not r.success, (tool, args, r.output[:200])
    # A write through a link lands in the slot's own root where it has one (it is root
    # there, as in a container) and fails where it has none; never on the host.
    results = await backend.execute_batch([(b, tool, args) for tool, args in writes])
    for (tool, args), r in zip(writes, results, strict=True):
        assert not leaked(r, token, "victim-secret"), (tool, args, r.output[:200], r.error)
        assert r.success == layered(backend), (tool, args, r.output[:200], r.error)
    # What a read through the links finds now is the slot's own write, never the canary.
    results = await backend.execute_batch([(b, tool, args) for tool, args in looks[:7]])
    for (tool, args), r in zip(looks[:7], results, strict=True):
        assert not leaked(r, token, "victim-secret"), (tool, args, r.output[:200], r.error)
    # Positive control: the same tools do read, list and archive the slot's own files.
    own = await backend.execute_batch([(b, "read_file", {"path": "mine"}),
                                       (b, "list_files", {"path": "."}),
                                       (b, "archive_artifacts", {"path": "."})])
    assert own[0].output == "mine\n" and "cfile" in own[1].output and own[2].success, own
    # Archiving the workspace keeps the links as links and never reads through them.
    for fmt in ("tar.gz", "tar", "zip"):
        r = await call(backend, b, "archive_artifacts", path=".", archive_format=fmt)
        assert r.success, r.error
        assert not leaked(r, token, "victim-secret"), fmt
        data = base64.b64decode(r.metadata["archive_base64"])
        if fmt == "zip":
            assert sorted(zipfile.ZipFile(io.BytesIO(data)).namelist()) == ["mine"]
        else:
            with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                kinds = {m.name: m.type for m in tf.getmembers()}
            assert kinds["mine"] == tarfile.REGTYPE and kinds["cfile"] == tarfile.SYMTYPE
    assert sorted(p.name for p in home.iterdir()) == [name]
    assert (home / name).read_text() == token + "\n"
    assert await victim_state(backend, a) == VICTIM


RACE = r"""
import ctypes, os, sys, time
target, end, name = sys.argv[1], time.time() + float(sys.argv[2]), sys.argv[3]
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
    os.symlink(target + "/" + name, "f.lnk")
    os.replace("f.lnk", "f")
    # d: a real directory and a link to the canary directory swap places atomically
    if libc.renameat2(-100, b"d", -100, b"dl", 2) != 0:  # RENAME_EXCHANGE
        os.rename("d", "dx"); os.rename("dl", "d"); os.rename("dx", "dl")
print("swaps", n)
"""


async def test_symlink_swapped_in_between_check_and_use(backend, two_slots, hidden_canary):
    """A loop replaces files and directories with links to a host directory hidden from
    slots while the file tools run over and over: no call returns, archives or changes
    anything behind the links."""
    a, b = two_slots
    home, name, token = hidden_canary
    await call(backend, b, "write_file", path="race.py", content=RACE)
    r = await bash(backend, b, f"python3 race.py {home} 60 {name}", background=True)
    assert r.success, r.error
    # The swapping has begun once `dl` was seen as a link (an `ls -l` of it can race with
    # the swap: a link when stat'ed, a directory when read).
    r = await bash(backend, b, "for i in $(seq 100); do [ -L dl ] && echo swapping && break; "
                               "sleep 0.05; done")
    assert "swapping" in r.output, r.output
    calls = []
    for i in range(60):
        calls += [("read_file", {"path": "f"}), ("read_file", {"path": f"d/{name}"}),
                  ("read_artifact", {"path": "f"}), ("read_file", {"path": "d/file"}),
                  ("write_file", {"path": "f", "content": f"w{i}"}),
                  ("write_file", {"path": f"d/{name}", "content": f"w{i}"}),
                  ("write_file", {"path": "d/new", "content": f"w{i}"}),
                  ("list_files", {"path": "d"})]
        if i % 6 == 0:
            calls.append(("archive_artifacts", {"path": ".", "archive_format": "tar"}))
    seen_ok = seen_refused = 0
    for _ in range(3):
        results = await backend.execute_batch([(b, tool, args) for tool, args in calls], timeout_s=60)
        for (tool, args), res in zip(calls, results, strict=True):
            # (Not the canary's name: a write through a link may create that name in the
            # slot's own root, where a later listing shows it.)
            assert not leaked(res, token), (tool, args)
            seen_ok += res.success
            seen_refused += not res.success
        assert sorted(p.name for p in home.iterdir()) == [name]
    # The tools did run against the workspace between swaps, and met the links too.
    assert seen_ok > 0 and seen_refused > 0, (seen_ok, seen_refused)
    r = await bash(backend, b, "pgrep -f race.py >/dev/null && echo racing; cat .background/*.log")
    assert r.output.startswith("racing\n") and "Traceback" not in r.output, r.output
    await bash(backend, b, "pkill -f race.py; true")
    assert (home / name).read_text() == token + "\n"
    assert await victim_state(backend, a) == VICTIM


def host_shadow_lines() -> list[str]:
    """The host's /etc/shadow entries with a hash or lock field (what a leak would show)."""
    return [line for line in Path("/etc/shadow").read_text().splitlines() if line.count(":") >= 2]


async def test_hard_links_to_foreign_files(fs_two_slots, hidden_canary):
    backend, a, b = fs_two_slots
    home, name, token = hidden_canary
    shadow = host_shadow_lines()
    assert shadow  # positive control: there is something a leak would show
    for src in ("/etc/shadow", f"{home}/{name}", f"{a.workspace_dir}/secret.txt"):
        r = await bash(backend, b, f"ln {src} hl 2>&1; cat hl 2>&1; echo pwned >> hl 2>&1; rm -f hl")
        assert "victim-secret" not in r.output and token not in r.output, (src, r.output)
        assert not any(line in r.output for line in shadow), src
    assert (home / name).read_text() == token + "\n"
    # A file in the workspace of an owner the slot does not map (planted by the host,
    # mode 0600): the file tools refuse it and a hard link to it, in every mode.
    ws = host_workspace(backend, b)
    planted = ws / "planted"
    secret = "planted-" + secrets.token_hex(8)
    planted.write_text(secret + "\n")
    os.chown(planted, 12345, 12345)
    os.chmod(planted, 0o600)
    os.link(planted, ws / "planted-link")
    # Positive controls: the slot sees both names, and the tools read a hard link the
    # slot made to a file of its own.
    r = await bash(backend, b, "ls; echo mine > mine; ln mine mine-link")
    assert "planted" in r.output.split() and "planted-link" in r.output.split(), r.output
    assert (await call(backend, b, "read_file", path="mine-link")).output == "mine\n"
    for tool, args in (("read_file", {"path": "planted"}), ("read_file", {"path": "planted-link"}),
                       ("read_artifact", {"path": "planted-link"}),
                       ("read_file", {"path": "planted", "encoding": "base64"}),
                       ("write_file", {"path": "planted", "content": "pwned"}),
                       ("write_file", {"path": "planted-link", "content": "pwned", "append": True}),
                       ("archive_artifacts", {"path": "."})):
        r = await call(backend, b, tool, **args)
        assert not leaked(r, secret), (tool, args)
        if tool != "archive_artifacts":  # an archive leaves out what it may not read
            assert not r.success and "no such file" not in (r.error or ""), (tool, args, r.error)
    r = await bash(backend, b, "cat planted planted-link; echo pwned > planted; echo pwned >> planted-link")
    assert not r.success and secret not in r.output
    assert planted.read_text() == secret + "\n"
    planted.unlink()
    (ws / "planted-link").unlink()


async def test_mount_bind_and_namespace_tricks(backend, slot, host_canary, hidden_canary):
    canary, token = host_canary
    home, hidden, hidden_token = hidden_canary
    shadow = host_shadow_lines()
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
        f"unshare -Urm sh -c 'cat /etc/shadow {home}/{hidden}'",
        f"nsenter -t 1 -m -u -n -i -p cat /etc/shadow {home}/{hidden}",
        f"unshare -Urm sh -c 'umount -l /home; cat {home}/{hidden}'",
        f"umount -l /home; cat {home}/{hidden}",
        f"chroot / touch /etc/{name}",
    ]
    for cmd in attempts:
        r = await bash(backend, slot, cmd + " 2>&1")
        assert hidden_token not in r.output and not exists(f"/etc/{name}"), cmd
        assert not any(line in r.output for line in shadow), cmd
    assert_canary_intact(canary, token)
    if not layered(backend):
        r = await bash(backend, slot, f"cat {canary}/file")
        assert r.output == token + "\n"  # the slot still sees the host's (read-only) view


async def test_shadow_unreadable_every_way(backend, slot):
    shadow = host_shadow_lines()
    # Positive control: the same ways read a world-readable host file.
    r = await call(backend, slot, "read_file", path="/etc/passwd")
    assert r.success and r.output.startswith("root:"), r.error
    for cmd in ("cat /etc/shadow", "cat /proc/1/root/etc/shadow", "unshare -r cat /etc/shadow",
                "python3 -c \"print(open('/etc/shadow').read())\"", "cp /etc/shadow . && cat shadow"):
        r = await bash(backend, slot, cmd + " 2>&1")
        assert "root:" not in r.output and not any(line in r.output for line in shadow), cmd
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
