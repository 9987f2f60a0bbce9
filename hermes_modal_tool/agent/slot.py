"""A slot inside the agent: its workspace or layered root, control files, shell and calls.

Stdlib-only, Python 3.8.
"""

import asyncio
import collections
import os
import resource
import threading

from .files import files
from .fs import mounts, rootfs, volumes, wipes
from .limits import diskwatch, isolation
from .shells.shell import Shell
from .state import snapshots

#: Ops whose opening message waits out the slot's reset (:meth:`SlotRuntime.held_for_reset`).
HELD_IN_RESET = frozenset(("upload", "download", "tunnel", "process", "checksum", "usage"))

#: Shared temporary directories a slot without namespaces can write (purged on reset).
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")


class SlotRuntime:
    """A slot inside the agent: its workspace, control directory, shell and call queue."""

    def __init__(self, agent, index):
        self.agent = agent
        self.index = index
        self.ws_path = "%s/slot_%d" % (agent.workspace_base.rstrip("/"), index)
        self.ws_host = os.path.join(agent.host_root, "slot_%d" % index)
        self.ctl_host = os.path.join(agent.ctl_root, "slot_%d" % index)
        if agent.uid_base is not None:
            self.uid = self.gid = agent.uid_base + index
        else:
            self.uid = self.gid = None
        self.env = dict(agent.env)
        self.env["HOME"] = self.ws_path if agent.isolation == "bwrap" else self.ws_host
        self.root = None  # the slot's layered root (rootfs.SlotRoot) when it has one
        self.dirty = False  # a call ran since the last reset
        self.rlimits = []  # the slot's own (on top of the sandbox's)
        self.start_dir = self.ws_path
        self.replay = self.replay_text = None  # shell state from a snapshot (agent/state/snapshots.py)
        if agent.filesystem == "overlay":
            self.root = rootfs.SlotRoot(
                os.path.join(agent.state_dir, "fs", "slot_%d" % index),
                os.path.join(agent.state_dir, "mnt", "slot_%d" % index), self.uid, self.gid,
                # The control directory's mount point too: else bwrap makes it in every
                # tenant's layer (a copy-up of /run and a directory on disk per shell start).
                agent.upper_plan, agent.trash_dir,
                [self.ws_path, agent.workdir, isolation.CTL_PATH] + volumes.targets(agent.volumes),
                os.path.join(agent.template_dir, "slot_%d" % index), agent.layer_spares,
                agent.shared_template)
            self.root.disks = agent.layer_disks  # each layer a file system of its own, or None
            if "HOME" not in agent.config.get("env", {}):
                self.env["HOME"] = "/root"  # a container's root; the profile may say otherwise
            self.start_dir = agent.workdir or self.ws_path
            if agent.slot_disk_mb:
                # No file may outgrow the disk limit (the watcher catches many small ones).
                self.rlimits = [(resource.RLIMIT_FSIZE, int(agent.slot_disk_mb) * 1024 * 1024)]
        elif diskwatch.watched(agent, self):  # no bwrap: its uid's files (diskwatch.py)
            self.rlimits = [(resource.RLIMIT_FSIZE, int(agent.slot_disk_mb) * 1024 * 1024)]
        self.ctl_fds = {}
        self.queue = collections.deque()  # call messages waiting for this slot
        self.current = None  # id of the call running now
        self.pending = None  # that call while it waits for admission or for its shell
        self.busy = False
        self.idle = asyncio.Event()
        self.idle.set()
        self.resetting = None  # during a reset: the messages held until it is over
        self.shell = Shell(self, agent.loop)
        self.background_sids = []
        self.bg_counter = 0
        if self.root is not None:
            root = self.root
            self.workspace = files.Workspace(lambda: root.merged, "/", cwd=self.ws_path)
        else:
            self.workspace = files.Workspace(
                self.ws_host, self.ws_path if agent.isolation == "bwrap" else self.ws_host,
                self.uid, self.gid)
        self.tmpfs = None  # a slottmpfs.SlotTmpfs when the agent's setup gives it one
        self.ready = False  # directories are made on first use (fast sandbox start)
        self.root_built = False  # the layered root was mounted once (its standby follows)
        self._root_lock = threading.Lock()
        #: Held while the slot's layers change (fork, snapshot, reset) and while a shell
        #: starts on them (its root is built and bwrap binds it): a shell never starts on a
        #: layer that is being replaced, and a layer never changes under a starting shell.
        self.layer_lock = asyncio.Lock()
        self._pids_fd = None
        self._pids_seen = None

    @property
    def ctl_path(self):
        return isolation.CTL_PATH if self.agent.isolation == "bwrap" else self.ctl_host

    def prepare_dirs(self):
        """Make the slot's control directory (and, without a layered root, its workspace)
        on first use; cheap, so it runs on the event loop. A layered root is built by
        :meth:`ensure_root` in a worker thread."""
        if self.ready:
            return
        self.prepare_ctl()
        if self.tmpfs is not None:
            self.tmpfs.ensure()  # one mount (slottmpfs.py)
        if self.root is None:
            os.makedirs(self.ws_host, exist_ok=True)
            self.workspace.wipe()
        self.ready = True

    def prepare_ctl(self):
        # The control directory: the agent's (root's), never writable by the slot, so the
        # agent never creates a file where the slot could plant a link; readable and
        # enterable by the slot's group only (other local users see nothing).
        os.makedirs(self.ctl_host, mode=0o700, exist_ok=True)
        if self.gid is not None:
            os.chown(self.ctl_host, 0, self.gid)
            os.chmod(self.ctl_host, 0o750)
        else:
            os.chmod(self.ctl_host, 0o755)  # slots run as the agent's own user

    def ensure_root(self):
        """Build the slot's layered root if it has none mounted (blocking: a few mounts,
        the plan's entries and a fork; call from a worker thread, never the event loop).
        After the first mount, the next tenant's standby layer is prepared in the
        background. No-op without a layered root."""
        root = self.root
        if root is None:
            return
        with self._root_lock:  # a pre-started shell and a file tool may both come here
            first = not self.root_built
            built = root.ensure()
            self.root_built = True
        if first:  # it points base/current at the new layer too
            self.agent.loop.call_soon_threadsafe(self.agent.layer_work, root, None)
        elif built:
            root.point_current()

    def pids_limit_hit(self):
        """Whether a fork in the slot failed at its pids limit since this was last asked
        (one ``pread`` of the cgroup's ``pids.events`` through a descriptor kept open)."""
        cg = self.agent.cgroups
        if not cg:
            return False
        fd = self._pids_fd
        if fd is None:
            path = cg.pids_events_file(self.index)
            if path is None:
                return False
            try:
                fd = self._pids_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return False
        try:
            text = os.pread(fd, 4096, 0)
        except OSError:
            return False
        count = 0
        for line in text.split(b"\n"):
            if line.startswith(b"max "):
                count = int(line[4:] or 0)
        seen, self._pids_seen = self._pids_seen, count
        return count > (seen or 0)

    def memory_limit_hit(self):
        cg = self.agent.cgroups
        return bool(cg) and cg.memory_peak_exceeded(self.index)

    def write_ctl(self, name, data):
        """Write a control file the slot reads (command text, stdin); return its slot path.

        The command file is rewritten on every call, so its descriptor stays open.
        """
        fd = self.ctl_fds.get(name)
        if fd is None:
            # O_NOFOLLOW: even in the agent's own directory, never through a link.
            fd = os.open(os.path.join(self.ctl_host, name),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o640 if self.gid is not None else 0o644)
            if self.gid is not None:
                os.fchown(fd, 0, self.gid)  # the slot reads it through its group
                os.fchmod(fd, 0o640)
            if name in ("cmd", "stdin", "e"):
                self.ctl_fds[name] = fd
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
            os.ftruncate(fd, len(data))
        finally:
            if name not in self.ctl_fds:
                os.close(fd)
        return "%s/%s" % (self.ctl_path, name)

    def close_ctl(self):
        for fd in self.ctl_fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.ctl_fds = {}

    # -- calls: one at a time per slot, in arrival order ---------------------------
    def pump(self):
        while self.queue and not self.busy:
            self.agent.start_call(self, self.queue.popleft())

    def set_busy(self, mid):
        self.prepare_dirs()
        self.busy = True
        self.current = mid
        self.idle.clear()

    def set_idle(self):
        self.busy = False
        self.current = None
        self.idle.set()
        self.pump()

    async def reset(self, on_killed=None):
        """Kill what ran in the slot and empty its workspace.

        A shell that never ran a command (one pre-started by the last reset) is
        already fresh and is kept. With a layered root of its own (not a fork's, and no
        tmpfs to renew), ``on_killed()`` runs as soon as SIGKILL is sent to each of the
        old tenant's processes (none of them runs its code again: ``shellprocs.stop``),
        before they are gone and the slot torn down: nothing they do can reach the next
        tenant (they can write only to the layer this reset drops, and the slot stays
        busy, so every call for it waits, until they are gone and the layer is swapped).
        """
        shell = self.shell
        if getattr(self.agent, "shm_watch", None) is not None:  # a new tenant (shmwatch.py)
            self.agent.shm_watch.reset(self)
        # With a root of its own, a slot that ran anything gets a new root, and its shell
        # must go too (its mount namespace holds the old one).
        drop = self.root is not None and (self.dirty or shell.used)
        self.dirty = False
        stopped = drop or shell.used or not (shell.alive or shell.starting)
        if stopped:
            # Not for a fork's layer: the snapshots it holds are let go after the teardown,
            # and the answer says they are.
            early = self.root is not None and self.tmpfs is None and (
                self.root.active is None or self.root.active.stack is None)
            await shell.stop(on_kill=on_killed if early else None)
            if self.agent.cgroups:
                self.agent.cgroups.kill_slot(self.index)
            if self.agent.isolation != "bwrap" and self.uid is not None:
                # No PID namespace: a process may have left the shell's session (setsid).
                await self.agent.loop.run_in_executor(
                    self.agent.executor("files"), isolation.purge_uid, self.uid, SHARED_TMP)
            if self.agent.net is not None:  # its processes are gone: its namespace goes
                await self.agent.loop.run_in_executor(
                    self.agent.executor("files"), self.agent.net.release, self.index)
            if self.tmpfs is not None:  # the slot's processes are gone: a fresh tmpfs
                await self.agent.loop.run_in_executor(self.agent.executor("files"), self.tmpfs.renew)
            self.close_ctl()
            for name in os.listdir(self.ctl_host):
                try:
                    os.unlink(os.path.join(self.ctl_host, name))
                except OSError:
                    pass
        self.background_sids = []
        shell.resume_dir = None
        self.replay = self.replay_text = None
        if self.root is None:
            # Off the loop: a slot can make its workspace large (linear, iterative); with
            # nothing of it running, swapped out in O(1) and deleted in the background.
            await wipes.reset_workspace(self.agent, self.workspace, stopped)
            return
        # Swap to the standby layer (pointers only, whatever the slot wrote); the dropped one
        # is unmounted, renamed and deleted in the background, where the next standby is
        # prepared too. Without a standby ready, the reset does not wait for one: the next
        # shell (started right after the reset) or file tool builds it (ensure_root).
        if drop:
            async with self.layer_lock:
                old = self.root.discard()
                if old is not None and old.stack is not None:
                    snapshots.store(self.agent).layer_gone(old)  # a fork's or snapshot's layer
                self.root.swap()
                self.agent.layer_work(self.root, old)

    def held_for_reset(self, msg):
        """Keep ``msg`` until this slot's reset is over (True) if it opens something on the
        slot (a transfer, a tunnel) or asks about its processes, files or usage (False: not
        resetting, or a message to something already open). The reset answers the host
        once the old tenant's processes are killed, before its layer is swapped or its
        workspace emptied, and the next tenant may ask at once: served then, an upload
        would land in the old layer (lost) and a download would read the old tenant's files.
        Calls, snapshots and forks wait on their own (the slot stays busy meanwhile)."""
        if self.resetting is None or msg.get("stream") is not None or msg.get("tunnel") is not None:
            return False
        self.resetting.append(msg)
        return True

    def in_netns(self, fn):
        """``fn()`` in this slot's network namespace with ``network: egress`` (set up on
        first use: net/slotnet.py), else as is. Blocking: the spawn thread calls it."""
        if self.agent.net is None:
            return fn()
        with self.agent.net.entered(self.index):
            return fn()

    def fs_creds(self):
        """Context for file tools: the slot's own filesystem uid when it has a root of its own."""
        if self.root is None:
            return _NO_CREDS
        return mounts.FsCreds(self.uid, self.gid)


class _NoCreds:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_CREDS = _NoCreds()
