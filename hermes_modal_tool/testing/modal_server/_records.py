"""What the server records: images and sandboxes asked for (read them in assertions), secrets."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass
class ImageRecord:
    """An image the SDK asked for (never really built).

    Attributes:
        image_id: ``im-...``, a hash of the definition (the same in every server).
        tag: registry tag of the ``FROM`` line (inherited by layers built on top).
        commands: all Dockerfile commands, base layers first.
        builder_version: the image builder version the SDK used.
        python_version: the standalone Python added (``add_python``), e.g. ``"3.11.13"``.
        fs_snapshot: where a filesystem snapshot's files are (``snapshot_of``: its sandbox).
    """

    image_id: str
    tag: str
    commands: list[str]
    builder_version: str
    python_version: str | None = None
    #: a filesystem snapshot's files (``Sandbox.snapshot_filesystem``), else None
    fs_snapshot: Path | None = None
    snapshot_of: str | None = None


@dataclasses.dataclass
class SandboxRecord:
    """What a sandbox was created with and where it stands; read it in assertions.

    Attributes:
        sandbox_id: ``sb-...``; ``api_version`` is 1 or 2 (which SDK API created it).
        image_tag: the image's registry tag; ``image_commands`` its Dockerfile commands;
            ``image_python`` the Python added with ``add_python`` (e.g. ``"3.11.13"``).
        cpu: requested cores; ``cpu_limit`` the hard limit (both recorded only).
        memory_mib: requested MiB; ``memory_limit_mib`` the hard limit.
        gpu: e.g. ``"T4"`` or ``"A100-40GB:2"`` (recorded only; no GPU is needed).
        timeout_s: maximum lifetime; ``idle_timeout_s`` the idle limit (None: none).
        secret_names: named secrets, in order; ``env`` the values of inline ones
            (``env=``, ``Secret.from_dict``).
        status: ``"pending"`` (no task yet), ``"running"`` or ``"finished"``.
        result_reason: once finished: ``"success"``, ``"failure"``, ``"terminated"``,
            ``"timeout"``, ``"idle_timeout"``, ``"oom"`` or ``"preempted"``;
            ``result_message`` is the exception text, ``exit_code`` the entrypoint's
            (137 when the sandbox was killed).
        live_execs: execs running now; ``exec_count`` execs started in total.
        state_dir: the sandbox's directory on the host (its writable dirs are in ``fs/``).
        volumes: its Modal Volumes as (host directory, mount path, read-only).
    """

    sandbox_id: str
    api_version: int
    app_id: str
    app_name: str
    name: str | None
    image_id: str
    image_tag: str
    image_commands: list[str]
    image_python: str | None
    entrypoint_args: list[str]
    workdir: str | None
    cpu: float | None
    cpu_limit: float | None
    memory_mib: int | None
    memory_limit_mib: int | None
    gpu: str | None
    timeout_s: int
    idle_timeout_s: int | None
    block_network: bool
    tags: dict[str, str]
    secret_names: list[str]
    env: dict[str, str]
    created_at: float
    state_dir: Path
    task_id: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    status: str = "pending"
    result_reason: str | None = None
    result_message: str = ""
    exit_code: int | None = None
    live_execs: int = 0
    exec_count: int = 0
    volumes: list[tuple[str, str, bool]] = dataclasses.field(default_factory=list)
    #: An outbound allow-list's CIDRs and domains (None: open or blocked; _network.py).
    allowed: list[str] | None = None


@dataclasses.dataclass
class _Secret:
    secret_id: str
    name: str | None
    values: dict[str, str]


_IMAGES: dict[str, ImageRecord] = {}  # built images, shared by every server in the process
