"""The ``slot_disk`` limit, watched: measured, since the file system here has no quotas.

Stdlib-only, Python 3.8. While a bash command runs in a slot with a layered root, its
writable layer is measured every :data:`DISK_WATCH_S` in one worker thread (never on the
event loop) and the command is stopped past the limit; once more when it ends, before its
result goes out. A file size rlimit (see :mod:`.slot`) stops any single file at the limit.
"""

import asyncio

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
            used = await self.loop.run_in_executor(self.executor("disk"), slot.root.usage_bytes)
            if self._disk_over(used) and slot.shell.collector is collector:
                slot.shell.cancel(self._disk_message(used))
                return

    def _disk_checked(self, slot, done):
        """Wrap a bash call's ``done``: measure the writable layer once more before the
        result goes out, and say so when the command went past the limit."""
        def finish(result):
            def measured(fut):
                try:
                    used = fut.result()
                except Exception:  # noqa: BLE001 - a failed measurement changes nothing
                    used = 0
                if self._disk_over(used):
                    if not result.get("error"):
                        result["error"] = self._disk_message(used).replace(
                            "the command was stopped", "the command ended")
                        if result.get("returncode") == 0:
                            result["returncode"] = 1
                    data = result.get("data")
                    if isinstance(data, dict):
                        data.setdefault("limits_hit", []).append("disk")
                done(result)

            if self.closing:
                done(result)
                return
            fut = self.loop.run_in_executor(self.executor("disk"), slot.root.usage_bytes)
            fut.add_done_callback(measured)
        return finish
