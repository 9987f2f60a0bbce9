"""Volumes: a host directory bound into every slot of a profile, read-only by default.

A profile's ``volumes: [{source, target, read_only}]`` (see :class:`Volume`) is passed
to the sandbox's agent in its ``init`` config; the agent adds one bind mount per volume
to each slot's bubblewrap command line (``hermes_modal_tool/agent/fs/volumes.py``). The
directory is shared, not copied: one page cache for every slot that reads it.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

#: Where a volume may not go: the slot's system directories (and what is under them).
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
               "/run", "/sbin", "/sys", "/tmp", "/usr", "/var")


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
        source: local driver: an existing directory on the host (absolute path).
        target: where slots see it (absolute; not on or above a system directory,
            :data:`SYSTEM_DIRS`, nor the profile's ``workspace_base``).
        read_only: True (the default): slots can read it, and neither a bind flag nor
            the kernel's permission checks let them write (their uid outside owns
            nothing there). False: a writable volume, shared by every slot of the
            profile (each writes as its own unprivileged uid, so ``source`` must be
            writable by them, e.g. mode 1777); slots see each other's files there.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="The host directory (local driver), absolute.")
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
        return _normal(value, "source")

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
        if driver == "local":
            vol.check_source()
        else:
            raise ValueError(f"volume {vol.target!r}: the {driver} driver does not mount volumes "
                             "yet (the local driver binds host directories)")


def agent_config(volumes: list[Volume]) -> list[dict[str, object]]:
    """The volumes as the agent's ``init`` config takes them."""
    return [{"source": v.source, "target": v.target, "read_only": v.read_only} for v in volumes]
