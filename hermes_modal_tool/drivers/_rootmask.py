"""The host's root-only files, hidden from slots whose layered root is the host's own
(local driver).

A slot is root over the host's root-owned files (its layered root maps host uid 0 to the
slot's root), so those only root may read are masked in its root.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading

from ..agent.fs.rootplan import under_empty_dir

log = logging.getLogger("hermes_modal_tool")

#: Where the host keeps files only root may read (``root:root``, no read bit for others).
#: A slot is root over the host's root-owned files (its layered root maps host uid 0 to
#: the slot's root), so these are hidden from it. ``/usr`` is not scanned (too large to
#: scan at start; it holds programs and libraries), nor the directories slots see empty.
MASK_SCAN = ("/etc", "/var", "/opt", "/srv", "/boot", "/usr/local")
MASK_SCAN_LIMIT = 500_000
_masked: list[str] | None = None
_masked_lock = threading.Lock()


async def root_only_files() -> list[str]:
    """The host's root-only files and directories under :data:`MASK_SCAN` (scanned once per
    process, in a thread; about 0.5 s on a Debian host). Directories found are hidden whole."""
    if _masked is None:
        return await asyncio.to_thread(_scan_root_only)
    return _masked


def _scan_root_only() -> list[str]:
    global _masked
    with _masked_lock:
        if _masked is None:
            _masked = _scan(MASK_SCAN)
    return _masked


def _scan(tops: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    seen = 0
    stack = [p for p in tops if os.path.isdir(p) and not os.path.islink(p)]
    while stack and seen < MASK_SCAN_LIMIT:
        path = stack.pop()
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError:
            continue
        for entry in entries:
            seen += 1
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == 0 and st.st_gid == 0 and not st.st_mode & 0o004 \
                    and not stat.S_ISLNK(st.st_mode):
                found.append(entry.path)
            elif stat.S_ISDIR(st.st_mode) and not under_empty_dir(entry.path):
                stack.append(entry.path)
    if stack:
        log.warning("the scan for root-only host files stopped after %d entries; files "
                    "under %s were not checked", seen, ", ".join(stack[:3]))
    return sorted(found)
