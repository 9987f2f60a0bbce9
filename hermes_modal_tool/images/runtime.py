"""How a slot runs on an unpacked image (the local driver's side).

- the image's ``Env`` under the profile's ``env_vars``; its ``WorkingDir`` as the default
  ``workdir``; its ``User`` noted (slots are root in their own user namespace);
  ``Entrypoint``/``Cmd`` are never run;
- the slot's shell is bash: when the image has none (a busybox or distroless image), the
  host's statically linked ``bash-static`` is bound read-only into the slot at
  :data:`BASH_IN_SLOT`, so images need no change.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ..errors import ImageError
from .cache import UnpackedImage

BASH_IN_SLOT = "/run/hmt-bash"
STATIC_BASH = ("bash-static",)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def find_in_image(rootfs: str, name: str, path: str) -> str | None:
    """The image path of program ``name`` on ``path`` (``PATH`` syntax), symlinks resolved
    inside the image; None when the image has none."""
    from .unpack import resolve_in_root

    for d in path.split(":"):
        if not d.startswith("/"):
            continue
        parts = [p for p in d.split("/") if p] + [name]
        try:
            host = resolve_in_root(rootfs, parts, follow_last=True)
        except (OSError, ValueError):
            continue
        if os.path.isfile(host) and os.access(host, os.X_OK):
            # busybox's "bash" applet (an ash) cannot run the slot's shell protocol.
            if os.path.basename(host) != "busybox":
                return "/" + os.path.relpath(host, rootfs)
    return None


def slot_setup(image: UnpackedImage, env: dict[str, str], profile_env: dict[str, str],
               workdir: str | None) -> dict[str, Any]:
    """The agent init fields for slots on ``image``.

    ``env`` is the driver's base environment (``PATH`` ...), ``profile_env`` the profile's
    ``env_vars`` and secrets (they win over the image's ``Env``).

    Raises:
        ImageError: the image has no bash and this machine has no ``bash-static``.
    """
    cfg = image.config or {}
    merged = dict(env)
    merged.update(cfg.get("env") or {})
    merged.update(profile_env)
    path = merged.get("PATH") or DEFAULT_PATH
    bash = None
    if find_in_image(image.rootfs, "bash", path) is None:
        host = next((p for p in map(shutil.which, STATIC_BASH) if p), None)
        if host is None:
            raise ImageError(
                f"image {image.image!r} has no bash (looked on its PATH {path}), and the "
                "slots' shell is bash: install 'bash-static' on this machine (Debian/Ubuntu: "
                "'apt-get install bash-static'; the local driver then runs it in the slot), "
                "or use an image with bash")
        bash = os.path.realpath(host)
    return {"image_root": image.rootfs, "image_bash": bash, "env": merged,
            "workdir": workdir or cfg.get("workdir"), "image": {
                "image": image.image, "digest": image.digest, "user": cfg.get("user"),
                "entrypoint": cfg.get("entrypoint"), "cmd": cfg.get("cmd"),
                "workdir": cfg.get("workdir"), "shell": BASH_IN_SLOT if bash else "bash"}}
