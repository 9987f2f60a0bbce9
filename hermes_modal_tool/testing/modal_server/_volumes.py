"""Modal Volumes: a host directory per Volume under the server's state directory, mounted
into the containers of the sandboxes created with it.

What the SDK's ``modal.Volume.from_name(...)`` and ``Sandbox.create(volumes=...)`` send:
``VolumeGetOrCreate`` (by name; ``create_if_missing`` creates it, as ``modal volume
create`` does with ``CREATE_FAIL_IF_EXISTS``), then the sandbox definition's
``volume_mounts`` (volume id, mount path, ``read_only``, ``sub_path``). ``VolumeDelete``
removes one. Files are put in on the host (:meth:`_Volumes.volume_path`), not through
``VolumePutFiles2``; writes in a container are seen at once by every container that
mounts the Volume (Modal shows them to other containers after a commit/reload).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from ._common import _new_id

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class _Volumes:
    """Modal Volumes of the local control plane.

    A part of :class:`LocalModalServer` (a mixin): it uses the server's state.
    """

    _volume_ids: dict[tuple[str, str], str]  # (environment, name) -> volume id
    _volume_dirs: dict[str, Path]  # volume id -> its host directory

    def create_volume(self, name: str, environment: str = "main") -> Path:
        """Create the Volume ``name`` (as ``modal volume create NAME`` would) and return
        its host directory; an existing one is kept. Call it on any thread.

        Raises:
            ValueError: ``name`` is not a Modal object name.
        """
        if not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a valid Volume name")
        key = (environment, name)
        if key not in self._volume_ids:
            volume_id = _new_id("vo")
            path = self.state_dir / "volumes" / volume_id  # type: ignore[attr-defined]
            path.mkdir(parents=True, mode=0o755)
            os.chmod(path, 0o755)
            self._volume_dirs[volume_id] = path
            self._volume_ids[key] = volume_id
        return self._volume_dirs[self._volume_ids[key]]

    def volume_path(self, name: str, environment: str = "main") -> Path:
        """The host directory of the existing Volume ``name`` (put files in there).

        Raises:
            KeyError: there is no such Volume.
        """
        return self._volume_dirs[self._volume_ids[(environment, name)]]

    async def _volume_get_or_create(self, req: Any, stream: Any) -> api_pb2.VolumeGetOrCreateResponse:
        env = req.environment_name or "main"
        name = req.deployment_name
        kind = req.object_creation_type
        if kind in (api_pb2.OBJECT_CREATION_TYPE_EPHEMERAL,
                    api_pb2.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP):
            name = _new_id("ephemeral")
        elif not _NAME.fullmatch(name):
            raise GRPCError(Status.INVALID_ARGUMENT, f"Invalid Volume name: '{name}'")
        exists = (env, name) in self._volume_ids
        if kind == api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS and exists:
            raise GRPCError(Status.ALREADY_EXISTS, f"Volume '{name}' already exists")
        if not exists and kind == api_pb2.OBJECT_CREATION_TYPE_UNSPECIFIED:
            raise GRPCError(Status.NOT_FOUND, f"Volume '{name}' not found in environment '{env}'")
        self.create_volume(name, env)
        version = req.version or api_pb2.VOLUME_FS_VERSION_V2
        return api_pb2.VolumeGetOrCreateResponse(
            volume_id=self._volume_ids[(env, name)], version=version,
            metadata=api_pb2.VolumeMetadata(name=name, version=version,
                                            creation_info=api_pb2.CreationInfo(created_at=time.time())))

    async def _volume_delete(self, req: Any, stream: Any) -> Any:
        for key, volume_id in list(self._volume_ids.items()):
            if volume_id == req.volume_id:
                del self._volume_ids[key]
                shutil.rmtree(self._volume_dirs.pop(volume_id), ignore_errors=True)
                return empty_pb2.Empty()
        raise GRPCError(Status.NOT_FOUND, f"Volume {req.volume_id} not found")

    def _volume_mounts(self, definition: Any) -> list[tuple[str, str, bool]]:
        """A sandbox definition's Volumes as (host directory, mount path, read-only).

        Raises:
            GRPCError: NOT_FOUND for an unknown volume id, INVALID_ARGUMENT for a bad path.
        """
        mounts = []
        for m in definition.volume_mounts:
            host = self._volume_dirs.get(m.volume_id)
            if host is None:
                raise GRPCError(Status.NOT_FOUND, f"Volume {m.volume_id} not found")
            path = m.mount_path
            if not path.startswith("/") or path in ("/", "/root", "/tmp") or ".." in path.split("/"):
                raise GRPCError(Status.INVALID_ARGUMENT, f"Volume mount path {path!r} is not allowed")
            if m.sub_path:  # "created when the container starts up" (Volume.with_mount_options)
                parts = [p for p in m.sub_path.split("/") if p]
                if any(p == ".." for p in parts):
                    raise GRPCError(Status.INVALID_ARGUMENT, f"bad sub_path {m.sub_path!r}")
                host = host.joinpath(*parts)
                host.mkdir(parents=True, exist_ok=True)
            mounts.append((str(host), path, m.read_only))
        return mounts

    @staticmethod
    def _volume_binds(mounts: list[tuple[str, str, bool]], root: Path | None) -> list[str]:
        """bwrap arguments mounting a sandbox's Volumes (read-only ones with --ro-bind) on
        a container whose root is ``root`` (None: the host's). Mount points the root
        lacks are made mode 0755, as a container's are (bwrap's own would be 0700)."""
        args: list[str] = []
        top = root or Path("/")
        for host, path, read_only in mounts:
            parts = [p for p in path.split("/") if p]
            for i in range(1, len(parts) + 1):
                if not top.joinpath(*parts[:i]).exists():
                    args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
            args += ["--ro-bind" if read_only else "--bind", host, path]
        return args
