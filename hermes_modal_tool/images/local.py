"""The local driver's images: which profiles run on an image, and getting it ready.

A profile runs on its ``image`` locally when the image names a local source (``dir:``,
``oci:``, ``oci-archive:``, ``docker-archive:``) or is a registry reference set in the
profile. The field's default (``python:3.11``, not set by the profile) keeps the host's
root filesystem, as does ``HERMES_MODAL_TOOL_REGISTRY_IMAGES=host`` for every registry
reference (a one-time warning says the image is not used).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from ..config import SandboxConfig
from ..errors import ImageError
from .cache import ImageCache, UnpackedImage
from .runtime import slot_setup
from .sources import is_local_source

log = logging.getLogger("hermes_modal_tool")
progress_log = logging.getLogger("hermes_modal_tool.images")  # a line per pull step and layer
ENV_REGISTRY = "HERMES_MODAL_TOOL_REGISTRY_IMAGES"
DEFAULT_IMAGE = SandboxConfig.model_fields["image"].default


def uses_image(config: SandboxConfig) -> bool:
    """Does the local driver run this profile on its image (else on the host's root)?

    Raises:
        ImageError: ``HERMES_MODAL_TOOL_REGISTRY_IMAGES`` has a value other than
            ``pull`` or ``host``.
    """
    if is_local_source(config.image):
        return True
    mode = os.environ.get(ENV_REGISTRY, "pull").strip().lower() or "pull"
    if mode not in ("pull", "host"):
        raise ImageError(f"{ENV_REGISTRY}={mode!r}: use 'pull' (registry images are pulled "
                         "and used) or 'host' (slots run on the host's root filesystem)")
    if mode == "host":
        return False
    return config.image != DEFAULT_IMAGE or "image" in config.model_fields_set


def _present(image: UnpackedImage | None) -> bool:
    """Still unpacked (``images prune`` may have removed an image no sandbox used)."""
    return image is not None and os.path.isdir(image.rootfs)


class LocalImages:
    """One driver's view of the machine's :class:`ImageCache` (shared with every other).

    Args:
        cache_dir: the cache directory (default: ``HERMES_MODAL_TOOL_IMAGE_CACHE``, else
            the user's cache directory).
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.cache = ImageCache(cache_dir)
        self._ready: dict[str, UnpackedImage] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def resolve(self, config: SandboxConfig) -> UnpackedImage | None:
        """The unpacked image of a profile, or None when its slots use the host's root.

        Pulls and unpacks on first use (a log line per step and layer); later sandboxes
        of this driver reuse the result.

        Raises:
            ImageError: the image is missing, malformed or corrupt, or could not be pulled
                (the message names the image and the cause).
        """
        if not uses_image(config):
            return None
        image = config.image
        found = self._ready.get(image)
        if _present(found):
            return found
        lock = self._locks.setdefault(image, asyncio.Lock())
        async with lock:
            found = self._ready.get(image)
            if not _present(found):
                def say(line: str, step: tuple[int, int] | None = None) -> None:
                    # ``image_step``: layers applied of all; the CLI draws a bar from it.
                    progress_log.info("profile %r: %s", config.name, line,
                                      extra={"image": image, "image_step": step})

                found = await asyncio.to_thread(self.cache.get, image, say)
                self._ready[image] = found
        return found

    def slot_setup(self, image: UnpackedImage, config: SandboxConfig,
                   base_env: dict[str, str]) -> dict[str, Any]:
        """The agent init fields for slots on ``image`` (see :func:`.runtime.slot_setup`)."""
        from ..secrets import resolve_secrets

        profile_env = dict(config.env_vars)
        profile_env.update(resolve_secrets(config.secrets, config.name))
        return slot_setup(image, base_env, profile_env, config.workdir)

    def describe(self) -> dict[str, Any]:
        """For ``get_status()``: the cache directory, its size in bytes, its entries, the
        process's counters and the images this driver uses."""
        try:
            entries = self.cache.list()
        except OSError:
            entries = []
        return {"cache_dir": str(self.cache.dir),
                "size_bytes": sum(int(e.get("size_bytes") or 0) for e in entries),
                "cached": len(entries), "counters": self.cache.counters,
                "in_use": {i: {"digest": u.digest, "user": (u.config or {}).get("user"),
                               "workdir": (u.config or {}).get("workdir")}
                           for i, u in self._ready.items()}}
