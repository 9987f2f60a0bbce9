"""Memory-backed shared places, watched against each slot's memory share.

Stdlib-only, Python 3.8. Slots without bubblewrap (each its own uid, no mount namespace)
write to the sandbox's shared ``/tmp``, ``/var/tmp`` and ``/dev/shm``. Those of them
that are tmpfs (``statfs``, checked once per sandbox; on Modal at least ``/dev/shm``)
hold memory the neighbours need, so what a slot's uid owns there counts against its
memory share: ``slot_memory``, by default ``memory / slots_per_sandbox``.

It is a watch, as :mod:`.diskwatch` (the file systems have no quotas; memory cgroups
are absent in Modal's containers): one task of the agent measures, every
:data:`~.diskwatch.DISK_WATCH_S`, in one worker thread (never on the event loop), what
each slot in use (a call ran since its last reset: its commands, background jobs and
processes alike, also after the command that started them returned) owns in those
places; each bash command is measured once more when it ends, before its result goes
out. While those places hold no more than one share in all (``statvfs``) nothing is
walked. Files deleted while still open or mapped count too (``/proc/<pid>/fd`` and
``map_files`` of the slot's processes), and so do the slot's memfds and the System
V shared memory segments its uid owns (:mod:`.sysvipc`); the cheap check before any walk
is the kernel's ``Shmem``, which covers all three. Past the share, every process of the
slot's uid is killed and what it owns in those places (and its System V objects)
removed; the running command's result (else the slot's next one) says so. A burst
between two checks can exceed the share briefly (a tmpfs fills at GB/s).
"""

import asyncio
import ctypes
import os
import stat
import struct
import sys

from ..fs import mounts, trees
from . import isolation, sysvipc
from .diskwatch import DISK_WATCH_S, SHARED_PLACES

TMPFS_MAGIC = 0x01021994
_MIB = 1048576.0
_HOW = {"running": "while the command ran; every process of the slot (the command too) was "
                   "stopped and its files there were removed",
        "ended": "seen when the command ended; every process of the slot was stopped and its "
                 "files there were removed",
        "background": "written by a process of the slot after its command had returned; every "
                      "process of the slot was stopped and its files there were removed, so "
                      "this command ran in a new shell (cwd, variables and jobs were lost)"}


def memory_backed(places=SHARED_PLACES):
    """Those of ``places`` that are tmpfs (``statfs``), each file system once."""
    libc = mounts.libc()
    found, devs = [], set()
    for place in places:
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type (a long) comes first
        if libc.statfs(os.fsencode(place), buf) != 0:
            continue
        if struct.unpack_from("l", buf.raw)[0] != TMPFS_MAGIC:
            continue
        try:
            dev = os.stat(place).st_dev
        except OSError:
            continue
        if dev not in devs:
            devs.add(dev)
            found.append(place)
    return found


def share_of(limits, slots):
    """``(MiB, where it came from)`` of a slot's memory share, or ``(None, "")``."""
    mem = limits.get("slot_memory_mb")
    sandbox = limits.get("memory_mb")
    if not mem:
        return None, ""
    if sandbox and slots and int(mem) == max(64, int(sandbox) // int(slots)):
        return int(mem), "slot_memory, by default memory / slots_per_sandbox = %d MiB / %d" % (
            sandbox, slots)
    return int(mem), "slot_memory"


def owned_bytes(uids, places, slot_uids=()):
    """``{uid: {place: bytes}}``: what each of ``uids`` owns (blocks) under each of
    ``places``, each inode once. Only directories a slot could write to are entered
    (owned by one of ``uids`` or ``slot_uids``, or writable by group or others): not the
    agent's own. Walked as :func:`.diskwatch.uid_usage_bytes` (``trees.walk_tree``).
    Blocking."""
    usage = {uid: {} for uid in uids}
    enter = set(uids) | set(slot_uids)
    seen = set()
    for place in places:
        def visit(fd, name, st, place=place):
            mine = usage.get(st.st_uid)
            if mine is not None and (st.st_dev, st.st_ino) not in seen:
                if st.st_nlink > 1:
                    seen.add((st.st_dev, st.st_ino))
                mine[place] = mine.get(place, 0) + st.st_blocks * 512
            return stat.S_ISDIR(st.st_mode) and (st.st_uid in enter or bool(st.st_mode & 0o022))
        trees.walk_path(place, visit)
    return usage


def used_bytes(places):
    """An upper bound of what any slot can hold in memory-backed shared memory, bytes:
    what the file systems of ``places`` hold in all (``statvfs``), or the kernel's
    ``Shmem`` (``/proc/meminfo``: every tmpfs, ``memfd`` and System V segment) when that
    is more. No disk I/O: cheap enough for the event loop."""
    total = 0
    for place in places:
        try:
            st = os.statvfs(place)
        except OSError:
            continue
        total += (st.f_blocks - st.f_bfree) * st.f_frsize
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"Shmem:"):
                    total = max(total, int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    return total


def open_deleted_bytes(uids, places):
    """``({uid: bytes}, {uid: bytes})``: files of ``places``' file systems that were
    deleted but are still open or mapped by a process of one of ``uids``, and that uid's
    memfds (``/proc/<pid>/fd`` and ``map_files``), each inode once: memory no walk
    sees. Blocking; needs root to read other uids'."""
    devs = set()
    for place in places:
        try:
            devs.add(os.stat(place).st_dev)
        except OSError:
            pass
    usage, memfds, seen = {}, {}, set()
    for pid in isolation.pids_of_uids(uids):
        for sub in ("fd", "map_files"):
            base = "/proc/%d/%s/" % (pid, sub)
            try:
                names = os.listdir(base)
            except OSError:
                continue
            for name in names:
                try:
                    st = os.stat(base + name)  # the open file itself, even deleted
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen or not stat.S_ISREG(st.st_mode):
                    continue
                if st.st_dev in devs and st.st_nlink == 0:
                    seen.add(key)
                    usage[st.st_uid] = usage.get(st.st_uid, 0) + st.st_blocks * 512
                elif st.st_dev not in devs and _is_memfd(base + name):
                    seen.add(key)
                    memfds[st.st_uid] = memfds.get(st.st_uid, 0) + st.st_blocks * 512
    return usage, memfds


def _is_memfd(link):
    try:
        return os.readlink(link).startswith("/memfd:")
    except OSError:
        return False


def measure(uids, places, slot_uids, share):
    """``{uid: {place: bytes}}`` as :func:`owned_bytes`, plus ``"(deleted, still open)"``
    (:func:`open_deleted_bytes`), ``"memfd"`` and ``"System V shared memory"``. When no
    more than ``share`` bytes are in memory-backed shared memory at all
    (:func:`used_bytes`, O(1)) no slot can be past it and nothing is walked."""
    if used_bytes(places) <= share:
        return {uid: {} for uid in uids}
    usage = owned_bytes(uids, places, slot_uids)
    deleted, memfds = open_deleted_bytes(set(uids), places)
    for label, per_uid in (("(deleted, still open)", deleted), ("memfd", memfds),
                           ("System V shared memory", sysvipc.shm_bytes(set(uids)))):
        for uid, n in per_uid.items():
            if n and uid in usage:
                usage[uid][label] = n
    return usage


def purge(uid, places, slot_uids=()):
    """Kill every process of ``uid``, then remove what it owns under ``places``, however
    deep (its own directories with all they hold; other directories entered as by
    :func:`owned_bytes`). Blocking."""
    isolation.purge_uid(uid, places)  # its processes, and what it owns at the top

    def visit(fd, name, st):
        if st.st_uid == uid:
            if stat.S_ISDIR(st.st_mode):
                trees.remove_at(fd, name)
            else:
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
            return False
        return stat.S_ISDIR(st.st_mode) and (st.st_uid in slot_uids or bool(st.st_mode & 0o022))

    for place in places:
        trees.walk_path(place, visit)


class ShmWatch:
    """The watch of one agent (see the module doc).

    Args:
        agent: the agent (``loop``, ``slots``, ``closing``, ``executor``, ``own``).
        places: the memory-backed shared places (:func:`memory_backed`).
        mib, source: the share per slot (MiB) and where it came from (:func:`share_of`).
    """

    def __init__(self, agent, places, mib, source):
        self.agent = agent
        self.places = list(places)
        self.mib = mib
        self.source = source
        self.hits = {}  # slot index -> the message its next bash result carries
        self.epochs = {}  # slot index -> how many resets it had (a new tenant each)

    def caps(self):
        """What status shows (``caps["tmpfs"]`` of a slot without bubblewrap)."""
        return {"mib": self.mib, "places": list(self.places), "source": self.source,
                "enforced": "watched: what the slot's uid owns in %s (memory-backed, shared by "
                            "the sandbox's slots) counts against its memory share (%s); measured "
                            "every %gs while the slot is in use (its commands and the processes "
                            "they left) and when each command ends; past it the slot's processes "
                            "are stopped and its files there removed, and the result says so"
                            % (", ".join(self.places), self.source, DISK_WATCH_S)}

    def start(self):
        self.agent.own(self._watch())

    def reset(self, slot):
        """``slot`` is being reset (its release purges its uid): forget its tenant's hit
        and make a measurement taken before void."""
        self.hits.pop(slot.index, None)
        self.epochs[slot.index] = self.epochs.get(slot.index, 0) + 1

    def _measure(self, slots):
        uids = [s.uid for s in slots]
        return self.agent.loop.run_in_executor(
            self.agent.executor("shm"), measure, uids, self.places, self.slot_uids(),
            self.mib * 1024 * 1024)

    def slot_uids(self):
        return frozenset(s.uid for s in self.agent.slots.values() if s.uid is not None)

    def _over(self, per_place):
        return sum(per_place.values()) > self.mib * 1024 * 1024

    async def _watch(self):
        while not self.agent.closing:
            await asyncio.sleep(DISK_WATCH_S)
            slots = [s for s in self.agent.slots.values() if s.dirty and s.uid is not None]
            if not slots or used_bytes(self.places) <= self.mib * 1024 * 1024:
                continue  # no slot can be past its share (statvfs, on the loop: no I/O)
            try:
                await self._tick(slots)
            except Exception as exc:  # noqa: BLE001 - the watch must go on
                sys.stderr.write("hermes-modal-tool agent: shm watch: %s: %s\n"
                                 % (type(exc).__name__, exc))

    async def _tick(self, slots):
        epochs = {s.index: self.epochs.get(s.index, 0) for s in slots}
        usage = await self._measure(slots)
        for slot in slots:
            # A slot reset meanwhile was purged by its reset (maybe a new tenant now).
            if epochs[slot.index] == self.epochs.get(slot.index, 0) and self._over(usage[slot.uid]):
                how = "running" if slot.shell.collector is not None else "background"
                await self._enforce(slot, usage[slot.uid], how)

    async def _enforce(self, slot, per_place, how):
        message = self.message(per_place, how)
        self.hits[slot.index] = message
        if how == "running":
            slot.shell.cancel(message)
        await self.agent.loop.run_in_executor(
            self.agent.executor("shm"), purge, slot.uid, self.places, self.slot_uids())

    def message(self, per_place, how):
        """The error a result carries once a slot went past its share; ``how``: its
        command was ``"running"``, had ``"ended"``, or a ``"background"`` process wrote."""
        where = ", ".join("%s %.1f MiB" % (p, b / _MIB) for p, b in sorted(per_place.items()) if b)
        return ("the slot's memory limit (its share: %d MiB, from %s) was exceeded by what it "
                "holds in the sandbox's memory-backed shared places: %.1f MiB (%s) %s"
                % (self.mib, self.source, sum(per_place.values()) / _MIB, where,
                   _HOW[how]))

    def checked(self, slot, done):
        """Wrap a bash call's ``done``: measure the slot once more before the result goes
        out (enforcing the share), and say so when it went past it, now or since its last
        bash result."""
        agent = self.agent

        def finish(result):
            if agent.closing:
                done(result)
                return

            def report():
                message = self.hits.pop(slot.index, None)
                if message is not None:
                    result["error"] = message
                    if result.get("returncode") in (0, None):
                        result["returncode"] = 1
                    data = result.get("data")
                    if isinstance(data, dict):
                        data.setdefault("limits_hit", []).append("memory")
                done(result)

            async def measure_then_report():
                try:
                    epoch = self.epochs.get(slot.index, 0)
                    usage = await self._measure([slot])
                    if epoch == self.epochs.get(slot.index, 0) and self._over(usage[slot.uid]):
                        await self._enforce(slot, usage[slot.uid], "ended")
                except asyncio.CancelledError:  # the agent stops: answer as it is
                    done(result)
                    raise
                except Exception:  # noqa: BLE001 - a failed measurement changes nothing
                    pass
                report()

            # The usual case costs one statvfs per place on the loop (tmpfs: no I/O).
            if used_bytes(self.places) <= self.mib * 1024 * 1024:
                report()
            else:
                agent.own(measure_then_report())
        return finish


def plan(agent, limits, slots):
    """``(ShmWatch, "")``, or ``(None, why)``: slots run with bubblewrap (their places are
    their own capped tmpfs), have no uid of their own, or nothing needs it."""
    if agent.isolation == "bwrap":
        return None, "slots run with bubblewrap"
    if agent.uid_base is None:
        return None, ("slots share the agent's uid (it is not root), so what each wrote "
                      "to the sandbox's /tmp, /var/tmp and /dev/shm cannot be told apart")
    mib, source = share_of(limits, slots)
    if not mib:
        return None, "no memory limit to share"
    places = memory_backed()
    if not places:
        return None, ("none needed: none of %s is memory-backed here (slot_disk caps what "
                      "a slot writes there when set)" % ", ".join(SHARED_PLACES))
    return ShmWatch(agent, places, mib, source), ""
