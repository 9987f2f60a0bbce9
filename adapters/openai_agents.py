"""OpenAI Agents SDK: a sandbox client whose sessions are slots of our pools.

The Agents SDK (``openai-agents``) runs a ``SandboxAgent``'s tools (``exec_command``,
file reads and writes, ``apply_patch``, ``view_image``) in a sandbox session made by
a pluggable client, like its own ``ModalSandboxClient``. :class:`SlotSandboxClient`
is such a client backed by a :class:`~hermes_modal_tool.ToolBackend`: each session
holds one slot (a workspace and a persistent shell packed with others into a
sandbox, local bubblewrap or Modal), so many agent sessions share few sandboxes.

- ``create`` acquires a slot (from ``SlotSandboxClientOptions.profile``); the
  session's workspace root (``manifest.root``) is the slot's workspace directory.
- ``exec`` runs in the slot's persistent shell (the SDK wraps commands in
  ``sh -lc``, so its ``cd`` lasts one command, as with the SDK's other clients);
  stdout and stderr come back whole and apart; a timeout raises the SDK's
  ``ExecTimeoutError`` and leaves the shell usable.
- ``read``/``write`` use the engine's file tools (workspace-confined, symlink-safe).
- ``persist_workspace``/``hydrate_workspace`` are tar streams of the workspace with
  workspace-relative members.
- ``running`` is true while the session holds its slot; ``delete`` (and the
  session's ``shutdown``) releases it, its workspace emptied.
- ``resume`` reattaches to the slot the state names while this client still holds
  it; otherwise it acquires a new slot and the SDK hydrates it from the persisted
  workspace snapshot.

Not supported (yet): PTY sessions (``supports_pty()`` is False, so the SDK gives
the model no ``write_stdin`` tool and runs ``exec_command`` one-shot), running as
another user (``user=``), exposed ports, and resuming a slot from another process
(the slot map lives in this client).

Example::

    backend = ToolBackend(SandboxConfig(slots_per_sandbox=8))
    client = SlotSandboxClient(backend)
    agent = SandboxAgent(name="coder", instructions="...", model="gpt-5")
    result = await Runner.run(agent, "write hello.py and run it",
                              run_config=RunConfig(sandbox=SandboxRunConfig(
                                  client=client, options=SlotSandboxClientOptions())))
    await client.aclose()
"""

from __future__ import annotations

import asyncio
import base64
import io
import shlex
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    InvalidManifestPathError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.manifest import Manifest
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.dependencies import Dependencies
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.pty_output import collect_pty_output
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
)
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.session.sandbox_session import SandboxSession
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, User
from agents.sandbox.util.tar_utils import UnsafeTarMemberError, validate_tar_bytes

from hermes_modal_tool.backend import ToolBackend
from hermes_modal_tool.capture import WHOLE_FILE_BYTES, run_captured
from hermes_modal_tool.errors import HermesModalToolError, SandboxError, UsageError
from hermes_modal_tool.processes import SlotProcess
from hermes_modal_tool.sessions import SlotSessions
from hermes_modal_tool.slots import SlotState

__all__ = ["SlotSandboxClient", "SlotSandboxClientOptions", "SlotSandboxSession",
           "SlotSandboxSessionState"]

BACKEND_ID = "hermes-slot"


class SlotSandboxClientOptions(BaseSandboxClientOptions):
    """Options of :meth:`SlotSandboxClient.create`.

    Attributes:
        profile: the profile the slot comes from (None: the backend's default).
        timeout_s: default seconds per command when the SDK gives none (None: the
            profile's ``execution_timeout_s``).
    """

    type: Literal["hermes-slot"] = "hermes-slot"
    profile: str | None = None
    timeout_s: float | None = None


class SlotSandboxSessionState(SandboxSessionState):
    """The JSON-serializable state of a slot session (what ``resume`` takes)."""

    type: Literal["hermes-slot"] = "hermes-slot"
    slot_key: str
    profile: str | None = None
    timeout_s: float | None = None
    slot_id: str | None = None


class SlotSandboxSession(BaseSandboxSession):
    """A sandbox session on one slot (see the module docstring).

    Args:
        state: the session's state (its ``slot_key`` names the slot in ``sessions``).
        sessions: the client's slot map.
    """

    state: SlotSandboxSessionState

    def __init__(self, *, state: SlotSandboxSessionState, sessions: SlotSessions) -> None:
        self.state = state
        self._sessions = sessions
        self._pty: dict[int, _PtyEntry] = {}
        self._pty_lock = asyncio.Lock()

    async def _acquire(self) -> None:
        """Hold the state's slot (acquiring one when the key has none); root the
        workspace at the slot's directory."""
        try:
            slot = await self._sessions.slot(self.state.slot_key, self.state.profile)
        except HermesModalToolError as exc:
            raise ExecTransportError(command=("acquire",), message=f"no slot: {exc}", cause=exc) from exc
        self.state.slot_id = slot.slot_id
        if self.state.manifest.root != slot.workspace_dir:
            self.state.manifest = self.state.manifest.model_copy(update={"root": slot.workspace_dir})

    # -- lifecycle ------------------------------------------------------------------
    async def _ensure_backend_started(self) -> None:
        await self._acquire()

    async def _shutdown_backend(self) -> None:
        await self._sessions.close(self.state.slot_key)

    async def running(self) -> bool:
        info = self._sessions.info().get(self.state.slot_key)
        return info is not None and info["state"] != SlotState.ERROR.value

    def supports_pty(self) -> bool:
        """True: ``exec_command`` runs commands as processes of the slot (see
        :meth:`pty_exec_start`) and the model gets ``write_stdin``."""
        return True

    # -- exec -------------------------------------------------------------------------
    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> ExecResult:
        argv = [str(c) for c in command]
        line = shlex.join(argv)
        try:
            run = await run_captured(self._sessions, self.state.slot_key, line,
                                     timeout_s=timeout or self.state.timeout_s, profile=self.state.profile)
        except HermesModalToolError as exc:
            raise ExecTransportError(command=argv, cause=exc, message=str(exc)) from exc
        if run.timed_out:
            raise ExecTimeoutError(command=argv, timeout_s=timeout,
                                   context={"stdout_bytes": len(run.stdout)})
        if run.exit_code is None:
            raise ExecTransportError(command=argv, message=run.error or "the command did not run",
                                     context={"error": run.error})
        return ExecResult(stdout=run.stdout, stderr=run.stderr, exit_code=run.exit_code)

    # -- processes (the SDK's PTY sessions) ---------------------------------------------
    async def pty_exec_start(self, *command: str | Path, timeout: float | None = None,
                             shell: bool | list[str] = True, user: str | User | None = None,
                             tty: bool = False, yield_time_s: float | None = None,
                             max_output_tokens: int | None = None) -> PtyExecUpdate:
        """Start ``command`` as a process of the slot beside its shell
        (:meth:`ToolBackend.start_process`; ``shell=True``: with ``bash -lc``): on a
        terminal of 24 x 80 when ``tty``, else on pipes with stdin from ``/dev/null``
        (stdout and stderr interleaved). Collects
        its output for ``yield_time_s`` seconds (default 10, clamped to 0.25-30),
        returning early when it ends. ``timeout``: seconds after which it is killed
        (None: it runs until it ends, :meth:`pty_terminate_all` or the slot's release).

        Returns:
            the SDK's ``PtyExecUpdate``: the output (UTF-8, cut to ``max_output_tokens``
            tokens as the SDK's other clients do); while it runs, ``process_id`` (the
            ``session_id`` of :meth:`pty_write_stdin`) and no exit code; once it ended,
            its ``exit_code`` (``-N``: killed by signal N) and no ``process_id``.

        Raises:
            UsageError: ``user`` is given.
            ExecTransportError: it could not be started (no slot, no ``python3`` in the
                slot, ...); ``context["retry_safe"]`` is True (nothing ran), so the SDK's
                ``exec_command`` falls back to a one-shot exec for ``tty=False``.
        """
        _no_user(user)
        # bash, not the SDK's default `sh -lc`: Debian's sh (dash) waits for its command
        # and dies at a Ctrl-C the program itself handles, ending the session.
        argv = self._prepare_exec_command(*command, shell=["bash", "-lc"] if shell is True else shell, user=None)
        line = "exec " + shlex.join(argv) + ("" if tty else " </dev/null")
        try:
            slot = await self._sessions.slot(self.state.slot_key, self.state.profile)
            proc = await self._sessions.backend.start_process(slot, line, pty=tty)
        except HermesModalToolError as exc:
            raise ExecTransportError(command=argv, message=f"could not start the process: {exc}",
                                     context={"retry_safe": True}, cause=exc) from exc
        entry = _PtyEntry(proc, tty)
        if timeout is not None:
            entry.killer = asyncio.create_task(_kill_after(proc, timeout))
        async with self._pty_lock:
            process_id = allocate_pty_process_id(set(self._pty))
            pruned = self._prune_pty()
            self._pty[process_id] = entry
        if pruned is not None:
            await pruned.terminate()
        yield_ms = 10_000 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._pty_update(process_id, entry, clamp_pty_yield_time_ms(yield_ms), max_output_tokens)

    async def pty_write_stdin(self, *, session_id: int, chars: str, yield_time_s: float | None = None,
                              max_output_tokens: int | None = None) -> PtyExecUpdate:
        """Type ``chars`` into process ``session_id`` (``"\\x03"``: Ctrl-C) and collect
        its output for ``yield_time_s`` seconds (default 0.25; at least 5 when ``chars``
        is empty, a poll), returning early when it ends; the update is as
        :meth:`pty_exec_start`'s.

        Raises:
            PtySessionNotFoundError: no running process has that id (it ended and its
                exit code was reported, or it was terminated).
            RuntimeError: ``"stdin is not available for this process"``: it was started
                with ``tty=False`` and ``chars`` is not empty (the SDK's message, which its
                ``write_stdin`` tool turns into advice to the model).
        """
        async with self._pty_lock:
            entry = self._resolve_pty_session_entry(pty_processes=self._pty, session_id=session_id)
        if chars:
            if not entry.tty:
                raise RuntimeError("stdin is not available for this process")
            try:
                await entry.proc.write(chars)
            except SandboxError:
                pass  # it has ended: the update below says with which exit code
        yield_ms = 250 if yield_time_s is None else int(yield_time_s * 1000)
        entry.last_used = time.monotonic()
        return await self._pty_update(session_id, entry, resolve_pty_write_yield_time_ms(
            yield_time_ms=yield_ms, input_empty=chars == ""), max_output_tokens)

    async def pty_terminate_all(self) -> None:
        """Kill (SIGKILL, process group) every process this session started and forget
        them; releasing the slot kills them as well."""
        async with self._pty_lock:
            entries = list(self._pty.values())
            self._pty.clear()
        for entry in entries:
            await entry.terminate()

    async def _pty_update(self, process_id: int, entry: _PtyEntry, yield_ms: int,
                          max_output_tokens: int | None) -> PtyExecUpdate:
        try:
            output, tokens, closed = await collect_pty_output(
                output_chunks=entry.chunks, output_lock=entry.lock, output_notify=entry.notify,
                is_done=lambda: entry.exit_code is not None, yield_time_ms=yield_ms,
                max_output_tokens=max_output_tokens, poll_output=entry.poll,
                settle_output=entry.settle, wait_for_output=_no_wait)
        except HermesModalToolError as exc:  # e.g. the slot was released: its processes died with it
            async with self._pty_lock:
                self._pty.pop(process_id, None)
            raise ExecTransportError(command=(entry.proc.command,), cause=exc,
                                     message=f"process {process_id} was lost: {exc}") from exc
        if not closed:
            return PtyExecUpdate(process_id=process_id, output=output, exit_code=None,
                                 original_token_count=tokens)
        async with self._pty_lock:
            self._pty.pop(process_id, None)
        await entry.terminate()
        return PtyExecUpdate(process_id=None, output=output, exit_code=entry.exit_code,
                             original_token_count=tokens)

    def _prune_pty(self) -> _PtyEntry | None:
        """At the SDK's limit of processes per session, the entry to drop (as its clients:
        the least recently used ended one, else the least recently used not among the
        newest few)."""
        if len(self._pty) < PTY_PROCESSES_MAX:
            return None
        victim = process_id_to_prune_from_meta(
            [(pid, e.last_used, e.exit_code is not None) for pid, e in self._pty.items()])
        return None if victim is None else self._pty.pop(victim, None)

    # -- files ------------------------------------------------------------------------
    async def _validate_path_access(self, path: Path | str, *, for_write: bool = False) -> Path:
        """The SDK's remote check (as its Runloop and Cloudflare clients do): a slot is a
        whole machine whose file tools reach its entire root, so confinement to the
        workspace, which the SDK's session API promises, is checked in the slot (its
        realpath helper), symlinks included."""
        return await self._validate_remote_path_access(path, for_write=for_write)

    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        _no_user(user)
        target = await self._validate_path_access(path)
        r = await self._sessions.execute(self.state.slot_key, "read_artifact",
                                         {"path": str(target), "encoding": "base64",
                                          "max_bytes": WHOLE_FILE_BYTES},
                                         profile=self.state.profile)
        if not r.success:
            error = r.error or "read failed"
            _raise_if_escape(path, error)
            if error.startswith(("no such file", "not a directory")):
                raise WorkspaceReadNotFoundError(path=Path(path), context={"error": error})
            raise WorkspaceArchiveReadError(path=Path(path), context={"error": error})
        return io.BytesIO(base64.b64decode(r.metadata.get("content", "")))

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        _no_user(user)
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        if not isinstance(payload, bytes | bytearray):
            raise WorkspaceArchiveWriteError(path=Path(path), context={
                "reason": f"expected bytes or str, got {type(payload).__name__}"})
        target = await self._validate_path_access(path, for_write=True)
        r = await self._sessions.execute(self.state.slot_key, "write_file", {
            "path": str(target), "encoding": "base64", "content": base64.b64encode(payload).decode("ascii")},
            profile=self.state.profile)
        if not r.success:
            _raise_if_escape(path, r.error or "")
            raise WorkspaceArchiveWriteError(path=Path(path), context={"error": r.error})

    # -- workspace snapshots -------------------------------------------------------------
    async def persist_workspace(self) -> io.IOBase:
        root = self._workspace_root_path()
        excludes = [f"--exclude=./{rel.as_posix().removeprefix('./')}"
                    for rel in sorted(self._persist_workspace_skip_relpaths(), key=lambda p: p.as_posix())]
        result = await self.exec("tar", "cf", "-", *excludes, "-C", root.as_posix(), ".", shell=False)
        if not result.ok():
            raise WorkspaceArchiveReadError(path=root, context={
                "reason": "tar_nonzero_exit", "exit_code": result.exit_code,
                "stderr": result.stderr.decode("utf-8", "replace")[:4096]})
        return io.BytesIO(result.stdout)

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        root = self._workspace_root_path()
        raw = data.read()
        if isinstance(raw, str):
            raw = raw.encode("utf-8")
        try:
            validate_tar_bytes(bytes(raw), reject_rel_paths=self.state.manifest.ephemeral_persistence_paths(),
                               allow_external_symlink_targets=False)
        except UnsafeTarMemberError as exc:
            raise WorkspaceArchiveWriteError(path=root, context={"reason": exc.reason, "member": exc.member},
                                             cause=exc) from exc
        name = f".hermes-hydrate-{uuid.uuid4().hex}.tar"
        await self.write(root / name, io.BytesIO(raw))
        tar = shlex.quote((root / name).as_posix())
        result = await self.exec(f"tar xf {tar} -C {shlex.quote(root.as_posix())} "
                                 f"--exclude=./{name}; rc=$?; rm -f -- {tar}; exit $rc")
        if not result.ok():
            raise WorkspaceArchiveWriteError(path=root, context={
                "reason": "tar_extract_nonzero_exit", "exit_code": result.exit_code,
                "stderr": result.stderr.decode("utf-8", "replace")[:4096]})


class SlotSandboxClient(BaseSandboxClient[SlotSandboxClientOptions]):
    """An Agents SDK sandbox client whose sessions are slots of ``backend``.

    Args:
        backend: the engine, running on the event loop the agents run on.
        sessions: a :class:`SlotSessions` to share (default: a new one).
        instrumentation: the SDK's session instrumentation (events, tracing).
        dependencies: the SDK's per-session dependencies template.
    """

    backend_id = BACKEND_ID
    supports_default_options = True

    def __init__(self, backend: ToolBackend, *, sessions: SlotSessions | None = None,
                 instrumentation: Instrumentation | None = None,
                 dependencies: Dependencies | None = None) -> None:
        if sessions is not None and sessions.backend is not backend:
            raise UsageError("sessions belong to another backend")
        self.backend = backend
        self.sessions = sessions if sessions is not None else SlotSessions(backend)
        self._instrumentation = instrumentation if instrumentation is not None else Instrumentation()
        self._dependencies = dependencies

    async def create(self, *, snapshot: SnapshotSpec | SnapshotBase | None = None,
                     manifest: Manifest | None = None,
                     options: SlotSandboxClientOptions | None = None) -> SandboxSession:
        """Acquire a slot for a new session.

        Raises:
            ConfigError: ``options.profile`` is not a profile of the backend.
            ExecTransportError: no slot became free within the profile's ``acquire_timeout_s``.
        """
        options = options if options is not None else SlotSandboxClientOptions()
        self.backend.profile(options.profile)  # ConfigError names the profile
        manifest = self._validate_manifest_for_create(manifest if manifest is not None else Manifest())
        session_id = uuid.uuid4()
        state = SlotSandboxSessionState(
            session_id=session_id, manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            slot_key=f"agents-{session_id.hex[:16]}", profile=options.profile, timeout_s=options.timeout_s)
        inner = SlotSandboxSession(state=state, sessions=self.sessions)
        await inner._acquire()
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    async def delete(self, session: SandboxSession) -> SandboxSession:
        """Release the session's slot (its workspace is emptied)."""
        inner = session._inner
        if not isinstance(inner, SlotSandboxSession):
            raise TypeError(f"SlotSandboxClient.delete expects a SlotSandboxSession, got {type(inner).__name__}")
        await self.sessions.close(inner.state.slot_key)
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        """Reattach to the slot ``state`` names while this client holds it; else
        acquire a new slot, which the SDK hydrates from ``state.snapshot`` on start."""
        if not isinstance(state, SlotSandboxSessionState):
            raise TypeError(f"SlotSandboxClient.resume expects a SlotSandboxSessionState, got {type(state).__name__}")
        held = self.sessions.info().get(state.slot_key)
        alive = held is not None and held["slot_id"] == state.slot_id and held["state"] != SlotState.ERROR.value
        if not alive:
            state.workspace_root_ready = False
        inner = SlotSandboxSession(state=state, sessions=self.sessions)
        await inner._acquire()
        if alive:
            inner._set_start_state_preserved(True)
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, SlotSandboxSessionState)

    async def aclose(self) -> int:
        """Release every slot this client's sessions hold; return how many."""
        return await self.sessions.close_all()


@dataclass(eq=False)
class _PtyEntry:
    """A process of an SDK session: its handle and the output read but not yet returned
    (``chunks``, which the SDK's collector drains; it carries a cut UTF-8 character)."""

    proc: SlotProcess
    tty: bool
    exit_code: int | None = None
    last_used: float = field(default_factory=time.monotonic)
    chunks: deque[bytes] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notify: asyncio.Event = field(default_factory=asyncio.Event)
    killer: asyncio.Task[None] | None = None

    async def poll(self, deadline: float) -> None:
        """Read what came, waiting until ``deadline`` (``time.monotonic()``) for some; an
        empty read is the deadline or the end, which ``wait(0)`` tells apart."""
        if self.exit_code is not None:
            return
        data = await self.proc.read(wait_s=max(0.0, deadline - time.monotonic()))
        if data:
            self.chunks.append(data)
            return
        code = await self.proc.wait(timeout_s=0)
        if code is not None:
            self.chunks.append(await self.proc.read())  # what came just before the end
            self.exit_code = code

    async def settle(self) -> None:
        """At the deadline: take what has already come, without waiting."""
        if self.exit_code is None:
            self.chunks.append(await self.proc.read())

    async def terminate(self) -> None:
        if self.killer is not None:
            self.killer.cancel()
        if self.exit_code is None:
            try:
                await self.proc.signal("KILL")
            except HermesModalToolError:
                pass  # it ended meanwhile, or the slot (and it) is gone


async def _no_wait(remaining_s: float) -> None:
    """The collector's pause between polls: none, as a poll itself waits for output."""


async def _kill_after(proc: SlotProcess, timeout_s: float) -> None:
    await asyncio.sleep(timeout_s)
    try:
        await proc.signal("KILL")
    except HermesModalToolError:
        pass  # it has ended


def _raise_if_escape(path: Path | str, error: str) -> None:
    """The file tools refuse a path that leaves the workspace (e.g. through a symlink):
    the SDK's error for that is InvalidManifestPathError."""
    if "outside the workspace" in error or "escapes the workspace" in error:
        raise InvalidManifestPathError(rel=str(path), reason="escape_root", context={"error": error})


def _no_user(user: str | User | None) -> None:
    if user is not None:
        raise UsageError(f"running as another user ({user!r}) is not supported by slot sessions")
