"""Unpacked images, cached by digest and shared by every backend on the machine.

Layout of the cache directory (``HERMES_MODAL_TOOL_IMAGE_CACHE``, else
``<user cache dir>/hermes-modal-tool/images``)::

    images/sha256-HEX/rootfs       the unpacked root filesystem (read-only lower of slots)
    images/sha256-HEX/image.json   source, digest, config, size, unpacker (written last)
    refs.json                      registry reference -> digest (a pulled image is reused)
    locks/sha256-HEX.lock          held while the image is unpacked (one unpack per machine)
    locks/sha256-HEX.use           shared-locked by every sandbox using the image (prune skips it)
    tmp/                           unpacks in progress; renamed into images/ when complete

Nothing half-unpacked is ever used: an entry appears (by ``rename``) only once its rootfs
and ``image.json`` are complete.

The cache directory is this process's user's and mode 0700 (checked and set on every
use): an image's files are reached by slots only through their idmapped mounts, never
by the host's users through the path (a set-user-ID file of an image must not be
runnable by them; the unpacker clears those bits too, see :mod:`.unpack`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..errors import ImageError
from . import pull as pulling
from .limits import ImageLimits
from .sources import ImageSource, Source, image_config, open_docker_archive, open_oci, parse_source
from .unpack import unpack_layers

log = logging.getLogger("hermes_modal_tool")
ENV_DIR = "HERMES_MODAL_TOOL_IMAGE_CACHE"
_counters: dict[str, dict[str, int]] = {}  # cache dir -> counters (this process)
_counters_lock = threading.Lock()


def default_cache_dir() -> Path:
    """``$HERMES_MODAL_TOOL_IMAGE_CACHE`` or ``<user cache dir>/hermes-modal-tool/images``."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    import platformdirs

    return Path(platformdirs.user_cache_dir("hermes-modal-tool")) / "images"


@dataclass
class UnpackedImage:
    """An image ready to be a slot's lower layer: ``rootfs`` (host path), its ``digest``
    (None for ``dir:``), ``config`` (``env`` dict, ``workdir``, ``user``, ``entrypoint``,
    ``cmd``) and its size in bytes (None for ``dir:``)."""

    image: str
    rootfs: str
    digest: str | None
    config: dict[str, Any] = field(default_factory=dict)
    size_bytes: int | None = None

    def hold(self, cache: ImageCache) -> Any:
        """Mark the image in use until the returned object is closed (prune skips it)."""
        if self.digest is None:
            return None
        return cache.hold(self.digest)


def _key(digest: str) -> str:
    return digest.replace(":", "-")


def _tree_bytes(root: str) -> int:
    total = 0
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(d, name)).st_blocks * 512
            except OSError:
                pass
    return total


class ImageCache:
    """The machine's unpacked images (see the module doc for the layout).

    Args:
        directory: the cache directory (default :func:`default_cache_dir`); made mode 0700
            and must belong to this process's user.
        limits: bounds on each image unpacked (default: :meth:`ImageLimits.from_env`,
            read when an image is unpacked).

    Thread-safe and safe across processes: a file lock per digest.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None,
                 limits: ImageLimits | None = None) -> None:
        self.dir = Path(directory) if directory is not None else default_cache_dir()
        self.limits = limits

    @property
    def counters(self) -> dict[str, int]:
        """What this process did with this cache directory: ``unpacks`` (images unpacked),
        ``hits`` (found unpacked), ``pulls`` (registry pulls). Shared by every
        :class:`ImageCache` of the same directory in the process."""
        with _counters_lock:
            return dict(_counters.setdefault(str(self.dir.resolve()), {
                "unpacks": 0, "hits": 0, "pulls": 0}))

    def _count(self, what: str) -> None:
        with _counters_lock:
            c = _counters.setdefault(str(self.dir.resolve()), {"unpacks": 0, "hits": 0, "pulls": 0})
            c[what] += 1

    def _dirs(self) -> None:
        """Make the cache's directories, root-only (see the module doc).

        Raises:
            ImageError: the cache directory belongs to another user, or is not a directory.
        """
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.dir.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.stat(self.dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ImageError(
                f"image cache {self.dir} ({ENV_DIR}) is not a directory of this process's "
                f"user (uid {os.geteuid()}; it belongs to uid {st.st_uid}): an image's files "
                "must be reachable by this user only; choose another directory")
        # Slots reach a rootfs through their idmapped mounts only: no host user may reach
        # the path (an image's files keep their owners).
        os.chmod(self.dir, 0o700)
        for sub in ("images", "locks", "tmp"):
            (self.dir / sub).mkdir(mode=0o700, exist_ok=True)
            os.chmod(self.dir / sub, 0o700)

    def _entry(self, digest: str) -> UnpackedImage | None:
        meta = self.dir / "images" / _key(digest) / "image.json"
        try:
            data = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        return UnpackedImage(data["image"], str(meta.parent / "rootfs"), digest,
                             data.get("config") or {}, data.get("size_bytes"))

    def get(self, image: str, progress: Callable[[str], None] | None = None,
            tool_path: str | None = None) -> UnpackedImage:
        """The unpacked image for a profile's ``image`` (blocking: call from a thread).

        ``progress(line, step=None)`` receives a line per step (pull, each layer); for a
        layer ``step`` is ``(i, n)``: layer ``i`` (1-based) of ``n`` is being applied, and
        ``(n, n)`` once all are. ``tool_path`` overrides ``PATH`` when looking for pull tools.

        Raises:
            ImageError: missing, malformed or corrupt image, failed pull or unpack.
        """
        say = progress or (lambda line, step=None: log.info("%s", line))
        source = parse_source(image)
        if source.kind == "dir":
            if not os.path.isdir(source.path):
                raise ImageError(f"image {image!r}: {source.path} is not a directory")
            if os.path.realpath(source.path) == "/":
                raise ImageError(f"image {image!r} is the host's root, which an image shows "
                                 "unfiltered: leave 'image' unset to run slots on the host's "
                                 "root (its root-only files, home directories and the "
                                 "engine's state hidden)")
            return UnpackedImage(image, source.path, None, image_config({}))
        self._dirs()
        if source.kind == "registry":
            digest = self._refs().get(image)
            found = self._entry(digest) if digest else None
            if found is not None:
                self._count("hits")
                return found
            with tempfile.TemporaryDirectory(dir=self.dir / "tmp", prefix="pull-") as tmp:
                say(f"image {image}: pulling")
                with FileLock(str(self.dir / "locks" / "pull.lock")):
                    digest = self._refs().get(image)
                    found = self._entry(digest) if digest else None
                    if found is not None:
                        self._count("hits")
                        return found
                    local = pulling.pull(image, tmp, tool_path)
                    self._count("pulls")
                    got = self._get_local(local, say, display=image)
                    self._set_ref(image, got.digest or "")
                    return got
        return self._get_local(source, say)

    def _open(self, source: Source) -> ImageSource:
        if source.kind in ("oci", "oci-archive"):
            return open_oci(source)
        return open_docker_archive(source)

    def _get_local(self, source: Source, say: Callable[[str], None],
                   display: str | None = None) -> UnpackedImage:
        image = display or source.image
        opened = self._open(source)
        try:
            found = self._entry(opened.digest)
            if found is not None:
                self._count("hits")
                return found
            key = _key(opened.digest)
            with FileLock(str(self.dir / "locks" / f"{key}.lock")):
                found = self._entry(opened.digest)  # another backend unpacked it meanwhile
                if found is not None:
                    self._count("hits")
                    return found
                return self._unpack(opened, source, image, say)
        finally:
            opened.close()

    def _unpack(self, opened: ImageSource, source: Source, image: str,
                say: Callable[[str], None]) -> UnpackedImage:
        key = _key(opened.digest)
        started = time.monotonic()
        tmp = tempfile.mkdtemp(dir=self.dir / "tmp", prefix=key + ".")
        try:
            rootfs = os.path.join(tmp, "rootfs")
            os.mkdir(rootfs, 0o755)

            def layer_line(i: int, n: int, layer: Any) -> None:
                size = f", {layer.size / 1e6:.1f} MB" if layer.size else ""
                say(f"image {image}: layer {i}/{n} {layer.digest[:19]}{size}", step=(i - 1, n))

            done = unpack_layers(opened, rootfs, layer_line, self.limits)
            if done.devices:
                say(f"image {image}: {done.devices} device node(s) skipped (devices from an "
                    f"image are never made on the host): {', '.join(done.device_names)}")
            os.chmod(rootfs, 0o755)
            size = _tree_bytes(rootfs)
            meta = {"image": image, "source": source.image, "digest": opened.digest,
                    "config": image_config(opened.config), "size_bytes": size,
                    "unpacker": "builtin", "unpacked_at": time.time(), "left_out": done.notes(),
                    "layers": [layer.digest for layer in opened.layers]}
            with open(os.path.join(tmp, "image.json"), "w") as fh:
                json.dump(meta, fh, indent=1)
            os.chmod(tmp, 0o700)
            os.rename(tmp, self.dir / "images" / key)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._count("unpacks")
        say(f"image {image}: unpacked {size / 1e6:.1f} MB in {time.monotonic() - started:.1f}s",
            step=(len(opened.layers), len(opened.layers)))
        return self._entry(opened.digest)  # type: ignore[return-value]

    def _refs(self) -> dict[str, str]:
        try:
            return json.loads((self.dir / "refs.json").read_text())
        except (OSError, ValueError):
            return {}

    def _set_ref(self, image: str, digest: str) -> None:
        refs = self._refs()
        refs[image] = digest
        tmp = self.dir / "refs.json.new"
        tmp.write_text(json.dumps(refs, indent=1))
        os.replace(tmp, self.dir / "refs.json")

    def _remove_leftovers(self) -> None:
        """Temporary directories of unpacks and pulls that were interrupted (a crash):
        removed when no process holds their lock."""
        tmp = self.dir / "tmp"
        for path in sorted(tmp.iterdir()) if tmp.is_dir() else ():
            name = path.name
            lock = "pull.lock" if name.startswith("pull-") else name.split(".", 1)[0] + ".lock"
            try:
                with FileLock(str(self.dir / "locks" / lock), timeout=0):
                    shutil.rmtree(path, ignore_errors=True)
            except Timeout:
                continue  # in progress

    def hold(self, digest: str) -> Any:
        """A shared lock on the image's use file: prune leaves the image alone until the
        returned file is closed."""
        self._dirs()
        fh = open(self.dir / "locks" / f"{_key(digest)}.use", "a")
        fcntl.flock(fh, fcntl.LOCK_SH)
        return fh

    def list(self) -> list[dict[str, Any]]:
        """Every cached image: ``image``, ``digest``, ``size_bytes``, ``unpacked_at``
        (epoch seconds), ``unpacker``, ``path``, ``references`` (registry names)."""
        out = []
        refs = self._refs()
        base = self.dir / "images"
        for entry in sorted(base.iterdir()) if base.is_dir() else ():
            try:
                data = json.loads((entry / "image.json").read_text())
            except (OSError, ValueError):
                continue
            data.pop("config", None)
            data["path"] = str(entry / "rootfs")
            data["references"] = sorted(r for r, d in refs.items() if d == data["digest"])
            out.append(data)
        return out

    def size_bytes(self) -> int:
        """Bytes the cached images take (as measured when each was unpacked)."""
        return sum(int(e.get("size_bytes") or 0) for e in self.list())

    def prune(self, keep: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """Remove cached images not in use by a sandbox (and not kept by ``keep(entry)``),
        and leftovers of interrupted unpacks. Returns the entries removed."""
        removed = []
        for entry in self.list():
            if keep is not None and keep(entry):
                continue
            key = _key(entry["digest"])
            with open(self.dir / "locks" / f"{key}.use", "a") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a sandbox uses it
                with FileLock(str(self.dir / "locks" / f"{key}.lock")):
                    trash = self.dir / "tmp" / f"prune-{key}"
                    os.rename(self.dir / "images" / key, trash)
                    shutil.rmtree(trash, ignore_errors=True)
            removed.append(entry)
        self._remove_leftovers()
        refs = {r: d for r, d in self._refs().items() if self._entry(d) is not None}
        if refs != self._refs():
            (self.dir / "refs.json").write_text(json.dumps(refs, indent=1))
        return removed
