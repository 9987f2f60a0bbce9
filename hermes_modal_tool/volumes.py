"""Volumes: a directory bound into every slot of a profile, read-only by default.

A profile's ``volumes: [{source, target, read_only}]`` (see :class:`Volume`) is passed
to the sandbox's agent in its ``init`` config; the agent adds one bind mount per volume
to each slot's bubblewrap command line (``hermes_modal_tool/agent/fs/volumes.py``). The
directory is shared, not copied: one page cache for every slot that reads it.

The local driver binds a host directory (``source`` an absolute path). The Modal driver
mounts a Modal Volume (``source: "modal:NAME"``) into the sandbox's container at
``target`` (``hermes_modal_tool/drivers/_modal_volumes.py``), and the agent binds that
into each slot as it binds a host directory.
"""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

#: Where a volume may not go: the slot's system directories (and what is under them).
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
               "/run", "/sbin", "/sys", "/tmp", "/usr", "/var")

#: How a Modal Volume is named in ``source``: ``modal:NAME``.
MODAL_PREFIX = "modal:"
#: Modal's rule for object names (``modal._utils.name_utils.is_valid_object_name``).
_MODAL_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_APP_ID = re.compile(r"ap-[A-Za-z0-9]{22}")


def modal_volume_name(source: str) -> str | None:
    """The Modal Volume ``source`` names (``"modal:NAME"`` -> ``"NAME"``), else None."""
    return source[len(MODAL_PREFIX):] if source.startswith(MODAL_PREFIX) else None


def _normal(path: str, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path or "\n" in path:
        raise ValueError(f"{what} must be an absolute path, got {path!r}")
    parts = [p for p in path.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"{what} must be an absolute path below '/' without '.' or '..', got {path!r}")
    return "/" + "/".join(parts)


def overlaps(a: str, b: str) -> bool:
    """Whether one of two normalised absolute paths is the other or under it."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


class Volume(BaseModel):
    """A directory every slot of a profile sees at ``target``.

    Attributes:
        source: local driver: an existing directory on the host (absolute path). Modal
            driver: ``"modal:NAME"``, an existing Modal Volume in the client's environment
            (NAME: letters, digits, ``-``, ``_``, ``.``; at most 64 characters, as Modal
            names objects), mounted into the sandbox's container at ``target``.
        target: where slots see it (absolute; not on or above a system directory,
            :data:`SYSTEM_DIRS`, nor the profile's ``workspace_base``).
        read_only: True (the default): slots can read it, and neither a bind flag nor
            the kernel's permission checks let them write (their uid outside owns
            nothing there). False: a writable volume, shared by every slot of the
            profile (each writes as its own unprivileged uid, so ``source`` must be
            writable by them, e.g. mode 1777); slots see each other's files there. On
            Modal the slots of one sandbox share its mount at once; other sandboxes see
            the writes once Modal commits them (when the writing sandbox ends, or on a
            commit/reload, as Modal documents for Volumes).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="The host directory (local driver), absolute; or "
                                    "'modal:NAME', a Modal Volume (Modal driver).")
    target: str = Field(description="Where each slot sees it, absolute.")
    read_only: StrictBool = Field(True, description="False: writable and shared by the profile's slots (true or false, not a string).")

    @field_validator("target")
    @classmethod
    def _target(cls, value: str) -> str:
        value = _normal(value, "target")
        for system in SYSTEM_DIRS:
            if overlaps(value, system):
                raise ValueError(f"target {value!r} overlaps the slot's system directory {system}; "
                                 "choose a place of its own, such as /models or /datasets/x")
        return value

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        name = modal_volume_name(value) if isinstance(value, str) else None
        if name is None:
            return _normal(value, "source")
        if not _MODAL_NAME.fullmatch(name) or _APP_ID.fullmatch(name):
            raise ValueError(f"source {value!r} names no valid Modal Volume: a name has only "
                             "letters, digits, '-', '_' and '.', at most 64 characters "
                             "(e.g. 'modal:my-dataset')")
        return value

    def check_source(self) -> None:
        """Raise ValueError unless ``source`` is an existing directory on this host."""
        if not os.path.isdir(self.source):
            why = "does not exist" if not os.path.exists(self.source) else "is not a directory"
            raise ValueError(f"volume source {self.source!r} {why} (for target {self.target!r})")


def check_volumes(volumes: list[Volume], workspace_base: str, driver: str) -> None:
    """The checks that need the whole profile: targets apart from each other and from the
    workspace, and (local driver) each source an existing directory.

    Raises:
        ValueError: naming the volume and what is wrong.
    """
    for i, vol in enumerate(volumes):
        if overlaps(vol.target, workspace_base):
            raise ValueError(f"volume target {vol.target!r} overlaps workspace_base {workspace_base!r}")
        for other in volumes[:i]:
            if overlaps(vol.target, other.target):
                raise ValueError(f"volume targets {other.target!r} and {vol.target!r} overlap")
        modal_name = modal_volume_name(vol.source)
        if driver == "modal" and modal_name is None:
            raise ValueError(f"volume {vol.target!r}: the modal driver mounts Modal Volumes, "
                             f"so source must be 'modal:NAME', not the host path {vol.source!r}")
        if driver == "modal" and any(modal_volume_name(o.source) == modal_name for o in volumes[:i]):
            raise ValueError(f"volume {vol.target!r}: Modal Volume {modal_name!r} is mounted "
                             "twice (Modal mounts a Volume at one path per sandbox)")
        if driver == "local" and modal_name is not None:
            raise ValueError(f"volume {vol.target!r}: source {vol.source!r} names a Modal "
                             "Volume, which only the modal driver mounts (the local driver "
                             "binds a host directory: give its absolute path)")
        if driver == "local":
            vol.check_source()
        elif driver != "modal":
            raise ValueError(f"volume {vol.target!r}: the {driver} driver does not mount volumes")


def agent_config(volumes: list[Volume]) -> list[dict[str, object]]:
    """The volumes as the agent's ``init`` config takes them: ``source`` is where the
    directory is inside the sandbox (the host path; for a Modal Volume its mount point
    in the container, which is ``target``)."""
    return [{"source": v.target if modal_volume_name(v.source) else v.source,
             "target": v.target, "read_only": v.read_only} for v in volumes]
