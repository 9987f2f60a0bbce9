"""How a slot's shell is started: bubblewrap namespaces, cgroups or rlimits, its own uid.

Stdlib-only, Python 3.8. Runs inside the sandbox (for the local driver the
"sandbox" is the host, so this is where host isolation happens).

Each slot gets, when ``isolation == "bwrap"``:
- its own user, PID, IPC and UTS namespaces (and network namespace: with loopback
  only for ``network: none``; with ``network: egress`` the one the agent made for the
  slot, owned by the agent's user namespace, see ``net/slotnet.py``);
- a root filesystem built from the sandbox's top-level directories bound
  read-only, with the home directories (``/home``, ``/root``), ``/tmp``, ``/run``,
  ``/mnt`` and ``/media`` replaced by empty tmpfs and the agent's state directory
  hidden; only its own workspace is writable and no other slot's is mounted;
- a private ``/tmp``, a minimal ``/dev`` and its own ``/proc``.
When the agent runs as root, each slot also runs as its own unprivileged uid
(``uid_base + slot``), so the kernel's permission checks separate slots too.
"""

import json
import os
import resource
import signal
import stat
import time

from . import scopes

# Top-level directories never bound into a slot (replaced or omitted).
HIDDEN_TOP = frozenset(("proc", "dev", "sys", "tmp", "run", "home", "root", "mnt", "media",
                        "lost+found", "boot"))
#: The writable tmpfs mounts of a workspace-only slot, each capped at ``tmpfs_mb``.
WRITABLE_TMPFS = ("/dev/shm", "/tmp", "/run", "/home", "/root", "/mnt", "/var/tmp")
# Where a slot sees its control files (the command to run, its stdin).
CTL_PATH = "/run/hmt"  # short: bash reads the per-command line one byte at a time


def bwrap_argv(bwrap, ws_host, ws_path, ctl_host, network, hide, hostname, info_fd,
               tmpfs_mb=None, shared_tmpfs=None, devices=(), extra=()):
    """Return the bwrap argv prefix that starts one slot's sandboxed process.

    Args:
        bwrap: path of the ``bwrap`` executable.
        ws_host: the slot workspace as the agent sees it.
        ws_path: the path the slot sees it at (``{workspace_base}/slot_{N}``).
        ctl_host: the slot's control directory (bound read-only at ``CTL_PATH``).
        network: ``"none"`` (or False): a namespace of bwrap's with loopback only;
            ``"host"`` (or True): the sandbox's namespace; ``"egress"``: the namespace the
            starting thread is in (the slot's own, see :mod:`..net.slotnet`).
        hide: extra absolute paths to cover with an empty tmpfs.
        hostname: the slot's hostname.
        info_fd: fd bwrap writes ``{"child-pid": N}`` to.
        tmpfs_mb: size cap of each writable tmpfs (:data:`WRITABLE_TMPFS`); their pages
            also count toward the slot's memory cgroup. Everything else outside the
            workspace is read-only.
        shared_tmpfs: None, or ``place(target) -> host dir``: the directory of the slot's
            one capped tmpfs (:mod:`.slottmpfs`) bound at each writable place instead of
            a tmpfs per place (their total is then the cap, without cgroups).
        devices: bwrap arguments that add to ``/dev`` and bind more read-only (a gpu
            profile's, :meth:`.gpu.AgentGpu.workspace_only_argv`), placed after the tmpfs mounts.
        extra: more bwrap arguments (binds: the profile's volumes), placed after the
            slot's own mounts and before its root is made read-only.
    """
    size = ["--size", str(int(tmpfs_mb) * 1024 * 1024)] if tmpfs_mb else []
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--info-fd", str(info_fd), "--hostname", hostname]
    if network in (False, "none"):  # "egress": the spawn thread is in the slot's own already
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
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for path in WRITABLE_TMPFS:  # each capped; their pages count toward the memory cgroup
        if path != "/var/tmp" or os.path.isdir(path):
            argv += (["--bind", shared_tmpfs(path), path] if shared_tmpfs
                     else size + ["--tmpfs", path])
    for path in hide:
        if path and path != "/" and _under_bound(path):
            argv += ["--tmpfs", path, "--remount-ro", path]
    argv += list(devices)  # after the tmpfs mounts, which would cover /run's
    # Nothing else is writable: bwrap's own root tmpfs (where /data and the mount points
    # live) and /dev's tmpfs have no size cap, so they are made read-only last.
    argv += ["--dir", os.path.dirname(ws_path) or "/", "--bind", ws_host, ws_path,
             "--ro-bind", ctl_host, CTL_PATH, "--chdir", ws_path] + list(extra) + [
             "--remount-ro", "/dev", "--remount-ro", "/"]
    return argv


def bwrap_root_argv(bwrap, root_host, ctl_host, network, hostname, info_fd, chdir,
                    shm_mb=None, contain=False, devices=()):
    """Return the bwrap argv prefix for a slot with a layered root of its own.

    The slot is root (uid 0, all capabilities) in its own user namespace, which maps
    that one uid to the slot's unprivileged uid outside; ``root_host`` (the slot's
    overlay, see :mod:`.rootfs`) is its ``/``, with its own ``/proc``, a minimal ``/dev``,
    a size-capped ``/dev/shm`` and the control directory read-only at ``CTL_PATH``.

    ``contain`` (without cgroups, where nothing else bounds a tmpfs): the slot gets every
    capability but ``CAP_SYS_ADMIN`` and cannot make a user namespace, so it can mount
    nothing (no tmpfs past its cap) nor make ``/dev`` (read-only) writable again.

    ``devices``: bwrap arguments that add to ``/dev`` and bind more read-only (a gpu
    profile's, :attr:`.gpu.AgentGpu.argv`), placed after ``--dev``.
    """
    size = ["--size", str(int(shm_mb) * 1024 * 1024)] if shm_mb else []
    argv = [bwrap, "--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "ALL",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
            "--hostname", hostname]
    if contain:
        argv += ["--cap-drop", "CAP_SYS_ADMIN", "--disable-userns"]
    if network in (False, "none"):  # "egress": the spawn thread is in the slot's own already
        argv.append("--unshare-net")
    argv += ["--bind", root_host, "/", "--proc", "/proc", "--dev", "/dev"] + size + [
        "--tmpfs", "/dev/shm", "--ro-bind", ctl_host, CTL_PATH, "--chdir", chdir] + list(devices)
    if contain:
        argv += ["--remount-ro", "/dev"]
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


def purge_uid(uid, shared_dirs):
    """End every process running as ``uid`` and remove what it owns at the top of
    ``shared_dirs`` (for slots without namespaces, where a process can leave the shell's
    session with ``setsid`` and files in ``/tmp`` outlive the tenant).

    A child takes the uid and calls ``kill(-1, SIGKILL)``: the kernel signals, in one
    pass under its task list lock, every process that uid may signal, whatever session
    it is in; twice, for a fork that was under way. Then it waits until they are gone (a
    killed process finishes the syscall it is in), so the removal races with no one (and
    follows no links: ``trees.remove_tree``).
    Its System V IPC objects go too (:mod:`.sysvipc`: without an IPC namespace of its
    own, a segment would keep its memory, and its data for the uid's next tenant).
    Blocking: call it from a worker thread.
    """
    from ..fs import trees
    from . import sysvipc

    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # only syscalls here
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    _wait_gone(uid)  # a killed process may still finish the syscall it is in (a file, a segment)
    sysvipc.remove_owned_by(uid)
    for top in shared_dirs:
        try:
            names = os.listdir(top)
        except OSError:
            continue
        for name in names:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_uid != uid:
                continue
            if stat.S_ISDIR(st.st_mode):
                trees.remove_tree(path)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def _wait_gone(uid, limit_s=2.0):
    """Wait (bounded) until no live process runs as ``uid`` (zombies are done)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if all(process_state(pid) in (None, "Z", "X") for pid in pids_of_uids({uid})):
            return
        time.sleep(0.005)


def pids_of_uids(uids):
    """Host pids of the processes owned by one of ``uids`` (their ``/proc`` entry's owner)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            try:
                if os.stat("/proc/" + name).st_uid in uids:
                    out.append(int(name))
            except OSError:
                pass
    return out


def process_state(pid):
    """The state letter of ``pid`` (``/proc/<pid>/stat``: R, S, D, T, Z ...), None if gone."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def make_preexec(procs_files, rlimits, uid, gid):
    """Return a ``preexec_fn`` that enters the slot (:func:`slot_entry_fn`)."""
    enter = slot_entry_fn(privileged=os.geteuid() == 0)
    return lambda: enter(procs_files, rlimits, uid, gid)


def slot_entry_fn(privileged):
    """Return ``enter(procs_files, rlimits, uid, gid)``, for a child between fork (or the
    spawner's clone) and exec: join cgroups, set rlimits, enter a new Landlock domain
    scoped for abstract UNIX sockets, drop to ``uid``/``gid`` (None: stay), and join a
    new, empty session keyring (see ``scopes.py`` for why the last two). What it needs
    is loaded now, before any fork, so the child only makes syscalls. ``privileged``:
    the child is root until it drops to the slot's uid."""
    keyctl = scopes.keyctl()
    enter_scope = scopes.enter_scope_fn(privileged=privileged)

    def enter(procs_files, rlimits, uid, gid):
        pid = str(os.getpid())
        for path in procs_files:
            with open(path, "w") as fh:
                fh.write(pid)
        for res, value in rlimits:
            resource.setrlimit(res, (value, value))
        if enter_scope is not None:
            enter_scope()
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        if keyctl is not None:
            keyctl(scopes.KEYCTL_JOIN_SESSION_KEYRING, None)  # anonymous, owned by the slot's uid

    return enter


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
