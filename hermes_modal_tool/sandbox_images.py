"""``ToolBackend.snapshot_sandbox``: a prepared Modal sandbox becomes the image a profile's
new sandboxes start from (Modal's ``Sandbox.snapshot_filesystem``).

Slot snapshots (:mod:`hermes_modal_tool.snapshots`) live inside one sandbox and move
between sandboxes as tar streams; a sandbox image is the coarser tool: the setup runs
once in the container itself (as its root, outside every slot), and every sandbox
started later has it in the read-only root its slots share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import SetupError, SnapshotError, UsageError
from .shared_setup import check_commands

if TYPE_CHECKING:
    from ._backend_view import BackendView


async def snapshot_sandbox(backend: BackendView, profile: str | None, setup: Sequence[str] | str | None,
                           use: bool, timeout_s: int) -> str:
    cfg = backend.profile(profile)
    if cfg.driver != "modal":
        raise UsageError(f"snapshot_sandbox needs a Modal profile; {cfg.name!r} uses driver "
                         f"{cfg.driver!r} (slot snapshots work on every driver: snapshot/fork)")
    commands = check_commands(setup, "snapshot_sandbox") if setup else []
    pool = await backend._pool(cfg.name)
    slot = await pool.acquire("snapshot-sandbox")
    try:
        sandbox: Any = getattr(pool.record_of(slot).sandbox.handle, "sandbox", None)
        if sandbox is None:
            raise SnapshotError(f"profile {cfg.name!r}: its sandbox has no Modal sandbox object")
        for i, command in enumerate(commands):
            proc = await sandbox.exec.aio("sh", "-c", command, timeout=timeout_s)
            code = await proc.wait.aio()
            output = (await proc.stdout.read.aio()) + (await proc.stderr.read.aio())
            if code != 0:
                raise SetupError(f"snapshot_sandbox: command {i + 1} of {len(commands)} ({command[:80]!r}) "
                                 f"exited {code}; output:\n{output[-4000:]}", output=output, returncode=code)
        try:
            image = await sandbox.snapshot_filesystem.aio(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the SDK's errors, named
            raise SnapshotError(f"profile {cfg.name!r}: snapshot_filesystem failed: "
                                f"{type(exc).__name__}: {exc}") from exc
    finally:
        await backend.release(slot, reset_workspace=True)
    image_id = str(image.object_id)
    if use:
        use_image(backend, cfg.name, image_id)
    return image_id


def use_image(backend: BackendView, profile: str, image_id: str) -> None:
    """Profile ``profile``'s sandboxes started from now on (not those running) have image
    ``image_id`` (``snapshot_sandbox(use=True)``; a host process's share of a profile is
    told so by the one that made the image)."""
    new = backend.profiles[profile].model_copy(update={"image": image_id})
    backend.profiles[profile] = new
    pool = backend._pools.get(profile)
    if pool is not None:
        pool.config = new
