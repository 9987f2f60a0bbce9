"""A local Modal control plane: the real ``modal`` SDK talks gRPC to it, sandboxes are local processes.

:class:`LocalModalServer` serves Modal's client API (``modal.client.ModalClient``)
and the task command router (``modal.task_command_router.TaskCommandRouter``) on
one grpclib server on ``http://127.0.0.1:PORT``. The unmodified SDK (1.6) works
against it with ``MODAL_SERVER_URL`` pointed at it and any token the server was
told to accept (the SDK accepts plain http only for a localhost server). A test tool,
not for production: it listens on 127.0.0.1 only, and its sandboxes run as this
machine's root with its directories bound read-only (SECURITY.md)::

    async with LocalModalServer() as server:
        os.environ.update(server.env())
        LocalModalServer.reset_env_client()      # drop a client cached for another server
        app = await modal.App.lookup.aio("demo", create_if_missing=True)
        sb = await modal.Sandbox.create.aio(app=app, image=modal.Image.debian_slim())
        p = await sb.exec.aio("bash", "-c", "echo hi")
        assert await p.stdout.read.aio() == "hi\\n"

Both sandbox APIs of the SDK are served: V1 (``Sandbox*`` RPCs, used for GPU
sandboxes or with ``MODAL_SANDBOX_V2=0``) and V2 (``Sandbox*V2`` RPCs; the 1.6
default). Execs, their stdio and stdin go through the command router either way.

RPC cost. ``App.lookup``: ``AppGetOrCreate``. A new image object: ``ImageGetOrCreate``
(+ ``ImageJoinStreaming`` when not built yet, + ``MountGetOrCreate`` for ``add_python``;
``EnvironmentGetOrCreate`` once per process). Each secret: ``SecretGetOrCreate``
(V1 also turns ``env=`` into one). Then V1 ``Sandbox.create`` = ``SandboxCreate`` +
``SandboxGetTaskId`` (one more per 0.5 s of ``create_delay_s``) and its first exec
adds ``TaskGetCommandRouterAccess``; V2 = ``AuthTokenGet`` (once per client) +
``SandboxCreateV2``, which returns the task id and router access. Each exec then
costs ``TaskExecStart``, one ``TaskExecStdioRead`` per stream read (stdout and
stderr) and ``TaskExecWait``. A long-lived exec fed through one open
``TaskExecStdinWriteStream`` costs no RPC per message (``stream_messages`` counts
them); ``process.stdin.drain()`` costs one ``TaskExecStdinWrite`` each.

**The container.** Each exec (and the entrypoint) runs in its own ``bwrap``, as
real root without a user namespace, in new PID, IPC and UTS namespaces (and a
network namespace with loopback only when the sandbox blocks the network):

- the host's top-level directories (``/usr``, ``/etc``, ``/sys``, ...) bound
  read-only, on a read-only root;
- writable, per-sandbox and shared by all its execs: ``/tmp``, ``/var/tmp``,
  ``/root``, ``/home``, ``/run``, ``/data``, ``/workspace`` and ``/dev/shm``
  (``<state>/sandboxes/<id>/fs/...`` on the host); ``/dev/shm`` is memory-backed as
  on Modal: a tmpfs (mount source ``modal-local-shm``) of the sandbox's ``memory``
  (its limit if given, else the request; without one half the host's RAM, like
  Docker's and Linux's default), mounted on the host once per sandbox and detached
  when it finishes, when the server stops, and when a server starts on a state
  directory a killed one left (``_shm.py``; a failed mount is logged and leaves it on
  disk);
- a fresh ``/dev``, and a ``/proc`` for the exec's PID namespace, mounted by the
  exec itself so that it stays fully visible: nested ``bwrap --proc`` (in a user
  namespace, as an unprivileged uid) works inside;
- ``bwrap`` itself at ``/run/modal-local/bin/bwrap`` (read-only), first on
  ``PATH=/run/modal-local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin``;
- a clean environment: ``PATH``, ``LANG=C.UTF-8``, ``HOME=/root``,
  ``MODAL_SANDBOX_ID``, ``MODAL_TASK_ID``, the sandbox's secrets and ``env=``,
  then the exec's; nothing of the server's environment;
- cwd: the exec's workdir, else the sandbox's, else ``/`` (a sandbox workdir under
  a writable directory is created; elsewhere it must exist on the host).
Killing an exec kills its outer bwrap and with it its whole PID namespace.

Without bwrap (not root, or no working ``bwrap``) ``isolation="auto"`` falls
back to ``"none"``: plain processes in their own session, paths are host paths
(``/workspace`` etc. do not exist; cwd defaults to the sandbox's state dir), and
``fs/shm`` is a plain directory on the host's disk.

**Known gaps.** Images are recorded, never built or used (every sandbox sees the
host's filesystem); ``cpu``/``memory``/``gpu`` are recorded, not enforced (``memory``
only sizes ``/dev/shm``; a ``gpu`` sandbox gets the stand-in nodes of
``HERMES_MODAL_TOOL_GPU_ROOT`` in its ``/dev`` when that test-only tree is set);
outbound allow-lists are enforced outside the container, as Modal does (``_network.py``);
no PTY (``pty=`` runs
without one), tunnels, snapshots, sidecars, ``Sandbox.logs`` or ephemeral
apps (``app.run()``); Modal Volumes are host directories under the state dir
(``VolumeGetOrCreate``, ``VolumeDelete``, a sandbox's ``volume_mounts``: see
``_volumes.py``; files go in on the host, ``volume_path(name)``, not through the
Volume file RPCs; a mount point is made on the container's root, so it must not lie
in one of the host's read-only top-level directories, e.g. ``/models`` but not
``/opt/models``); all stdio is kept in memory until the server stops; the root
inside a container has full capabilities (a test double, not a security boundary).
Process-wide SDK caches outlive a server: call :meth:`LocalModalServer.reset_env_client`
after switching servers; built images are remembered process-wide because the
SDK keeps its default image hydrated across clients.
"""

from ._records import ImageRecord, SandboxRecord
from .server import LocalModalServer, serve_for_this_process, serve_in_thread
from .server import main as main  # python -m ... (see __main__.py)

__all__ = ["ImageRecord", "LocalModalServer", "SandboxRecord", "serve_for_this_process",
           "serve_in_thread"]
