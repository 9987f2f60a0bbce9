"""Modal Volumes for the Modal driver: a profile's ``volumes`` with ``source: "modal:NAME"``.

Each is looked up by name (``modal.Volume.from_name``: the SDK's ``VolumeGetOrCreate``
RPC, never creating one) and mounted into the sandbox's container at its ``target``
(``modal.Sandbox.create(volumes={target: volume})``; read-only ones with
``with_mount_options(read_only=True)``, so the container's own mount refuses writes too).
The agent then binds that mount point into every slot at the same ``target``, read-only
unless the volume says otherwise (``hermes_modal_tool/agent/volumes.py``), as it binds a
host directory on the local driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import modal
from modal import exception as mexc

from ..config import SandboxConfig
from ..errors import ConfigError
from ..volumes import modal_volume_name


async def modal_volumes(config: SandboxConfig, client: Any,
                        translate: Callable[[BaseException, SandboxConfig, str], Exception]) -> dict[str, Any]:
    """``{mount path: modal.Volume}`` for ``Sandbox.create(volumes=...)``: every volume of
    ``config``, looked up (hydrated) now so that a missing one is named.

    Raises:
        ConfigError: a Volume that does not exist in the client's Modal environment
            (naming the profile, the Volume and how to create it).
        Exception: the SDK's other errors (connection, credentials), as ``translate``
            (the driver's ``translate_error``) makes them.
    """
    mounts: dict[str, Any] = {}
    for vol in config.volumes:
        name = modal_volume_name(vol.source)
        if name is None:  # refused by check_volumes; kept here as a guard
            raise ConfigError(f"profile {config.name!r}: volume {vol.target!r}: source "
                              f"{vol.source!r} is not 'modal:NAME'")
        volume = modal.Volume.from_name(name)
        try:
            await volume.hydrate.aio(client=client)
        except mexc.NotFoundError as exc:
            raise ConfigError(
                f"profile {config.name!r}: volume {vol.target!r}: Modal Volume {name!r} not "
                f"found ({exc}). Create it with 'modal volume create {name}' and put the "
                f"files in with 'modal volume put {name} LOCAL_PATH'") from None
        except Exception as exc:
            raise translate(exc, config, f"looking up Modal Volume {name!r}") from None
        mounts[vol.target] = volume.with_mount_options(read_only=True) if vol.read_only else volume
    return mounts
