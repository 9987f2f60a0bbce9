"""Deep Agents sandbox backend on a slot: :class:`SlotSandbox` (built on first use,
since importing Deep Agents takes seconds; import it from
:mod:`hermes_modal_tool.adapters.langchain`)."""

from __future__ import annotations

import base64
import shlex
import uuid
from typing import Any

from hermes_modal_tool.backend import ToolBackend
from hermes_modal_tool.capture import DEFAULT_MAX_BYTES, WHOLE_FILE_BYTES, run_captured
from hermes_modal_tool.errors import PoolTimeoutError, SandboxError, UsageError
from hermes_modal_tool.sessions import SlotSessions
from hermes_modal_tool.slots import ExecutionResult, Slot

from .backend_calls import NO_TIMEOUT_S, acall, call, new_key, thread_key

# -- Deep Agents backend -------------------------------------------------------------

_UPLOAD_SCRIPT = r"""(
x={xfer}
put() {{
  d=$(dirname -- "$2")
  [ -d "$d" ] || mkdir -p -- "$d" 2>/dev/null
  if [ -d "$2" ]; then echo "$1 is_directory"
  elif [ -e "$d" ] && [ ! -d "$d" ]; then echo "$1 invalid_path"
  elif [ ! -d "$d" ]; then echo "$1 permission_denied"
  elif [ ! -f "$x/$1" ]; then echo "$1 transfer_failed"
  elif cat -- "$x/$1" > "$2" 2>/dev/null; then echo "$1 ok"
  else echo "$1 permission_denied"
  fi
}}
{calls}
rm -rf -- "$x"
)"""

_DOWNLOAD_SCRIPT = r"""(
x={xfer}
mkdir -p -- "$x"
get() {{
  if [ -d "$2" ]; then echo "$1 is_directory"
  elif [ ! -e "$2" ]; then echo "$1 file_not_found"
  elif [ ! -r "$2" ]; then echo "$1 permission_denied"
  elif cat -- "$2" > "$x/$1" 2>/dev/null; then echo "$1 ok"
  else echo "$1 permission_denied"
  fi
}}
{calls}
)"""


def _statuses(result: ExecutionResult) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in result.output.splitlines():
        index, _, status = line.partition(" ")
        if index.isdigit():
            out[int(index)] = status
    return out


def slot_sandbox_class() -> type[Any]:
    """The SlotSandbox class (imports Deep Agents)."""
    from deepagents.backends.protocol import (
        ExecuteResponse,
        FileDownloadResponse,
        FileUploadResponse,
    )
    from deepagents.backends.sandbox import BaseSandbox

    class SlotSandbox(BaseSandbox):
        """A Deep Agents sandbox backend (``SandboxBackendProtocol``) on a slot, like
        ``langchain_modal.ModalSandbox`` on a Modal sandbox.

        ``execute`` runs in the slot's persistent shell (``cd`` and ``export``
        persist); ``upload_files``/``download_files`` move bytes through the
        workspace with the slot user's permissions, so any path the slot can
        reach works (the workspace, ``/tmp``). Deep Agents' file tools (ls,
        read, write, edit, grep, glob) are ``BaseSandbox``'s, built on those.

        Args:
            backend: the engine.
            trajectory_id: the slot key; None: the LangGraph ``thread_id`` of
                the current run (one slot per thread), else one slot per instance.
            profile: the profile slots come from.
            sessions: a :class:`SlotSessions` to share with a
                :class:`SandboxToolkit` (same thread, same slot).
            timeout_s: default per-command timeout (default: the profile's).
            max_output_bytes: the most output ``execute`` returns (bytes; more is
                cut and ``truncated`` is set). Output is not held to the profile's
                ``output_limit``: it goes to a file in the workspace and is read
                whole when it is too big for one reply (Deep Agents trims what the
                model sees itself).

        Example:
            >>> from deepagents import create_deep_agent
            >>> sandbox = SlotSandbox(backend, "task-1")  # doctest: +SKIP
            >>> agent = create_deep_agent(model=model, backend=sandbox)  # doctest: +SKIP
            >>> sandbox.execute("pwd").output  # doctest: +SKIP
            '/data/slot_0\\n'
        """

        def __init__(self, backend: ToolBackend, trajectory_id: str | None = None, *,
                     profile: str | None = None, sessions: SlotSessions | None = None,
                     timeout_s: float | None = None,
                     max_output_bytes: int = DEFAULT_MAX_BYTES) -> None:
            if sessions is not None and sessions.backend is not backend:
                raise UsageError("sessions belong to another backend")
            self.backend = backend
            self.sessions = sessions if sessions is not None else SlotSessions(backend)
            self.trajectory_id = trajectory_id
            self.profile = profile
            self.timeout_s = timeout_s
            if max_output_bytes < 1:
                raise UsageError(f"max_output_bytes must be positive, got {max_output_bytes!r}")
            self.max_output_bytes = max_output_bytes
            self.default_key = new_key()

        def key(self) -> str:
            """The slot key of the current call."""
            if self.trajectory_id:
                return self.trajectory_id
            try:
                from langgraph.config import get_config
                return thread_key(get_config()) or self.default_key
            except (ImportError, RuntimeError):  # outside a LangGraph run
                return self.default_key

        async def aslot(self) -> Slot:
            """The current key's slot (acquired now if needed)."""
            return await acall(self.backend, self.sessions.slot(self.key(), self.profile))

        def slot(self) -> Slot:
            return call(self.backend, self.sessions.slot(self.key(), self.profile))

        @property
        def id(self) -> str:
            """The slot id, ``"{sandbox_id}_slot_{N}"``."""
            return self.slot().slot_id

        async def aclose(self) -> int:
            """Release every slot this backend's sessions hold; return how many."""
            return await acall(self.backend, self.sessions.close_all())

        def close(self) -> int:
            return call(self.backend, self.sessions.close_all())

        # -- execute --------------------------------------------------------------
        def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
            """Run ``command`` in the slot's shell; timeout in seconds (0: no limit)."""
            return call(self.backend, self._execute(self.key(), command, timeout))

        async def aexecute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:  # noqa: ASYNC109
            return await acall(self.backend, self._execute(self.key(), command, timeout))

        async def _execute(self, key: str, command: str, timeout: float | None) -> ExecuteResponse:
            args: dict[str, Any] = {"command": command}
            if timeout is not None:
                if timeout < 0:
                    raise ValueError(f"timeout must be non-negative, got {timeout}")
                args["timeout"] = float(timeout) or NO_TIMEOUT_S
            try:
                run = await run_captured(self.sessions, key, command, timeout_s=args.get("timeout") or self.timeout_s,
                                         profile=self.profile, merge_stderr=True,
                                         max_bytes=self.max_output_bytes)
            except (PoolTimeoutError, SandboxError) as exc:
                return ExecuteResponse(output=f"[{type(exc).__name__}: {exc}]", exit_code=None)
            output = run.stdout.decode("utf-8", "replace")
            if run.error:  # a timeout, a lost sandbox, ...
                sep = "\n" if output and not output.endswith("\n") else ""
                output = f"{output}{sep}[{run.error}]"
            return ExecuteResponse(output=output, exit_code=run.exit_code, truncated=run.truncated)

        # -- files -------------------------------------------------------------------
        def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
            """Write each ``(absolute path, bytes)``, creating parent directories."""
            return call(self.backend, self._upload(self.key(), files))

        async def aupload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
            return await acall(self.backend, self._upload(self.key(), files))

        def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
            """Read each absolute path; errors per file (``file_not_found``, ...)."""
            return call(self.backend, self._download(self.key(), paths))

        async def adownload_files(self, paths: list[str]) -> list[FileDownloadResponse]:
            return await acall(self.backend, self._download(self.key(), paths))

        async def _upload(self, key: str, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
            errors: dict[int, str] = {i: "invalid_path" for i, (path, _) in enumerate(files)
                                      if not path.startswith("/") or "\x00" in path}
            todo = [i for i in range(len(files)) if i not in errors]
            if todo:
                slot = await self.sessions.slot(key, self.profile)
                rel = f".hermes-transfer-{uuid.uuid4().hex}"
                xfer = f"{slot.workspace_dir}/{rel}"
                calls: list[tuple[str, dict[str, Any]]] = [
                    ("write_file", {"path": f"{rel}/{i}", "encoding": "base64",
                                    "content": base64.b64encode(files[i][1]).decode("ascii")})
                    for i in todo]
                script = _UPLOAD_SCRIPT.format(xfer=shlex.quote(xfer), calls="\n".join(
                    f"put {i} {shlex.quote(files[i][0])}" for i in todo))
                calls.append(("bash", {"command": script}))
                results = await self.sessions.execute_many(key, calls, timeout_s=self.timeout_s)
                writes, moved = results[:-1], results[-1]
                status = _statuses(moved)
                for i, written in zip(todo, writes, strict=True):
                    got = status.get(i)
                    if got != "ok":
                        errors[i] = (got if got and got != "transfer_failed"
                                     else written.error or moved.error or "upload failed")
            return [FileUploadResponse(path=path, error=errors.get(i)) for i, (path, _) in enumerate(files)]

        async def _download(self, key: str, paths: list[str]) -> list[FileDownloadResponse]:
            out: dict[int, FileDownloadResponse] = {
                i: FileDownloadResponse(path=p, content=None, error="invalid_path")
                for i, p in enumerate(paths) if not p.startswith("/") or "\x00" in p}
            todo = [i for i in range(len(paths)) if i not in out]
            if todo:
                slot = await self.sessions.slot(key, self.profile)
                rel = f".hermes-transfer-{uuid.uuid4().hex}"
                xfer = f"{slot.workspace_dir}/{rel}"
                script = _DOWNLOAD_SCRIPT.format(xfer=shlex.quote(xfer), calls="\n".join(
                    f"get {i} {shlex.quote(paths[i])}" for i in todo))
                calls: list[tuple[str, dict[str, Any]]] = [("bash", {"command": script})]
                calls += [("read_artifact", {"path": f"{rel}/{i}", "encoding": "base64",
                                             "max_bytes": WHOLE_FILE_BYTES}) for i in todo]
                calls.append(("bash", {"command": f"rm -rf -- {shlex.quote(xfer)}"}))
                results = await self.sessions.execute_many(key, calls, timeout_s=self.timeout_s)
                status = _statuses(results[0])
                for i, read in zip(todo, results[1:-1], strict=True):
                    got = status.get(i)
                    if got == "ok" and read.success:
                        data = base64.b64decode(read.metadata.get("content", ""))
                        out[i] = FileDownloadResponse(path=paths[i], content=data, error=None)
                    else:
                        error = got if got and got != "ok" else read.error or results[0].error
                        out[i] = FileDownloadResponse(path=paths[i], content=None,
                                                      error=error or "download failed")
            return [out[i] for i in range(len(paths))]

    SlotSandbox.__module__ = __name__
    SlotSandbox.__qualname__ = "SlotSandbox"
    return SlotSandbox


