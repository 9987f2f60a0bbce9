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

- PTY sessions (``supports_pty()`` is True, so the model gets ``write_stdin``;
  ``SlotSandboxClientOptions(pty=False)`` turns them off):
  ``exec_command`` starts its command as a process of the slot beside its shell
  (``ToolBackend.start_process``; ``tty=true``: on a terminal, else on pipes with no
  stdin), returns what it printed within the yield time (sooner if it ended, with its
  exit code) or a session id while it runs; ``write_stdin`` types into it (terminal
  only, as with the SDK's other clients) or polls it. Output is read incrementally:
  each update has what came since the last. ``pty_terminate_all`` (the SDK calls it on
  stop and shutdown) kills them; releasing the slot kills them too. Needs ``python3``
  in the slot; without it ``exec_command`` falls back to one-shot ``exec`` for
  ``tty=false`` and reports the error for ``tty=true`` (see :mod:`._agents_pty`).

Exposed ports: ``SlotSandboxClientOptions(exposed_ports=(8000,))``; the SDK's
``resolve_exposed_port(8000)`` starts a preview of the slot's port
(:meth:`~hermes_modal_tool.backend.ToolBackend.expose`, one per port, revoked when the
slot is released) and returns its host and port with a new single-use ticket as the
endpoint's ``query``: ``endpoint.url_for("http")`` opens once in a browser (the ticket
becomes a cookie); a client that cannot keep cookies resolves again for each URL.

Not supported (yet): running as another user (``user=``), and resuming a slot from
another process (the slot map lives in this client).

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
import uuid
from pathlib import Path
from typing import Literal

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    ExposedPortUnavailableError,
    InvalidManifestPathError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.manifest import Manifest
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.dependencies import Dependencies
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.session.sandbox_session import SandboxSession
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, ExposedPortEndpoint, User
from agents.sandbox.util.tar_utils import UnsafeTarMemberError, validate_tar_bytes

from hermes_modal_tool.backend import ToolBackend
from hermes_modal_tool.capture import WHOLE_FILE_BYTES, run_captured
from hermes_modal_tool.errors import HermesModalToolError, UsageError
from hermes_modal_tool.previews import TICKET_PARAM, Preview
from hermes_modal_tool.sessions import SlotSessions
from hermes_modal_tool.slots import SlotState

from ._agents_pty import PtyEntry, PtyMethods
from ._agents_pty import no_user as _no_user

__all__ = ["SlotSandboxClient", "SlotSandboxClientOptions", "SlotSandboxSession",
           "SlotSandboxSessionState"]

BACKEND_ID = "hermes-slot"


class SlotSandboxClientOptions(BaseSandboxClientOptions):
    """Options of :meth:`SlotSandboxClient.create`.

    Attributes:
        profile: the profile the slot comes from (None: the backend's default).
        timeout_s: default seconds per command when the SDK gives none (None: the
            profile's ``execution_timeout_s``).
        pty: offer PTY sessions (``supports_pty()``); False: ``exec_command`` runs
            one-shot in the slot's shell (no process start: about 20 ms less per
            command) and the model gets no ``write_stdin``.
        exposed_ports: ports of the slot the SDK may resolve (``resolve_exposed_port``:
            a preview, see the module docstring).
    """

    type: Literal["hermes-slot"] = "hermes-slot"
    profile: str | None = None
    timeout_s: float | None = None
    pty: bool = True
    exposed_ports: tuple[int, ...] = ()


class SlotSandboxSessionState(SandboxSessionState):
    """The JSON-serializable state of a slot session (what ``resume`` takes)."""

    type: Literal["hermes-slot"] = "hermes-slot"
    slot_key: str
    profile: str | None = None
    timeout_s: float | None = None
    pty: bool = True
    slot_id: str | None = None


class SlotSandboxSession(PtyMethods, BaseSandboxSession):
    """A sandbox session on one slot (see the module docstring).

    Args:
        state: the session's state (its ``slot_key`` names the slot in ``sessions``).
        sessions: the client's slot map.
    """

    state: SlotSandboxSessionState

    def __init__(self, *, state: SlotSandboxSessionState, sessions: SlotSessions) -> None:
        self.state = state
        self._sessions = sessions
        self._pty: dict[int, PtyEntry] = {}  # the SDK's session id -> process
        self._pty_lock = asyncio.Lock()
        self._previews: dict[int, Preview] = {}  # port -> its preview (revoked with the slot)

    async def _resolve_exposed_port(self, port: int) -> ExposedPortEndpoint:
        """A preview of ``port`` (made on first use, again after the slot was released):
        its host and port, and a new single-use ticket as the query."""
        try:
            slot = await self._sessions.slot(self.state.slot_key, self.state.profile)
            preview = self._previews.get(port)
            if preview is None or preview.revoked:
                preview = self._previews[port] = await self._sessions.backend.expose(slot, port)
            host, _, bound = preview.url.split("//", 1)[1].rstrip("/").rpartition(":")
            return ExposedPortEndpoint(host=host.strip("[]"), port=int(bound), tls=False,
                                       query=f"{TICKET_PARAM}={preview.ticket()}")
        except (HermesModalToolError, OSError) as exc:
            raise ExposedPortUnavailableError(port=port, exposed_ports=self.state.exposed_ports,
                                              reason="backend_unavailable", cause=exc) from exc

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
        """True (unless ``SlotSandboxClientOptions.pty`` is False): ``exec_command`` runs
        commands as processes of the slot (see :meth:`pty_exec_start`) and the model
        gets ``write_stdin``."""
        return self.state.pty

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
            slot_key=f"agents-{session_id.hex[:16]}", profile=options.profile, timeout_s=options.timeout_s,
            pty=options.pty, exposed_ports=options.exposed_ports)
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


def _raise_if_escape(path: Path | str, error: str) -> None:
    """The file tools refuse a path that leaves the workspace (e.g. through a symlink):
    the SDK's error for that is InvalidManifestPathError."""
    if "outside the workspace" in error or "escapes the workspace" in error:
        raise InvalidManifestPathError(rel=str(path), reason="escape_root", context={"error": error})
