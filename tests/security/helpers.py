"""Host-side views of a slot for the attack suite."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from support import bash, processes, slot_host_process

from hermes_modal_tool import ExecutionResult


async def call(backend, slot, tool, **args) -> ExecutionResult:
    [result] = await backend.execute_batch([(slot, tool, args)])
    return result


class SandboxView:
    """Where a path of a sandbox is on this host: the same path for the local driver;
    for the local Modal control plane (``server``), its place in the one running
    sandbox's writable directories (tests that use this run one sandbox)."""

    def __init__(self, server=None) -> None:
        self.server = server

    def _state_dir(self, backend) -> Path:
        from conftest import running_sandboxes

        [rec] = running_sandboxes(self.server, backend.default_profile)
        return Path(rec.state_dir)

    def host_path(self, backend, path: str) -> Path:
        """``path`` (absolute, as the agent sees it) on this host."""
        if self.server is None:
            return Path(path)
        from hermes_modal_tool.testing.modal_server._common import WRITABLE_DIRS

        top = max((t for t in WRITABLE_DIRS if path == t or path.startswith(t + "/")), key=len)
        return self._state_dir(backend) / "fs" / WRITABLE_DIRS[top][0] / path[len(top):].lstrip("/")

    def workspace(self, backend, slot) -> Path:
        """A workspace-only slot's workspace on this host."""
        if self.server is None:
            return host_workspace(backend, slot)
        return self.host_path(backend, slot.workspace_dir)

    def ctl_dirs(self, backend, slot) -> list[Path]:
        """The agent's control directory of ``slot`` on this host."""
        if self.server is None:
            root = Path(backend.get_status()["drivers"]["local"]["state_root"])
            shm = [p for p in Path("/dev/shm").glob("hermes-modal-tool-*")
                   if (p / slot.sandbox_id).is_dir()]
            return [p / slot.sandbox_id / f"slot_{slot.index}" for p in shm] or [
                root / slot.sandbox_id / "ctl" / f"slot_{slot.index}"]
        fs = self._state_dir(backend) / "fs"
        return sorted(fs.glob(f"tmp/.hermes-modal-tool/*/ctl/slot_{slot.index}"))

    def in_sandbox(self, backend, host: Path) -> str:
        """The inverse of :meth:`host_path`."""
        if self.server is None:
            return str(host)
        from hermes_modal_tool.testing.modal_server._common import WRITABLE_DIRS

        rel = host.relative_to(self._state_dir(backend) / "fs")
        top = next(t for t, (sub, _) in WRITABLE_DIRS.items() if sub == rel.parts[0])
        return os.path.join(top, *rel.parts[1:])


def host_workspace(backend, slot) -> Path:
    """Where ``slot``'s workspace lives on the host (the local driver's layout): in its
    layer's upper directory; where that is a file system of its own (``slot_disk``
    enforced by the kernel: a detached mount), through the slot's root in the agent's
    mount namespace (``/proc/AGENT/root``)."""
    root = Path(backend.get_status()["drivers"]["local"]["state_root"]) / slot.sandbox_id
    current = root / "fs" / f"slot_{slot.index}" / "current"  # the layer in use
    if (current / "upper").is_dir():
        return current / "upper" / slot.workspace_dir.lstrip("/")
    if current.is_symlink():
        return agent_view(current.parent / os.readlink(current) / "merged") / slot.workspace_dir.lstrip("/")
    return root / "ws" / Path(slot.workspace_dir).name


def mount_points(pid: int) -> set[str]:
    """The mount points in process ``pid``'s mount namespace (``mountinfo``)."""
    try:
        return {line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}
    except OSError:
        return set()


def agent_view(mount_point: Path) -> Path:
    """``mount_point`` (a mount in an agent's private mount namespace) reached from the
    host through that agent (``/proc/AGENT/root``)."""
    for pid, proc in processes().items():
        if proc.is_agent and str(mount_point) in mount_points(pid):
            return Path(f"/proc/{pid}/root{mount_point}")
    raise AssertionError(f"{mount_point} is mounted in no agent's mount namespace")


@dataclass(frozen=True)
class SlotOwner:
    """How the host tells a slot's processes apart. An agent run as root gives each slot
    a uid of its own (``uid``, ``pidns`` None): every process of that uid, whatever
    namespace it is in. A normal user's agent runs every slot as that user: there, the
    slot's pid namespace (``pidns``, an inode), which is the lease's own (a reset starts
    the next tenant's shell in a new one)."""

    uid: int
    pidns: int | None

    def pids(self) -> list[int]:
        """The live host processes of the slot."""
        if self.pidns is None:
            return pids_of_uid(self.uid)
        return [p.pid for p in processes().values() if p.uid == self.uid and _pidns(p.pid) == self.pidns]


def _pidns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


async def slot_owner(backend, slot) -> SlotOwner:
    """The slot's :class:`SlotOwner`, as the host sees it (:func:`support.slot_host_process`):
    its own uid when it has one (with a layered root the slot is root inside, mapped to
    that uid outside), else the user's uid and the slot's pid namespace."""
    uid, pidns = await slot_host_process(backend, slot)
    if os.geteuid() == 0:
        assert uid >= 200000, uid
        return SlotOwner(uid, None)
    return SlotOwner(uid, pidns)


def pids_of_uid(uid: int) -> list[int]:
    """Live host processes running as ``uid`` (a slot's own uid when run as root)."""
    return [p.pid for p in processes().values() if p.uid == uid]


async def victim_state(backend, slot) -> list[str]:
    r = await bash(backend, slot, "cat secret.txt; ls -A; cat d/f")
    return r.output.split()


def fresh_shell_only(owner: SlotOwner) -> bool:
    """True when all that runs of the slot is a new idle shell (a reset pre-starts one)."""
    procs = processes()
    return all(procs[p].comm == "bwrap" or procs[p].cmdline == b"bash\x00--noprofile\x00--norc\x00"
               for p in owner.pids() if p in procs)


def none_alive(pids) -> bool:
    alive = set(processes())
    return not (set(pids) & alive)


def killed(pids) -> bool:
    """Whether every one of ``pids`` is gone, a zombie, exiting or has SIGKILL pending:
    in none of these does a process run its own code again (a release answers once its
    tenant's processes are sent SIGKILL: agent/shells/shellprocs.py ``stop``)."""
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields["State"].strip()[:1] in ("Z", "X"):
            continue
        pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
        if pending & (1 << (signal.SIGKILL - 1)):
            continue
        flags = int(stat.rsplit(")", 1)[1].split()[6])  # field 9 of /proc/<pid>/stat
        if not flags & 0x4:  # PF_EXITING
            return False
    return True


def exists(path) -> bool:
    return os.path.lexists(path)


def host_can_fork() -> bool:
    import subprocess

    return subprocess.run(["true"], check=False).returncode == 0
