"""A Debian image for tests and benchmarks, built once with mmdebstrap (no registry).

:func:`debian_image` returns ``oci:LAYOUT:bookworm``: Debian bookworm (minbase + python3)
as an OCI layout made with ``umoci``, kept in ``$HMT_BENCH_CACHE`` (default
``/var/cache/hermes-modal-tool-bench``) and reused by every later run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from filelock import FileLock

SUITE = "bookworm"


def cache_dir() -> Path:
    return Path(os.environ.get("HMT_BENCH_CACHE", "/var/cache/hermes-modal-tool-bench"))


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {(proc.stdout + proc.stderr)[-800:]}")


def debian_image(log=print) -> str:
    """The image string of the Debian test image, built on first use (about a minute:
    mmdebstrap downloads from the machine's Debian mirror).

    Raises:
        RuntimeError: mmdebstrap or umoci is missing, or the build failed (its output).
    """
    cache = cache_dir()
    layout = cache / f"debian-{SUITE}-python3-procps-oci"
    image = f"oci:{layout}:{SUITE}"
    if (layout / "index.json").exists():
        return image
    for tool in ("mmdebstrap", "umoci"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is needed to build the Debian test image once: "
                               f"apt-get install {tool}")
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / "build.lock")):
        if (layout / "index.json").exists():
            return image
        work = Path(tempfile.mkdtemp(dir=cache, prefix="build-"))
        try:
            log(f"building the Debian image once (mmdebstrap {SUITE}, minbase + python3) ...")
            _run("mmdebstrap", "--variant=minbase", "--include=python3,procps", "--quiet", SUITE,
                 str(work / "rootfs.tar"))
            tmp_layout = work / "oci"
            _run("umoci", "init", "--layout", str(tmp_layout))
            _run("umoci", "new", "--image", f"{tmp_layout}:{SUITE}")
            _run("umoci", "unpack", "--image", f"{tmp_layout}:{SUITE}", str(work / "bundle"))
            _run("tar", "-xf", str(work / "rootfs.tar"), "-C", str(work / "bundle/rootfs"))
            _run("umoci", "repack", "--image", f"{tmp_layout}:{SUITE}", str(work / "bundle"))
            _run("umoci", "config", "--image", f"{tmp_layout}:{SUITE}", "--config.env",
                 "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--config.cmd", "bash")
            os.rename(tmp_layout, layout)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return image
