"""A Debian 13 (trixie) root filesystem for the host matrix's ``d13-root`` cell: the VM
boots on it (instead of on this host's ``/``) and runs the project from its built wheel
with trixie's Python (3.13).

Built once into :data:`tests.hosts.vm.CACHE` ``/trixie-root-<key>`` with ``debootstrap``
(``--variant=minbase`` plus :data:`PACKAGES`) from the Debian mirror, with a virtual
environment (``/opt/hmt-venv``, trixie's ``python3``) holding the project's runtime
dependencies at the versions ``scripts/constraints.txt`` pins (cp313 wheels downloaded on
this host with ``pip download``, then installed in the tree without an index), and
pytest for the cell's tests. ``<key>``
hashes what goes in (the package list, the suite, the dependency list and its pins): a
change builds a new tree. The project itself is built from the checkout as a wheel
(``pip wheel --no-deps``) and reinstalled into the tree's environment on every run.

The tree is made with ``chroot`` (debootstrap's own, and ``chroot TREE python3 -m venv``
and ``pip install``), with no host directory mounted into it: the wheels are copied in.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.hosts import vm

SUITE = "trixie"
MIRROR = os.environ.get("HERMES_MODAL_TOOL_HOSTS_MIRROR", "http://deb.debian.org/debian")
#: What the VM's stage 2 and the cell script call (mount, ip, hostname, setpriv, free,
#: ps, find), what the local driver calls (bwrap, ip, nft, tar, unshare, nsenter,
#: mkfs.ext4) and the Python the project runs on and slots' commands call (python3).
PACKAGES = ("python3", "python3-venv", "bash", "bubblewrap", "util-linux", "mount", "procps",
            "iproute2", "kmod", "nftables", "hostname", "tar", "findutils", "e2fsprogs",
            "ca-certificates")
VENV = "/opt/hmt-venv"
#: The project's runtime dependencies (pyproject's ``dependencies``), pinned by this file.
CONSTRAINTS = Path(__file__).resolve().parents[2] / "scripts" / "constraints.txt"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
#: What the cell's isolation and limit tests need besides the project (pinned alike).
TEST_DEPS = ["pytest", "pytest-asyncio", "pytest-timeout"]


def missing() -> str | None:
    """Why the tree cannot be built here, or None (it is built already, or can be)."""
    if shutil.which("debootstrap") is None and not any(vm.CACHE.glob("trixie-root-*/.done")):
        return "debootstrap is not installed (Debian: debootstrap), for the Debian 13 root"
    return None


def _dependencies() -> list[str]:
    """pyproject.toml's ``dependencies`` (the environment's markers evaluated by pip)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the harness runs on 3.11+
        import tomli as tomllib
    return tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"] + TEST_DEPS


def _key(deps: list[str]) -> str:
    text = repr((SUITE, PACKAGES, deps, CONSTRAINTS.read_text()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _chroot(tree: Path, *argv: str) -> str:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LANG": "C.UTF-8"}  # none of this host's pip settings
    proc = subprocess.run(["chroot", str(tree), *argv], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"chroot {tree} {' '.join(argv)}: exit {proc.returncode}: "
                           f"{(proc.stdout + proc.stderr)[-2000:]}")
    return proc.stdout


def _mounted_under(tree: Path) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == str(tree) or p.startswith(str(tree) + "/")]


def tree(log=print) -> Path:
    """The cached trixie tree with its environment's dependencies, built if missing."""
    deps = _dependencies()
    root = vm.CACHE / f"trixie-root-{_key(deps)}"
    if (root / ".done").exists():
        return root
    vm.CACHE.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="trixie-build-", dir=vm.CACHE))
    try:
        log(f"rootfs: debootstrap {SUITE} into {build} (minutes, once)")
        debs = vm.CACHE / "trixie-debs"
        debs.mkdir(exist_ok=True)
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--cache-dir={debs}",
             "--include=" + ",".join(PACKAGES), SUITE, str(build), MIRROR],
            capture_output=True, text=True)
        left = _mounted_under(build)
        if left:  # debootstrap unmounts what it mounted; make sure, innermost first
            for point in sorted(left, key=len, reverse=True):
                subprocess.run(["umount", "-l", point], check=False)
        if proc.returncode:
            raise RuntimeError(f"debootstrap failed ({proc.returncode}): {proc.stdout[-1500:]}"
                               f"{proc.stderr[-1500:]}")
        wheels = build / "opt" / "hmt-wheels"
        wheels.mkdir(parents=True)
        log("rootfs: pip download of the runtime dependencies (cp313 wheels)")
        pyver = _chroot(build, "python3", "-c",
                        "import sys; print('%d.%d' % sys.version_info[:2])").strip()
        plats = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
                 for a in ("--platform", p)]
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                               "--python-version", pyver, "--implementation", "cp", *plats,
                               "-c", str(CONSTRAINTS), "-d", str(wheels), *deps],
                              capture_output=True, text=True,
                              env={**os.environ, "PIP_CONSTRAINT": ""})
        if proc.returncode:
            raise RuntimeError(f"pip download for Python {pyver} failed: {proc.stderr[-2000:]}")
        _chroot(build, "python3", "-m", "venv", VENV)
        _chroot(build, f"{VENV}/bin/pip", "install", "-q", "--no-index",
                "--find-links", "/opt/hmt-wheels", *deps)
        (build / ".done").write_text(pyver + "\n")
        os.rename(build, root)
        return root
    finally:
        if build.exists() and not _mounted_under(build):
            shutil.rmtree(build, ignore_errors=True)


def install_wheel(root: Path, repo: Path, log=print) -> str:
    """Build the checkout's wheel (``pip wheel --no-deps``) and (re)install it into the
    tree's environment; returns the wheel's file name."""
    with tempfile.TemporaryDirectory(prefix="hmt-wheel-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp,
                        str(repo)], check=True, capture_output=True)
        (wheel,) = Path(tmp).glob("hermes_modal_tool-*.whl")
        dest = root / "opt" / "hmt-wheels" / "project"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        shutil.copy(wheel, dest / wheel.name)
    log(f"rootfs: installing {wheel.name} into {root}{VENV}")
    _chroot(root, f"{VENV}/bin/pip", "install", "-q", "--no-index", "--no-deps",
            "--force-reinstall", f"/opt/hmt-wheels/project/{wheel.name}")
    if not re.search(r"hermes[_-]modal[_-]tool", _chroot(root, f"{VENV}/bin/pip", "list")):
        raise RuntimeError("the wheel is not installed in the tree's environment")
    return wheel.name
