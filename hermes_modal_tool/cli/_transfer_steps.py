"""``batch`` steps that move files: ``upload`` (this machine -> the slot) and ``download``
(the slot -> this machine), beside the agent's tools.

A step is ``{"tool": "upload", "args": {"local": PATH, "remote": PATH}}`` (or
``"download"``): a file or a directory, through ``backend.upload``/``backend.download``
(chunked over the sandbox's stream, checksummed, written with the slot's credentials).
``"resume": true`` resumes what an earlier step or run left: files the receiving side
holds whole are kept, a partial file goes on from where it stopped (``resume=True`` of
``backend.upload``/``download``).
``local`` is relative to the current directory (as ``cp``'s are); ``remote`` to the slot's
workspace unless absolute. Why not ``hermes-modal-tool cp SLOT:PATH``: a slot lives only
as long as the process that acquired it (the CLI holds no session another process could
address), so a copy belongs in the batch that holds the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from ..backend import ToolBackend
from ..errors import HermesModalToolError
from ..slots import ExecutionResult, Slot

#: The batch steps this module runs (not agent tools).
TRANSFER_TOOLS = ("upload", "download")


def check_transfer_args(tool: str, args: dict[str, Any]) -> str | None:
    """What is wrong with a transfer step's ``args`` (None: nothing)."""
    unknown = set(args) - {"local", "remote", "resume"}
    if unknown:
        return (f"{tool}: unknown argument(s) {', '.join(map(repr, sorted(unknown)))}; "
                "give 'local' and 'remote' (and 'resume': true or false)")
    for key in ("local", "remote"):
        value = args.get(key)
        if not isinstance(value, str) or not value or "\x00" in value:
            return f"{tool}: '{key}' must be a non-empty path, got {value!r:.80}"
    if not isinstance(args.get("resume", False), bool):
        return f"{tool}: 'resume' must be true or false, got {args['resume']!r:.80}"
    return None


def _drop_if_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            os.unlink(path)


async def run_call(backend: ToolBackend, slot: Slot, tool: str, args: dict[str, Any],
                   timeout: float | None, on_output: Callable[..., Any] | None = None) -> ExecutionResult:
    """Run one batch step in ``slot``: an agent tool through ``execute_batch`` (with
    ``timeout`` seconds and ``on_output``), or a transfer step; a transfer that fails
    is a failed :class:`ExecutionResult` (``returncode`` None, ``error`` naming the paths
    and why), not an exception."""
    if tool not in TRANSFER_TOOLS:
        [r] = await backend.execute_batch([(slot, tool, args)], timeout_s=timeout, on_output=on_output)
        return r
    started = time.monotonic()
    local, remote, resume = args["local"], args["remote"], bool(args.get("resume"))
    existed = await asyncio.to_thread(os.path.lexists, local)
    try:
        if tool == "upload":
            moved = await backend.upload(slot, local, remote, resume=resume)
        else:
            moved = await backend.download(slot, remote, local, resume=resume)
    except (HermesModalToolError, OSError) as exc:
        if tool == "download" and not existed:  # nothing came: leave no empty file behind
            await asyncio.to_thread(_drop_if_empty, local)
        return ExecutionResult.failure(f"{tool} {local!r} {'->' if tool == 'upload' else '<-'} "
                                       f"{remote!r}: {exc}", slot.slot_id,
                                       duration_s=round(time.monotonic() - started, 6))
    what = f"{moved.files} file{'s' if moved.files != 1 else ''}, {moved.bytes} bytes"
    if resume:
        what += f", {moved.kept} kept"
    text = (f"uploaded {local} to {remote} ({what})" if tool == "upload"
            else f"downloaded {remote} to {local} ({what})")
    if moved.sha256:
        text += f", sha256 {moved.sha256}"
    return ExecutionResult(success=True, output=text + "\n", slot_id=slot.slot_id, metadata={
        "returncode": 0, "duration_s": round(time.monotonic() - started, 6), "timed_out": False,
        "truncated": False, "bytes": moved.bytes, "files": moved.files, "sha256": moved.sha256,
        "kept": moved.kept})
