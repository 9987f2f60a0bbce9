"""The backend's artifact helpers (a part of :class:`ToolBackend`): reading, listing and
archiving a slot's files, each one tool call through ``execute``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .slots import ExecutionResult, Slot


class ArtifactMethods:
    """Mixed into :class:`~hermes_modal_tool.backend.ToolBackend`."""

    if TYPE_CHECKING:
        async def execute(self, slot: Slot, tool: str, args: Mapping[str, Any],
                          timeout_s: float | None = None) -> ExecutionResult: ...  # ToolBackend's

    async def read_artifact(self, slot: Slot, path: str, *, encoding: str = "text",
                            max_bytes: int | None = None, include_sha256: bool = False,
                            timeout_s: float | None = None) -> dict[str, Any]:
        """Read a file of the slot (a path relative to its workspace, or absolute in its view).

        Args:
            max_bytes: read at most this many bytes (at most 64 MiB); default the
                profile's ``output_limit`` as bytes (the agent holds and sends what it
                reads: every per-call buffer is bounded by the call's cap). ``truncated``
                says when the file has more.

        Returns:
            ``{"success", "content", "error", "size", "truncated"}`` plus ``sha256``
            when asked; ``content`` is text or base64 per ``encoding``.
        """
        r = await self.execute(slot, "read_artifact", {"path": path, "encoding": encoding,
                                                       "max_bytes": max_bytes,
                                                       "include_sha256": include_sha256}, timeout_s)
        out = {"success": r.success, "content": r.metadata.get("content", "") if r.success else "",
               "error": r.error}
        for key in ("size", "truncated", "sha256", "path"):
            if key in r.metadata:
                out[key] = r.metadata[key]
        return out

    async def list_artifacts(self, slot: Slot, path: str = ".", *, recursive: bool = False,
                             max_entries: int | None = None,
                             timeout_s: float | None = None) -> dict[str, Any]:
        """List files under ``path`` in the slot's workspace: ``{"success", "entries", "error"}``."""
        r = await self.execute(slot, "list_artifacts", {"path": path, "recursive": recursive,
                                                        "max_entries": max_entries}, timeout_s)
        return {"success": r.success, "entries": r.metadata.get("entries", []) if r.success else [],
                "error": r.error, "truncated": r.metadata.get("truncated", False)}

    async def archive_artifacts(self, slot: Slot, path: str = ".", *, archive_format: str = "tar.gz",
                                max_bytes: int | None = None, max_entries: int | None = None,
                                timeout_s: float | None = None) -> dict[str, Any]:
        """Archive ``path`` (symlinks stored, never followed): ``{"success", "archive_base64", "format", "error"}``."""
        r = await self.execute(slot, "archive_artifacts", {"path": path, "archive_format": archive_format,
                                                           "max_bytes": max_bytes,
                                                           "max_entries": max_entries}, timeout_s)
        return {"success": r.success, "archive_base64": r.metadata.get("archive_base64", "") if r.success else "",
                "format": archive_format, "error": r.error, "entries": r.metadata.get("entries", 0)}
