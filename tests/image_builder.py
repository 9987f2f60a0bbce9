"""Test images built here, no registry: umoci writes the OCI layouts, skopeo converts them.

- :func:`busybox_rootfs`: a tiny root filesystem from Debian's ``busybox-static`` (no bash);
- :func:`build_images`: an OCI layout with ``base`` (that rootfs, with ``Env`` and
  ``WorkingDir``) and ``two`` (one more layer, made by ``umoci repack``, that deletes a file
  and replaces a directory with a file, and a layer written here with an opaque directory
  ``.wh..wh..opq`` and an explicit whiteout), plus the same images as an OCI archive and a
  ``docker save``-format archive.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

TOOLS = ("umoci", "skopeo", "busybox")
OS_RELEASE = 'PRETTY_NAME="hmt test image"\nNAME="hmt-test"\nID=hmttest\nVERSION_ID="1"\n'


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def images_for_tests(tmp_path_factory) -> dict[str, str]:
    """:func:`build_images` for a module's fixture: skips where images cannot be slots'
    lower layers (not root), or naming the tools that are missing."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("images are the lower layer of a slot's layered root: that needs root")
    skip_without(*TOOLS)
    return build_images(tmp_path_factory.mktemp("images"))


def skip_without(*tools: str) -> None:
    """Skip the test, naming the tools, where one of ``tools`` is not on PATH (they build
    its images; ``bash scripts/setup.sh dev`` installs them as root on Debian/Ubuntu)."""
    import pytest

    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} to build its test images (not installed here: "
                    f"'bash scripts/setup.sh dev' installs them as root on Debian/Ubuntu)")


def run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stdout}{proc.stderr}")


def busybox_rootfs(root: Path) -> None:
    """Busybox (static) with its applets linked in /bin, an os-release and a few files."""
    for d in ("bin", "etc", "root", "tmp", "usr/share/hmt", "opt/data/sub", "opt/opq", "srv/app"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    shutil.copy2(shutil.which("busybox"), root / "bin/busybox")
    applets = subprocess.run([str(root / "bin/busybox"), "--list"], capture_output=True,
                             text=True, check=True).stdout.split()
    for name in applets:
        if name != "busybox" and not (root / "bin" / name).exists():
            os.symlink("busybox", root / "bin" / name)
    (root / "etc/os-release").write_text(OS_RELEASE)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    (root / "usr/share/hmt/marker").write_text("from the image\n")
    (root / "etc/removed.txt").write_text("deleted by the upper layer\n")
    (root / "opt/data/a").write_text("a\n")
    (root / "opt/data/sub/b").write_text("b\n")
    (root / "opt/opq/old").write_text("old\n")
    (root / "opt/opq/deep").mkdir()
    (root / "opt/opq/deep/old2").write_text("old2\n")
    (root / "opt/keep").write_text("keep\n")
    (root / "srv/app/hello.txt").write_text("hello from the workdir\n")


def _opaque_layer(path: Path) -> None:
    """A layer as the spec writes one by hand: opq/ made opaque (its old entries go, the
    new one stays, the marker after it), and an explicit whiteout of /opt/keep."""
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes | None = None, kind: bytes = tarfile.REGTYPE) -> None:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
            info.size = len(data or b"")
            tar.addfile(info, io.BytesIO(data or b""))

        add("opt/opq", kind=tarfile.DIRTYPE)
        add("opt/opq/deep", kind=tarfile.DIRTYPE)  # kept, but not what the lower had in it
        add("opt/opq/deep/new2", b"new2\n")
        add("opt/opq/new", b"new\n")
        add("opt/opq/.wh..wh..opq")
        add("opt/.wh.keep")


def build_images(work: Path) -> dict[str, str]:
    """Build the test images under ``work``; returns image strings by name: ``plain``
    (busybox, no config), ``base``,
    ``two`` (OCI layout), ``two_archive`` (OCI archive), ``two_docker`` (docker archive),
    ``busybox_dir`` (``dir:``), ``layout`` (the layout's path)."""
    layout = work / "layout"
    rootfs = work / "rootfs"
    busybox_rootfs(rootfs)
    run("umoci", "init", "--layout", str(layout))
    run("umoci", "new", "--image", f"{layout}:base")
    bundle = work / "bundle"
    run("umoci", "unpack", "--image", f"{layout}:base", str(bundle))
    shutil.rmtree(bundle / "rootfs")
    shutil.copytree(rootfs, bundle / "rootfs", symlinks=True)
    run("umoci", "repack", "--image", f"{layout}:base", str(bundle))
    run("umoci", "tag", "--image", f"{layout}:base", "plain")  # no Env, no WorkingDir
    run("umoci", "config", "--image", f"{layout}:base", "--config.env", "HMT_IMAGE_VAR=from-image",
        "--config.env", "PATH=/usr/local/bin:/usr/bin:/bin", "--config.env", "HMT_BOTH=image",
        "--config.workingdir", "/srv/app", "--config.user", "1000:1000",
        "--config.cmd", "/bin/false", "--tag", "base")
    shutil.rmtree(bundle)
    # two: umoci's own diff (a deleted file, a directory replaced by a file), then ours.
    run("umoci", "unpack", "--image", f"{layout}:base", str(bundle))
    (bundle / "rootfs/etc/removed.txt").unlink()
    shutil.rmtree(bundle / "rootfs/opt/data")
    (bundle / "rootfs/opt/data").write_text("a file now\n")
    run("umoci", "repack", "--image", f"{layout}:two", str(bundle))
    shutil.rmtree(bundle)
    _opaque_layer(work / "opaque.tar")
    run("umoci", "raw", "add-layer", "--image", f"{layout}:two", str(work / "opaque.tar"))
    archive = work / "two.oci.tar"
    with tarfile.open(archive, "w") as tar:
        for name in sorted(os.listdir(layout)):
            tar.add(layout / name, arcname=name)
    docker = work / "two.docker.tar"
    run("skopeo", "copy", "--quiet", f"oci:{layout}:two", f"docker-archive:{docker}:hmt/two:latest")
    return {"base": f"oci:{layout}:base", "plain": f"oci:{layout}:plain", "two": f"oci:{layout}:two",
            "two_archive": f"oci-archive:{archive}:two", "two_docker": f"docker-archive:{docker}",
            "busybox_dir": f"dir:{rootfs}", "layout": str(layout)}


def tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its kind, mode, owner and content or link target."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("l", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("d", st.st_mode & 0o7777, st.st_uid)
            else:
                out[rel] = ("f", st.st_mode & 0o7777, st.st_uid, p.read_bytes()[:64])
    return out
