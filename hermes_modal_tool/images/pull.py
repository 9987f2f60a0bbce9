"""Pull a registry reference with the tools this machine has, into a local source.

In order of preference: ``skopeo`` (copies the image into an OCI layout, no daemon),
``podman`` (pull, then save as an OCI archive), ``docker`` (pull, then ``docker save``).
When none is installed, or all fail, :class:`~hermes_modal_tool.errors.ImageError` says
which were looked for, what each said, and how to install one.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess

from ..errors import ImageError
from .sources import Source

TOOLS = ("skopeo", "podman", "docker")
INSTALL_HINT = ("install one of them, e.g. 'apt-get install skopeo' (Debian/Ubuntu), "
                "'dnf install skopeo' (Fedora), or podman/docker; or save the image "
                "elsewhere ('docker save IMAGE -o image.tar') and use "
                "'docker-archive:/path/image.tar'")
TIMEOUT_S = 3600


def docker_ref(image: str) -> str:
    """``python:3.11`` -> ``docker.io/library/python:3.11`` (skopeo wants it whole)."""
    name = image
    first = name.split("/", 1)[0]
    if "/" not in name or ("." not in first and ":" not in first and first != "localhost"):
        name = "docker.io/" + (name if "/" in name else "library/" + name)
    last = name.rsplit("/", 1)[-1]
    if ":" not in last and "@" not in last:
        name += ":latest"
    return name


def loopback_registry(ref: str) -> bool:
    """Whether ``ref`` (as :func:`docker_ref` gives it) names a registry on this machine
    (``localhost`` or ``127.0.0.0/8``, any port): Docker treats those as insecure
    registries by default (plain HTTP), and so does the pull here."""
    host = ref.split("/", 1)[0].rsplit(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _run(argv: list[str]) -> str | None:
    """Run a pull command; None when it worked, else what it said."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if proc.returncode == 0:
        return None
    text = proc.stdout.decode("utf-8", "replace").strip().splitlines()
    return (text[-1] if text else f"exit status {proc.returncode}")[:400]


def pull(image: str, dest_dir: str, path: str | None = None) -> Source:
    """Pull registry reference ``image`` into ``dest_dir`` (an empty directory) and return
    the local source to read it from. ``path`` overrides ``PATH`` for finding the tools.

    Raises:
        ImageError: no tool is installed, or every one failed (each one's message given).
    """
    ref = docker_ref(image)
    failures = []
    found = {t: shutil.which(t, path=path) for t in TOOLS}
    if found["skopeo"]:
        layout = os.path.join(dest_dir, "oci")
        tls = ["--src-tls-verify=false"] if loopback_registry(ref) else []
        why = _run([found["skopeo"], "copy", "--quiet", *tls, f"docker://{ref}",
                    f"oci:{layout}:image"])
        if why is None:
            return Source(image, "oci", layout, "image")
        failures.append(f"skopeo: {why}")
    if found["podman"]:
        archive = os.path.join(dest_dir, "image.oci.tar")
        tls = ["--tls-verify=false"] if loopback_registry(ref) else []
        why = _run([found["podman"], "pull", "--quiet", *tls, ref]) or _run(
            [found["podman"], "save", "--format", "oci-archive", "-o", archive, ref])
        if why is None:
            return Source(image, "oci-archive", archive, None)
        failures.append(f"podman: {why}")
    if found["docker"]:
        archive = os.path.join(dest_dir, "image.docker.tar")
        why = _run([found["docker"], "pull", "--quiet", image]) or _run(
            [found["docker"], "save", "-o", archive, image])
        if why is None:
            return Source(image, "docker-archive", archive, None)
        failures.append(f"docker: {why}")
    if not failures:
        raise ImageError(f"image {image!r}: pulling a registry image needs skopeo, podman or "
                         f"docker, and none of them is installed (looked for "
                         f"{', '.join(TOOLS)} on PATH): {INSTALL_HINT}")
    raise ImageError(f"image {image!r} could not be pulled (tried "
                     f"{', '.join(t for t in TOOLS if found[t])}): " + "; ".join(failures))
