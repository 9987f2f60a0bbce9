"""Round three, classes 2 and 3: what an image carries never becomes a privilege or an
unbounded cost on the host.

- Class 2: a set-user-ID-root program, a file capability and device nodes in an image.
  Verdict as a host user (``nobody``, through ``setpriv``): the image cache cannot be
  listed, the image's program cannot be run, and even with the cache opened up by hand
  it runs with the user's own ids; no device node exists in the cache.
- Class 3: a 20 KiB-sized archive of sparse members, too many layers, too many entries:
  each stops with an error naming the image and the limit, before the bytes are
  written (a file-size rlimit would stop a writer first).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import stat
import struct
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from hermes_modal_tool import ImageError
from hermes_modal_tool.images import ImageCache

from .archives import docker_archive, member, sparse

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
#: ``security.capability`` v2 granting ``cap_setuid`` (effective).
CAP_SETUID = struct.pack("<IIIII", 0x02000001, 1 << 7, 0, 0, 0).decode("utf-8", "surrogateescape")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root (owners kept) and setpriv")


@pytest.fixture
def open_dir():
    """A directory every host user can traverse (as ``/var/cache`` or ``/srv`` would be),
    where a cache set by ``HERMES_MODAL_TOOL_IMAGE_CACHE`` may live."""
    path = Path(tempfile.mkdtemp(prefix="hmt-open-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    """Run ``argv`` as ``nobody``, from a shell that already is (``setpriv`` itself still
    holds root's capabilities while it executes its command)."""
    return subprocess.run([*NOBODY, "sh", "-c", 'exec "$@"', "sh", *argv], capture_output=True,
                          text=True, timeout=30)


def privileged_image(path: Path) -> str:
    id_bin = Path(shutil.which("id")).read_bytes()
    return docker_archive(path, [[
        member("bin", tarfile.DIRTYPE),
        member("bin/id", data=id_bin, mode=0o4755),  # set-user-ID root
        member("bin/gid", data=id_bin, mode=0o2755, gid=0),  # set-group-ID root
        member("bin/capped", data=id_bin, mode=0o755, pax={
            "SCHILY.xattr.security.capability": CAP_SETUID, "SCHILY.xattr.user.hmt": "kept"}),
        member("dev", tarfile.DIRTYPE),
        member("dev/sda", tarfile.BLKTYPE, mode=0o666, dev=(8, 0)),
        member("dev/mem", tarfile.CHRTYPE, mode=0o666, dev=(1, 1)),
        member("etc", tarfile.DIRTYPE),
        member("etc/legit", data=b"legit\n"),
    ]])


def test_host_users_cannot_reach_the_cache_or_run_its_setuid_program(open_dir, tmp_path):
    cache = open_dir / "cache"
    got = ImageCache(cache).get(privileged_image(tmp_path / "img.tar"))
    program = Path(got.rootfs) / "bin/id"
    # Positive controls: the program is there and runs; nobody runs programs it can reach.
    assert subprocess.run([program, "-u"], capture_output=True, text=True).stdout == "0\n"
    assert as_nobody(shutil.which("id"), "-u").stdout == "65534\n"
    assert as_nobody("ls", str(open_dir)).returncode == 0
    listing = as_nobody("ls", str(cache))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr, listing
    run = as_nobody(str(program))
    assert run.returncode != 0 and "euid=0" not in run.stdout, run
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_setid_bits_capabilities_and_devices_never_land_with_their_privileges(open_dir, tmp_path):
    cache = open_dir / "cache"
    got = ImageCache(cache).get(privileged_image(tmp_path / "img.tar"))
    root = Path(got.rootfs)
    assert (root / "etc/legit").read_text() == "legit\n"  # positive control: the layer landed
    for name in ("bin/id", "bin/gid"):
        mode = (root / name).stat().st_mode
        assert mode & (stat.S_ISUID | stat.S_ISGID) == 0 and mode & 0o755 == 0o755, oct(mode)
    assert os.getxattr(root / "bin/capped", "user.hmt") == b"kept"  # other xattrs are kept
    with pytest.raises(OSError):
        os.getxattr(root / "bin/capped", "security.capability")
    devices = [p for p in root.rglob("*") if stat.S_ISBLK(p.lstat().st_mode)
               or stat.S_ISCHR(p.lstat().st_mode)]
    assert devices == []
    [entry] = ImageCache(cache).list()
    assert entry["left_out"]["devices_skipped"] == 2, entry
    assert entry["left_out"]["device_names"] == ["/dev/sda", "/dev/mem"], entry
    # Even with the cache opened up by hand, a host user runs the program as itself.
    for p in (cache, cache / "images", root.parent):
        os.chmod(p, 0o755)
    run = as_nobody(str(root / "bin/id"))
    assert run.returncode == 0 and "uid=65534" in run.stdout and "euid" not in run.stdout, run
    run = as_nobody(str(root / "bin/gid"))
    assert run.returncode == 0 and "egid" not in run.stdout, run


def test_a_cache_directory_of_another_user_is_refused(open_dir, tmp_path):
    cache = open_dir / "cache"
    cache.mkdir()
    os.chown(cache, 65534, 65534)  # made by a host user before the engine first ran
    with pytest.raises(ImageError, match=r"belongs to uid 65534"):
        ImageCache(cache).get(privileged_image(tmp_path / "img.tar"))
    assert list(cache.iterdir()) == []


# -- class 3: bounds ------------------------------------------------------------------

@pytest.fixture
def file_size_cap():
    """Writes past 64 MiB fail with EFBIG for the test's duration (so an unpacker that
    writes a sparse member out fails with another error instead of filling the disk)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    signal.signal(signal.SIGXFSZ, handler)


def test_sparse_members_count_by_their_apparent_size(tmp_path, monkeypatch, file_size_cap):
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_MAX_BYTES", "256M")
    small = docker_archive(tmp_path / "small.tar", [[member("a", data=b"a\n"), sparse("s", 1 << 20)]])
    got = ImageCache(tmp_path / "cache").get(small)  # positive control: under the limit
    assert (Path(got.rootfs) / "s").stat().st_size == 1 << 20
    bomb_path = tmp_path / "bomb.tar"
    bomb = docker_archive(bomb_path, [[member("a", data=b"a\n")] + [
        sparse(f"big{i}", 1 << 30) for i in range(2)]])
    assert bomb_path.stat().st_size < 64 << 10
    with pytest.raises(ImageError) as err:
        ImageCache(tmp_path / "cache").get(bomb)
    text = str(err.value)
    assert bomb in text and "268435456 bytes (256.0 MiB)" in text, text
    assert "HERMES_MODAL_TOOL_IMAGE_MAX_BYTES" in text, text
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []  # the partial unpack is gone


def test_layer_and_entry_counts_are_bounded(tmp_path, monkeypatch):
    from hermes_modal_tool.images import ImageLimits

    layers = [[member(f"l{i}", data=b"x")] for i in range(5)]
    image = docker_archive(tmp_path / "layers.tar", layers)
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_MAX_LAYERS", "4")
    with pytest.raises(ImageError, match=r"has 5 layers, over the limit of 4 .*MAX_LAYERS"):
        ImageCache(tmp_path / "a").get(image)
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_MAX_LAYERS", "5")
    assert (Path(ImageCache(tmp_path / "a").get(image).rootfs) / "l4").exists()  # control
    wide = docker_archive(tmp_path / "wide.tar", [[member(f"f{i}", data=b"x") for i in range(30)]])
    with pytest.raises(ImageError, match=r"wide.tar.*more than 20 entries .*max_files"):
        ImageCache(tmp_path / "b", limits=ImageLimits(max_files=20)).get(wide)
    got = ImageCache(tmp_path / "b", limits=ImageLimits(max_files=30)).get(wide)  # control
    assert len(os.listdir(got.rootfs)) == 30


def test_limits_from_the_environment_are_checked():
    from hermes_modal_tool.images import ImageLimits

    assert ImageLimits.from_env({}) == ImageLimits(16 << 30, 256, 2_000_000)
    assert ImageLimits.from_env({"HERMES_MODAL_TOOL_IMAGE_MAX_BYTES": "2G"}).max_bytes == 2 << 30
    for var, bad in (("HERMES_MODAL_TOOL_IMAGE_MAX_BYTES", "lots"),
                     ("HERMES_MODAL_TOOL_IMAGE_MAX_FILES", "-3")):
        with pytest.raises(ImageError, match=f"{var}={json.dumps(bad)[1:-1]!r}"):
            ImageLimits.from_env({var: bad})
