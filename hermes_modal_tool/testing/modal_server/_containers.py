"""Containers: each process in its own bwrap; a sandbox's lifetime (start, timeouts, finish)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from modal_proto import api_pb2

from ._common import (
    _INIT_SH,
    _MESSAGES,
    _STATUSES,
    CONTAINER_PATH,
    TOOLS_PATH,
    WRITABLE_DIRS,
    _new_id,
)
from ._network import NetError, _Networks
from ._processes import _Process, _Sandbox
from ._records import _IMAGES
from ._shm import mount_shm, size_mib, unmount_shm


class _Containers(_Networks):
    """Containers: each process in its own bwrap; a sandbox's lifetime (start, timeouts, finish).

    A part of :class:`LocalModalServer` (a mixin): it uses the server's state.
    """

    @staticmethod
    def _make_fs(root: Path, workdir: str | None = None) -> None:
        """Create a sandbox's writable dirs (and its workdir when it lies in one of them)."""
        for sub, mode in WRITABLE_DIRS.values():
            path = root / "fs" / sub
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, mode)
        (root / "fs" / "run" / "modal-local").mkdir(mode=0o755, exist_ok=True)
        for target, (sub, _mode) in WRITABLE_DIRS.items():
            if workdir and (workdir == target or workdir.startswith(target + "/")):
                (root / "fs" / sub / workdir[len(target) :].lstrip("/")).mkdir(
                    parents=True, exist_ok=True)

    def _container_argv(self, fs: Path, argv: list[str], cwd: str, *, block_network: bool,
                        gpu: str | None = None, root: Path | None = None,
                        volumes: Sequence[str] = ()) -> list[str]:
        """bwrap's command line for one process of a sandbox: the host's root read-only
        (or ``root``, an image's root filesystem: see ``image_roots``), the sandbox's
        writable directories, stand-in GPU nodes for a ``gpu`` sandbox, its Volumes
        (``volumes``: bwrap bind arguments), the container tools, then ``argv`` in ``cwd``."""
        assert self._bwrap is not None
        args = [str(self._bwrap), "--die-with-parent", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts", "--hostname", "modal"]
        if block_network:
            args.append("--unshare-net")
        # An image root is bound writable so that bwrap can make its mount points, then
        # made read-only with the rest (--remount-ro / below).
        args += ["--bind", str(root), "/"] if root is not None else self._root_binds
        args += ["--dev", "/dev", "--dir", "/proc"] + (_standin_gpus() if gpu else [])
        for target, (sub, _mode) in WRITABLE_DIRS.items():
            if target != "/var/tmp" or self._has_var_tmp:
                args += ["--bind", str(fs / sub), target]
        args += list(volumes)
        args += ["--ro-bind", str(self._bwrap.parent.parent), TOOLS_PATH, "--remount-ro", "/",
                 "--chdir", cwd, "/bin/sh", "-c", _INIT_SH, "sh", *argv]
        return args

    async def _start_process(self, sb: _Sandbox, proc: _Process, env: dict[str, str],
                             workdir: str | None, timeout_s: float | None) -> None:
        cwd = workdir or sb.record.workdir or "/"
        root = self.image_roots.get(sb.record.image_tag)
        if self.isolation == "bwrap":
            argv = self._container_argv(sb.fs, proc.argv, cwd, block_network=sb.record.block_network,
                                        gpu=sb.record.gpu, root=root,
                                        volumes=self._volume_binds(sb.record.volumes, root))
            await proc.start(self, self._netns_argv(sb) + argv, env, None, timeout_s)
            return
        if root is not None or sb.record.volumes:
            why = f"image {sb.record.image_tag!r} has a root of its own ({root})" if root else "Volumes"
            raise OSError(f"{why}: that needs isolation='bwrap'")
        exists = cwd != "/" and await asyncio.to_thread(os.path.isdir, cwd)
        host_cwd = cwd if exists else str(sb.fs / "workspace")
        env = {**env, "HOME": str(sb.fs / "root")}
        await proc.start(self, proc.argv, env, host_cwd, timeout_s)

    def _base_env(self, sb: _Sandbox) -> dict[str, str]:
        path = CONTAINER_PATH if self.isolation == "bwrap" else "/usr/local/bin:/usr/bin:/bin"
        return {"PATH": path, "LANG": "C.UTF-8", "HOME": "/root",
                "MODAL_SANDBOX_ID": sb.record.sandbox_id, "MODAL_TASK_ID": sb.record.task_id or "",
                **sb.env}

    # -- sandbox lifecycle -------------------------------------------------------------------
    async def _launch(self, sb: _Sandbox, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        if sb.result is not None:
            return
        rec = sb.record
        await asyncio.to_thread(self._make_fs, rec.state_dir, rec.workdir)
        if self.isolation == "bwrap":  # a memory-backed /dev/shm, as on Modal (_shm.py)
            try:
                await asyncio.to_thread(mount_shm, sb.fs / "shm",
                                        size_mib(rec.memory_mib, rec.memory_limit_mib))
            except OSError as exc:  # kept on disk, as without bwrap
                logging.getLogger("hermes_modal_tool.testing.modal_server").warning(
                    "local Modal server: sandbox %s keeps /dev/shm on disk: %s", rec.sandbox_id, exc)
            if sb.result is not None:  # finished meanwhile: its _finish may have run already
                await asyncio.to_thread(unmount_shm, sb.fs / "shm")
                return
        if rec.allowed is not None:
            try:
                await self._open_network(sb)
            except (OSError, NetError) as exc:
                await self._finish(sb, "failure", f"Sandbox network failed to start: {exc}", 1)
                return
        image = _IMAGES.get(rec.image_id)
        if image is not None and image.fs_snapshot is not None:  # Sandbox.snapshot_filesystem
            await asyncio.to_thread(self._restore_fs, image, rec.state_dir)
        if sb.result is not None:
            return
        rec.task_id = _new_id("ta") if rec.api_version == 1 else _new_id("ta", 21, "V")
        rec.started_at = time.time()
        rec.status = "running"
        sb.deadline = time.monotonic() + rec.timeout_s
        self._tasks_by_id[rec.task_id] = sb
        sb.touch()
        sb.started.set()
        if rec.entrypoint_args:
            sb.entrypoint = proc = _Process(sb, list(rec.entrypoint_args))
            sb.stdout, sb.stderr = proc.stdout, proc.stderr
            try:
                await self._start_process(sb, proc, self._base_env(sb), None, None)
            except OSError as exc:
                await self._finish(sb, "failure", f"Sandbox entrypoint failed to start: {exc}", 1)
                return
        self._spawn(self._watch_lifetime(sb))


    async def _watch_lifetime(self, sb: _Sandbox) -> None:
        """Enforce ``timeout`` (from start) and ``idle_timeout`` (no live exec and no
        stdin/stdout activity for that long)."""
        idle = sb.record.idle_timeout_s
        while sb.result is None:
            now = time.monotonic()
            if now >= sb.deadline:
                await self._finish(sb, "timeout", _MESSAGES["timeout"])
                return
            wake = sb.deadline
            if idle:
                if sb.record.live_execs == 0:
                    if now >= sb.last_activity + idle:
                        await self._finish(sb, "idle_timeout", _MESSAGES["idle_timeout"])
                        return
                    wake = min(wake, sb.last_activity + idle)
                else:
                    wake = min(wake, now + idle)
            sb._lifetime_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sb._lifetime_changed.wait(), max(wake - now, 0.01))

    async def _finish(self, sb: _Sandbox, reason: str, message: str, exit_code: int = 137) -> None:
        """Record the sandbox's result, then kill all its processes and wait for them."""
        if sb.result is not None:
            return
        status = _STATUSES[reason]
        sb.result = api_pb2.GenericResult(status=status, exception=message, exitcode=exit_code)
        rec = sb.record
        rec.status, rec.result_reason, rec.result_message = "finished", reason, message
        rec.exit_code = exit_code
        rec.finished_at = time.time()
        sb.finished.set()
        sb.started.set()
        sb._lifetime_changed.set()
        procs = [*sb.execs.values(), *([sb.entrypoint] if sb.entrypoint else [])]
        for proc in procs:
            proc.kill()
        waits = [proc.done.wait() for proc in procs if proc._proc is not None]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=10)
        if self.isolation == "bwrap":
            await asyncio.to_thread(unmount_shm, sb.fs / "shm")
        await self._close_network(sb)
        sb.stdout.close()
        sb.stderr.close()


def _standin_gpus() -> list[str]:
    """For a sandbox that asked for a GPU: the stand-in GPU nodes of
    ``HERMES_MODAL_TOOL_GPU_ROOT`` (a test-only tree, see ``hermes_modal_tool.gpus``)
    bound into the container's ``/dev`` as Modal's runtime binds a real GPU's; nothing
    when it is unset (the container then has no GPU, as on a machine without one)."""
    root = os.environ.get("HERMES_MODAL_TOOL_GPU_ROOT")
    if not root:
        return []
    try:
        names = sorted(os.listdir(os.path.join(root, "dev")))
    except OSError:
        return []
    return [arg for n in names if n.startswith("nvidia")
            for arg in ("--dev-bind", os.path.join(root, "dev", n), "/dev/" + n)]
