"""Filesystem snapshots (``Sandbox.snapshot_filesystem``) and ``Image.from_id``.

As Modal documents it: ``snapshot_filesystem()`` returns an :class:`modal.Image` of the
sandbox's filesystem as it is now; sandboxes created with that image start from it.
The SDK (1.6) asks the task command router (``TaskSnapshotFilesystem``: the task, a
client-made ``snapshot_id``, a TTL) and gets an image id; ``Image.from_id`` looks an
image up again (``ImageFromId``).

Here a container's filesystem is the host's (read-only) plus its writable directories
(``/tmp``, ``/root``, ``/workspace``, ...; see ``WRITABLE_DIRS``): a snapshot copies
those into ``<state>/images/<image_id>/fs``, and a sandbox made from it starts with a
copy. Sockets and device files are not copied, nor the hermes-modal-tool agent's own
state in ``/tmp`` (mounts and layers of a running agent, meaningless elsewhere).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from grpclib import GRPCError, Status
from modal_proto import api_pb2
from modal_proto import task_command_router_pb2 as sr_pb2

from ._common import WRITABLE_DIRS
from ._records import _IMAGES, ImageRecord

AGENT_STATE_PREFIX = ".hermes-modal-tool"


def _ignore(directory: str, names: list[str]) -> set[str]:
    skipped = set()
    for name in names:
        if name.startswith(AGENT_STATE_PREFIX):
            skipped.add(name)
            continue
        try:
            mode = os.lstat(os.path.join(directory, name)).st_mode
        except OSError:
            skipped.add(name)
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skipped.add(name)
    return skipped


def copy_fs(src: Path, dst: Path) -> None:
    """Copy a container's writable directories (``src/<sub>``) into ``dst/<sub>``."""
    for sub, _mode in WRITABLE_DIRS.values():
        if (src / sub).is_dir():
            shutil.copytree(src / sub, dst / sub, symlinks=True, ignore=_ignore, dirs_exist_ok=True)


class _FsSnapshots:
    """``TaskSnapshotFilesystem`` and ``ImageFromId``; a part of :class:`LocalModalServer`."""

    async def _task_snapshot_filesystem(self, req: Any, stream: Any) -> Any:
        sb = self._router_sandbox(req.task_id, stream)
        if sb.result is not None:
            raise GRPCError(Status.FAILED_PRECONDITION, f"Task {req.task_id} has already finished")
        if not req.snapshot_id:
            raise GRPCError(Status.INVALID_ARGUMENT, "snapshot_id must be set")
        base = _IMAGES.get(sb.record.image_id)
        image_id = "im-" + hashlib.sha256(f"{sb.record.sandbox_id}/{req.snapshot_id}".encode()).hexdigest()[:22]
        if image_id not in _IMAGES:  # a retry of the same snapshot_id gets the same image
            target = self.state_dir / "images" / image_id / "fs"
            await asyncio.to_thread(copy_fs, sb.fs, target)
            record = ImageRecord(image_id, base.tag if base else "", list(base.commands) if base else [],
                                 base.builder_version if base else "", base.python_version if base else None,
                                 fs_snapshot=target, snapshot_of=sb.record.sandbox_id)
            self.images[image_id] = record
            _IMAGES[image_id] = record
        return sr_pb2.TaskSnapshotFilesystemResponse(image_id=image_id)

    async def _image_from_id(self, req: Any, stream: Any) -> Any:
        record = _IMAGES.get(req.image_id) or self.images.get(req.image_id)
        if record is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {req.image_id} not found")
        return api_pb2.ImageFromIdResponse(image_id=record.image_id, metadata=self._image_metadata(record))

    @staticmethod
    def _restore_fs(record: Any, root: Path) -> None:
        """Give a new sandbox its image's snapshot (when the image is one)."""
        snap = getattr(record, "fs_snapshot", None)
        if snap is not None and Path(snap).is_dir():
            copy_fs(Path(snap), root / "fs")
