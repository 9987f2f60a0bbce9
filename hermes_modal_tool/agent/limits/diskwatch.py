"""The ``slot_disk`` limit, watched: measured, since the file system here has no quotas.

Stdlib-only, Python 3.8. While a bash command runs in a slot with a layered root, its
writable layer is measured every :data:`DISK_WATCH_S` in one worker thread (never on the
event loop) and the command is stopped past the limit; once more when it ends, before its
result goes out. A slot without bubblewrap (its own uid, no mount namespace) is measured
as its workspace plus what its uid owns in the sandbox's shared ``/tmp``, ``/var/tmp``
and ``/dev/shm`` (:func:`uid_usage_bytes`). A file size rlimit (see :mod:`.slot`) stops
any single file at the limit. What such a slot holds in the memory-backed ones counts
against its memory share too, with or without ``slot_disk`` (:mod:`.shmwatch`).
"""

import asyncio
import stat

from ..fs.trees import walk_path
from . import usage

#: Where a slot without bubblewrap can write besides its workspace (shared by all slots).
SHARED_PLACES = ("/tmp", "/var/tmp", "/dev/shm")


def watched(agent, slot):
    """Is ``slot``'s disk use watched against ``slot_disk``? Not where the kernel
    enforces it (:mod:`.slotdisk`)."""
    return bool(agent.slot_disk_mb) and (
        (slot.root is not None and getattr(agent, "layer_disks", None) is None)
        or (agent.isolation != "bwrap" and slot.uid is not None))


def usage_fn(slot):
    """A blocking ``() -> bytes`` measuring what ``slot`` wrote (see the module doc)."""
    if slot.root is not None:
        return lambda: layer_bytes(slot.root)
    return lambda: uid_usage_bytes(slot.uid, slot.ws_host, SHARED_PLACES)


#: A slot's bytes in its layer in use (see :func:`.usage.layer_bytes`).
layer_bytes = usage.layer_bytes


def uid_usage_bytes(uid, workspace, shared):
    """Bytes (blocks) of everything in ``workspace`` plus what ``uid`` owns under each of
    ``shared``; each inode counted once. Walked with directory descriptors that never
    follow a link or cross a mount (``trees.walk_tree``); a tree changed meanwhile ends
    its walk early (what was counted is returned)."""
    seen = set()
    total = [0]

    def counter(mine_only):
        def visit(fd, name, st):
            if (not mine_only or st.st_uid == uid) and (st.st_dev, st.st_ino) not in seen:
                if st.st_nlink > 1:
                    seen.add((st.st_dev, st.st_ino))
                total[0] += st.st_blocks * 512
            return stat.S_ISDIR(st.st_mode)
        return visit

    for top, mine_only in [(workspace, False)] + [(p, True) for p in shared]:
        walk_path(top, counter(mine_only))
    return total[0]

#: How often a running command's slot is measured against its ``slot_disk`` limit (s).
DISK_WATCH_S = 0.5


class DiskWatch:
    """Mixed into the agent: needs ``loop``, ``closing``, ``slot_disk_mb`` and ``executor``."""

    def _disk_over(self, used):
        return used > self.slot_disk_mb * 1024 * 1024

    def _disk_message(self, used):
        return ("the slot's disk limit (slot_disk = %d MiB) was exceeded: %.1f MiB written; "
                "the command was stopped. Remove files to go on."
                % (self.slot_disk_mb, used / 1048576.0))

    async def _watch_disk(self, slot, collector):
        """While the command runs, measure the slot's writable layer every
        :data:`DISK_WATCH_S` (in a worker thread) and stop the command past the limit."""
        while collector is not None and collector.ended is None:
            await asyncio.sleep(DISK_WATCH_S)
            if collector.ended is not None or slot.shell.collector is not collector:
                return
            used = await self.loop.run_in_executor(self.executor("disk"), usage_fn(slot))
            usage.disk_seen(slot, used)  # the tenant's peak (usage.py)
            if self._disk_over(used) and slot.shell.collector is collector:
                slot.shell.cancel(self._disk_message(used))
                return

    def _disk_full_checked(self, slot, done):
        """Where the kernel enforces the limit (:mod:`.slotdisk`): name it in a bash
        call's result when the command filled the slot's layer (full as it ends, not as it
        was queued: a layer something else filled meanwhile, a file tool or a process
        left running, is not this command's doing). Two ``fstatfs`` of the layer's
        descriptor per call, on the loop (O(1))."""
        disks = self.layer_disks

        def disk():
            layer = slot.root.active if slot.root is not None else None
            return layer.disk if layer is not None else None

        def full():
            mfd = disk()
            return mfd is not None and disks.full(mfd)

        was_full = full()

        def finish(result):
            if not was_full and full():
                _disk_hit(result, "the slot's disk is full (slot_disk = %d MiB, %d inodes, "
                                  "enforced by the kernel): writes in the slot fail with ENOSPC. "
                                  "Remove files to go on." % (disks.size_mb, disks.inodes))
            done(result)
        return finish

    def _disk_checked(self, slot, done):
        """Wrap a bash call's ``done``: measure the writable layer once more before the
        result goes out, and say so when the command went past the limit."""
        def finish(result):
            def measured(fut):
                try:
                    used = fut.result()
                except Exception:  # noqa: BLE001 - a failed measurement changes nothing
                    used = 0
                usage.disk_seen(slot, used)
                if self._disk_over(used):
                    _disk_hit(result, self._disk_message(used).replace(
                        "the command was stopped", "the command ended"))
                done(result)

            if self.closing:
                done(result)
                return
            fut = self.loop.run_in_executor(self.executor("disk"), usage_fn(slot))
            fut.add_done_callback(measured)
        return finish


def _disk_hit(result, message):
    """Mark a bash result whose command went past ``slot_disk``: ``message`` as its error
    (unless it has one), exit code 1 in place of 0, and ``"disk"`` in ``limits_hit``."""
    if not result.get("error"):
        result["error"] = message
        if result.get("returncode") == 0:
            result["returncode"] = 1
    data = result.get("data")
    if isinstance(data, dict):
        data.setdefault("limits_hit", []).append("disk")
