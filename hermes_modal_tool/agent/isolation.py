"""How a slot's shell is started: bubblewrap namespaces, cgroups or rlimits, its own uid.

Stdlib-only, Python 3.8. Runs inside the sandbox (for the local driver the
"sandbox" is the host, so this is where host isolation happens).

Each slot gets, when ``isolation == "bwrap"``:
- its own user, PID, IPC and UTS namespaces (and network namespace with loopback
  only when the profile has ``network: false``);
- a root filesystem built from the sandbox's top-level directories bound
  read-only, with the home directories (``/home``, ``/root``), ``/tmp``, ``/run``,
  ``/mnt`` and ``/media`` replaced by empty tmpfs and the agent's state directory
  hidden; only its own workspace is writable and no other slot's is mounted;
- a private ``/tmp``, a minimal ``/dev`` and its own ``/proc``.
When the agent runs as root, each slot also runs as its own unprivileged uid
(``uid_base + slot``), so the kernel's permission checks separate slots too.
"""

import errno
import json
import os
import resource
import signal
import time

# Top-level directories never bound into a slot (replaced or omitted).
HIDDEN_TOP = frozenset(("proc", "dev", "sys", "tmp", "run", "home", "root", "mnt", "media",
                        "lost+found", "boot"))
# Where a slot sees its control files (the command to run, its stdin).
CTL_PATH = "/run/hmt"  # short: bash reads the per-command line one byte at a time


def bwrap_argv(bwrap, ws_host, ws_path, ctl_host, network, hide, hostname, info_fd,
               tmpfs_mb=None):
    """Return the bwrap argv prefix that starts one slot's sandboxed process.

    Args:
        bwrap: path of the ``bwrap`` executable.
        ws_host: the slot workspace as the agent sees it.
        ws_path: the path the slot sees it at (``{workspace_base}/slot_{N}``).
        ctl_host: the slot's control directory (bound read-only at ``CTL_PATH``).
        network: keep the sandbox's network (True) or loopback only (False).
        hide: extra absolute paths to cover with an empty tmpfs.
        hostname: the slot's hostname.
        info_fd: fd bwrap writes ``{"child-pid": N}`` to.
        tmpfs_mb: size cap of each writable tmpfs (``/tmp``, ``/var/tmp``, ``/run``,
            ``/dev/shm``); their pages also count toward the slot's memory cgroup.
    """
    size = ["--size", str(int(tmpfs_mb) * 1024 * 1024)] if tmpfs_mb else []
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--info-fd", str(info_fd), "--hostname", hostname]
    if not network:
        argv.append("--unshare-net")
    ws_top = ws_path.strip("/").split("/")[0]
    for name in sorted(os.listdir("/")):
        if name in HIDDEN_TOP or name == ws_top:
            continue
        path = "/" + name
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"] + size + ["--tmpfs", "/dev/shm"] + size + [
        "--tmpfs", "/tmp"] + size + ["--tmpfs", "/run",
                                     "--dir", "/home", "--dir", "/root", "--dir", "/mnt"]
    if os.path.isdir("/var/tmp"):
        argv += size + ["--tmpfs", "/var/tmp"]
    for path in hide:
        if path and path != "/" and _under_bound(path):
            argv += ["--tmpfs", path]
    argv += ["--dir", os.path.dirname(ws_path) or "/", "--bind", ws_host, ws_path,
             "--ro-bind", ctl_host, CTL_PATH, "--chdir", ws_path]
    return argv


def bwrap_root_argv(bwrap, root_host, ctl_host, network, hostname, info_fd, chdir,
                    shm_mb=None):
    """Return the bwrap argv prefix for a slot with a layered root of its own.

    The slot is root (uid 0, all capabilities) in its own user namespace, which maps
    that one uid to the slot's unprivileged uid outside; ``root_host`` (the slot's
    overlay, see :mod:`.rootfs`) is its ``/``, with its own ``/proc``, a minimal ``/dev``,
    a size-capped ``/dev/shm`` and the control directory read-only at ``CTL_PATH``.
    """
    size = ["--size", str(int(shm_mb) * 1024 * 1024)] if shm_mb else []
    argv = [bwrap, "--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "ALL",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
            "--hostname", hostname]
    if not network:
        argv.append("--unshare-net")
    argv += ["--bind", root_host, "/", "--proc", "/proc", "--dev", "/dev"] + size + [
        "--tmpfs", "/dev/shm", "--ro-bind", ctl_host, CTL_PATH, "--chdir", chdir]
    return argv


def _under_bound(path):
    top = path.strip("/").split("/")[0]
    return top not in HIDDEN_TOP and os.path.exists(path)


def read_child_pid(info_fd):
    """Read bwrap's ``--info-fd`` JSON; return the host pid of the sandbox's init, or None."""
    data = b""
    try:
        while True:
            chunk = os.read(info_fd, 4096)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    except OSError:
        return None
    try:
        return int(json.loads(data.decode() or "{}").get("child-pid"))
    except (ValueError, TypeError):
        return None


class Cgroups:
    """Per-sandbox and per-slot cgroups (v1 or v2), or None when the machine refuses.

    ``mode`` is ``"cgroup-v2"``, ``"cgroup-v1"`` or ``"rlimit"`` (the fallback).
    """

    CONTROLLERS = ("memory", "pids", "cpu")

    def __init__(self, name, limits):
        self.name = name
        self.limits = limits
        self.mode = "rlimit"
        self.reason = ""
        self._bases = {}  # controller -> sandbox cgroup dir
        try:
            self._setup()
        except OSError as exc:
            self.reason = "cgroups unavailable (%s); using rlimits" % (exc.strerror or exc,)
            self.remove_all()
            self._bases = {}
            self.mode = "rlimit"

    # -- setup -------------------------------------------------------------
    def _setup(self):
        mounts = _cgroup_mounts()
        if "cgroup2" in mounts and not mounts.get("v1"):
            root = mounts["cgroup2"]
            own = _own_cgroup_path(v2=True)
            parent = os.path.join(root, own.lstrip("/"), "hermes-modal-tool")
            _mkdir(parent)
            _write(os.path.join(os.path.dirname(parent), "cgroup.subtree_control"),
                   "+memory +pids +cpu", ignore=(errno.EBUSY, errno.ENOENT))
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids +cpu")
            base = os.path.join(parent, self.name)
            _mkdir(base)
            _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids +cpu")
            self._bases = {"unified": base}
            self.mode = "cgroup-v2"
        else:
            v1 = mounts.get("v1", {})
            for ctrl in self.CONTROLLERS:
                if ctrl not in v1:
                    raise OSError(errno.ENOENT, "no cgroup v1 %s controller mounted" % ctrl)
            for ctrl in self.CONTROLLERS:
                base = os.path.join(v1[ctrl], "hermes-modal-tool", self.name)
                _mkdir(base)
                self._bases[ctrl] = base
            self.mode = "cgroup-v1"
        self._apply(self._dirs(None), sandbox=True)

    def _dirs(self, slot):
        sub = "" if slot is None else "slot_%d" % slot
        return {ctrl: os.path.join(base, sub) if sub else base for ctrl, base in self._bases.items()}

    def _apply(self, dirs, sandbox):
        lim = self.limits
        mem = lim.get("memory_mb") if sandbox else lim.get("slot_memory_mb")
        pids = lim.get("sandbox_pids") if sandbox else lim.get("pids")
        cpu = lim.get("cpu") if sandbox else None
        if self.mode == "cgroup-v2":
            d = dirs["unified"]
            if mem:
                _write(os.path.join(d, "memory.max"), str(int(mem) * 1024 * 1024))
                _write(os.path.join(d, "memory.swap.max"), "0", ignore=(errno.ENOENT,))
            if pids:
                _write(os.path.join(d, "pids.max"), str(int(pids)))
            if cpu:
                _write(os.path.join(d, "cpu.max"), "%d 100000" % max(1000, int(cpu * 100000)))
        else:
            if mem:
                _write(os.path.join(dirs["memory"], "memory.limit_in_bytes"),
                       str(int(mem) * 1024 * 1024))
            if pids:
                _write(os.path.join(dirs["pids"], "pids.max"), str(int(pids)))
            if cpu:
                _write(os.path.join(dirs["cpu"], "cpu.cfs_period_us"), "100000")
                _write(os.path.join(dirs["cpu"], "cpu.cfs_quota_us"),
                       str(max(1000, int(cpu * 100000))))

    # -- per slot ----------------------------------------------------------
    def slot_procs_files(self, slot):
        """Create the slot's cgroups; return the ``cgroup.procs`` files to join."""
        if self.mode == "rlimit":
            return []
        dirs = self._dirs(slot)
        for d in dirs.values():
            _mkdir(d)
        self._apply(dirs, sandbox=False)
        return [os.path.join(d, "cgroup.procs") for d in dirs.values()]

    def slot_pids(self, slot):
        """Host pids currently in the slot's cgroup (empty when not using cgroups)."""
        if self.mode == "rlimit":
            return []
        pids = set()
        for d in self._dirs(slot).values():
            try:
                with open(os.path.join(d, "cgroup.procs")) as fh:
                    pids.update(int(x) for x in fh.read().split())
            except OSError:
                pass
        return sorted(pids)

    def kill_slot(self, slot):
        """SIGKILL every process in the slot's cgroup."""
        me = os.getpid()
        for pid in self.slot_pids(slot):
            if pid != me:
                _kill(pid, signal.SIGKILL)

    def remove_slot(self, slot):
        for d in self._dirs(slot).values():
            _rmdir(d)

    def remove_all(self):
        """Remove the sandbox's cgroups; return True when none is left."""
        for base in self._bases.values():
            if os.path.isdir(base):
                for entry in os.listdir(base):
                    if entry.startswith("slot_"):
                        _rmdir(os.path.join(base, entry))
            _rmdir(base)
            _rmdir(os.path.dirname(base))  # the shared parent, once no sandbox uses it
        return not any(os.path.isdir(base) for base in self._bases.values())

    def pids_events_file(self, slot):
        """The slot's ``pids.events`` file (None without cgroups)."""
        d = {} if self.mode == "rlimit" else self._dirs(slot)
        return os.path.join(d.get("pids") or d["unified"], "pids.events") if d else None

    def pids_limit_events(self, slot):
        """How many times a fork in the slot failed at its pids limit (``pids.events`` ``max``)."""
        path = self.pids_events_file(slot)
        if path is None:
            return 0
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "max":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def memory_peak_exceeded(self, slot):
        """True if the slot's memory cgroup has hit its limit (an OOM kill is likely)."""
        if self.mode == "cgroup-v1":
            path = os.path.join(self._dirs(slot)["memory"], "memory.failcnt")
        elif self.mode == "cgroup-v2":
            path = os.path.join(self._dirs(slot)["unified"], "memory.events")
        else:
            return False
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError:
            return False
        if self.mode == "cgroup-v1":
            return text.strip() not in ("", "0")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip() != "0":
                return True
        return False


def _cgroup_mounts():
    found = {"v1": {}}
    with open("/proc/self/mounts") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) < 4:
                continue
            mnt, fstype, opts = parts[1], parts[2], parts[3].split(",")
            if fstype == "cgroup2":
                found["cgroup2"] = mnt
            elif fstype == "cgroup":
                for ctrl in Cgroups.CONTROLLERS:
                    if ctrl in opts and ctrl not in found["v1"]:
                        found["v1"][ctrl] = mnt
    return found


def _own_cgroup_path(v2):
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            hid, ctrls, path = line.rstrip("\n").split(":", 2)
            if v2 and hid == "0":
                return path
    return "/"


def _mkdir(path):
    os.makedirs(path, exist_ok=True)


def _rmdir(path):
    try:
        os.rmdir(path)
    except OSError:
        pass


def _write(path, value, ignore=()):
    try:
        with open(path, "w") as fh:
            fh.write(value)
    except OSError as exc:
        if exc.errno not in ignore:
            raise


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


#: ``keyctl(2)`` by machine (not wrapped by Python); None where unknown.
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "i386": 288, "i686": 288, "armv7l": 311,
               "ppc64le": 271, "s390x": 280, "riscv64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1


def _keyctl():
    """A callable ``keyctl(op, arg)`` via libc's ``syscall``, loaded before any fork."""
    import platform

    number = _SYS_KEYCTL.get(platform.machine())
    if number is None:
        return None
    from .rootfs import libc

    syscall = libc().syscall
    return lambda op, arg: syscall(number, op, arg)


def make_preexec(procs_files, rlimits, uid, gid):
    """Return a ``preexec_fn``: join cgroups, set rlimits, drop to ``uid``/``gid``, and join
    a new, empty session keyring (bwrap does not make one, unlike runc: without it a slot
    would share the keys of the session that started the backend, an ssh login's or a
    systemd service's, and those of other slots).

    Runs in the child between fork and exec, so it only makes syscalls.
    """
    keyctl = _keyctl()

    def preexec():
        pid = str(os.getpid())
        for path in procs_files:
            with open(path, "w") as fh:
                fh.write(pid)
        for res, value in rlimits:
            resource.setrlimit(res, (value, value))
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        if keyctl is not None:
            keyctl(KEYCTL_JOIN_SESSION_KEYRING, None)  # anonymous, owned by the slot's uid

    return preexec


def rlimits_for(limits, own_uid):
    """The rlimits applied when cgroups are unavailable.

    ``RLIMIT_NPROC`` counts processes per uid, so it is only set when the slot runs
    as its own uid (``own_uid``); otherwise it would count the host user's processes.
    """
    out = [(resource.RLIMIT_CORE, 0)]
    mem = limits.get("slot_memory_mb") or limits.get("memory_mb")
    if mem:
        out.append((resource.RLIMIT_AS, int(mem) * 1024 * 1024))
    if own_uid and limits.get("pids"):
        out.append((resource.RLIMIT_NPROC, int(limits["pids"])))
    return out


_TCK = os.sysconf("SC_CLK_TCK")
_LAST_PID_FD = []


def process_clock():
    """``(ticks, last_pid)`` now: a process with a later start time, or the same tick and
    a higher pid, began after this call (``/proc/<pid>/stat`` start times are in ticks)."""
    try:
        if not _LAST_PID_FD:
            _LAST_PID_FD.append(os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY | os.O_CLOEXEC))
        last = int(os.pread(_LAST_PID_FD[0], 32, 0))
    except (OSError, ValueError):
        last = 1 << 30
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _TCK), last


def started_after(pid, start, clock):
    ticks, last = clock
    return start > ticks or (start == ticks and pid > last)


def children_of(parent):
    """Host pids whose parent is ``parent``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == parent:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def ns_processes(ns_link=None, session=None):
    """List ``(host_pid, ns_pid, ns_sid, start_ticks)`` of processes in a PID namespace or session.

    Args:
        ns_link: ``readlink /proc/<pid>/ns/pid`` of the slot's init; match by namespace.
        session: host session id; match by session (used without namespaces).
    """
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if ns_link is not None and os.readlink("/proc/%d/ns/pid" % pid) != ns_link:
                continue
            with open("/proc/%d/status" % pid) as fh:
                status = fh.read()
            with open("/proc/%d/stat" % pid) as fh:
                stat_fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        nspid = nssid = None
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                nspid = int(line.split()[-1])
            elif line.startswith("NSsid:"):
                nssid = int(line.split()[-1])
        if session is not None and nssid != session:
            continue
        out.append((pid, nspid, nssid, int(stat_fields[19])))
    return out


def find_working_bwrap(path_env, uid=None):
    """Find ``bwrap`` on ``path_env`` and check it can make a user namespace here.

    Used in containers (the Modal driver) where bubblewrap may be missing or
    refused (gVisor, seccomp). The check runs ``bwrap ... true`` as ``uid`` (the
    first slot's uid when the agent is root), because that is who runs it later.

    Returns:
        ``(path, "")`` when it works, else ``(None, why)``.
    """
    path = None
    for d in (path_env or "").split(":"):
        cand = os.path.join(d, "bwrap")
        if d and os.path.isfile(cand) and os.access(cand, os.X_OK):
            path = cand
            break
    if path is None:
        return None, "bwrap is not installed in the image"
    import subprocess

    argv = [path, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc",
            "--dev", "/dev", "true"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=10, cwd="/",
                              preexec_fn=make_preexec([], [], uid, uid) if uid is not None else None)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, "bwrap (%s) could not run: %s" % (path, exc)
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return None, "bwrap (%s) does not work here: %s" % (path, why[-1] if why else proc.returncode)
    return path, ""
