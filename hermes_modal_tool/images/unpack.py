"""Apply an image's layers to a directory, as the OCI image spec's layer section says.

Each layer is a tar (plain, gzip or zstd), applied in order over the layers below it:

- an entry replaces what the path held unless both are directories (then the directory
  stays and takes the entry's mode, owner and times);
- ``DIR/.wh.NAME`` (a *whiteout*) deletes ``DIR/NAME`` of the layers below;
- ``DIR/.wh..wh..opq`` (an *opaque* directory) deletes every entry of ``DIR`` from the
  layers below (entries this layer adds to ``DIR`` stay, in whatever order they come);
- hard links point at a path of the image; no path ever leads out of the root: every
  parent is resolved inside it (a symlink ``/etc -> /host`` in a layer is followed as
  ``ROOT/host``), and names with ``..`` are refused.

Ownership, modes, times, extended attributes (``SCHILY.xattr.*``) and device nodes are
kept when running as root (as the local driver does); otherwise ownership and devices
are skipped. Each layer's blob is hashed while it is read and compared with its digest.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import stat
import tarfile
from collections.abc import Callable

from ..errors import ImageError
from .sources import ImageSource, Layer, _Hashing

log = logging.getLogger("hermes_modal_tool")

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_ROOT = os.geteuid() == 0


def _decompressed(fh, media_type: str):
    """A stream of the layer's tar, decompressed by its magic bytes."""
    head = fh.read(4)
    rest = _Prefixed(head, fh)
    if head[:2] == b"\x1f\x8b":
        import gzip

        return gzip.GzipFile(fileobj=rest, mode="rb")
    if head == b"\x28\xb5\x2f\xfd":
        try:
            import zstandard
        except ImportError:
            try:
                from compression import zstd  # Python 3.14

                return zstd.ZstdFile(rest)
            except ImportError:
                raise ImageError("the layer is zstd-compressed: install the 'zstandard' "
                                 "package or umoci") from None
        return zstandard.ZstdDecompressor().stream_reader(rest)
    return rest


class _Prefixed(io.RawIOBase):
    def __init__(self, head: bytes, fh) -> None:
        self.head = head
        self.fh = fh

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.head:
            n = min(len(buf), len(self.head))
            buf[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.fh.read(len(buf))
        buf[:len(data)] = data
        return len(data)


def _parts(name: str) -> list[str]:
    parts = [p for p in name.split("/") if p and p != "."]
    if ".." in parts:
        raise ValueError(f"entry {name!r} climbs out of the image with '..'")
    return parts


def resolve_in_root(root: str, parts: list[str], follow_last: bool = False) -> str:
    """The host path of ``/parts...`` in the image at ``root``, symlinks of the parents
    (and of the last part when ``follow_last``) resolved inside ``root``."""
    done: list[str] = []
    todo = list(parts)
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        if part == ".":
            continue
        path = os.path.join(root, *done, part)
        if (todo or follow_last) and os.path.islink(path):
            hops += 1
            if hops > 40:
                raise ValueError(f"too many symlinks under /{'/'.join(parts)}")
            target = os.readlink(path)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p] + todo
            continue
        done.append(part)
    return os.path.join(root, *done)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _apply_meta(path: str, member: tarfile.TarInfo) -> None:
    if _ROOT:
        os.lchown(path, member.uid, member.gid)
    for key, value in (member.pax_headers or {}).items():
        if key.startswith("SCHILY.xattr."):
            try:
                os.setxattr(path, key[len("SCHILY.xattr."):],
                            value.encode("utf-8", "surrogateescape"), follow_symlinks=False)
            except OSError:
                pass  # a file system without that namespace
    if not member.issym():
        os.chmod(path, member.mode & 0o7777)
    os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


def apply_layer(root: str, tar: tarfile.TarFile) -> int:
    """Apply one layer (an open tar stream) to ``root``; returns the entries applied.

    Raises:
        ValueError: an entry that would leave the root.
    """
    added: set[str] = set()  # paths this layer made (an opaque marker keeps them)
    merged: set[str] = set()  # directories of this layer that a lower layer had too

    def clear_lower(directory: str) -> None:
        """Remove what the lower layers put in ``directory`` (an opaque marker), however
        deep: a directory this layer merged with a lower one keeps only this layer's."""
        for name in os.listdir(directory):
            full = os.path.join(directory, name)
            if full not in added:
                _remove(full)
            elif full in merged:
                clear_lower(full)

    dir_times: list[tuple[str, tarfile.TarInfo]] = []
    count = 0
    for member in tar:
        parts = _parts(member.name)
        if not parts:
            continue
        count += 1
        base = parts[-1]
        parent = resolve_in_root(root, parts[:-1])
        if base == OPAQUE:
            if os.path.isdir(parent):
                clear_lower(parent)
            continue
        if base.startswith(WHITEOUT):
            _remove(os.path.join(parent, base[len(WHITEOUT):]))
            continue
        os.makedirs(parent, exist_ok=True)
        path = os.path.join(parent, base)
        added.add(path)
        if member.isdir():
            if os.path.isdir(path) and not os.path.islink(path):
                merged.add(path)
            else:
                _remove(path)
                os.mkdir(path, 0o700)
            dir_times.append((path, member))
            continue
        _remove(path)
        if member.isreg():
            with open(path, "wb") as out:
                src = tar.extractfile(member)
                if src is not None:
                    shutil.copyfileobj(src, out, 1 << 20)
        elif member.issym():
            os.symlink(member.linkname, path)
        elif member.islnk():
            target = resolve_in_root(root, _parts(member.linkname))
            os.link(target, path)
            continue  # the link shares the target's metadata
        elif member.isfifo():
            os.mkfifo(path)
        elif member.ischr() or member.isblk():
            if not _ROOT:
                continue
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            os.mknod(path, kind | 0o600, os.makedev(member.devmajor, member.devminor))
        else:
            continue
        _apply_meta(path, member)
    for path, member in reversed(dir_times):  # children first: their writes moved the times
        _apply_meta(path, member)
    return count


def unpack_layers(image: ImageSource, root: str,
                  progress: Callable[[int, int, Layer], None] | None = None) -> None:
    """Apply every layer of ``image`` to the empty directory ``root``.

    ``progress(i, n, layer)`` is called before layer ``i`` (1-based) of ``n``.

    Raises:
        ImageError: a layer is missing, not a tar, does not match its digest, or has an
            entry that would leave the root.
    """
    n = len(image.layers)
    for i, layer in enumerate(image.layers, 1):
        if progress is not None:
            progress(i, n, layer)
        what = f"image {image.source.image!r}: layer {i}/{n} ({layer.digest})"
        try:
            fh = layer.open()
            plain = _Hashing(_decompressed(fh, layer.media_type))
            with tarfile.open(fileobj=plain, mode="r|") as tar:
                apply_layer(root, tar)
            got_plain = plain.drain()
            got = fh.drain()
        except ImageError as exc:
            raise ImageError(f"{what}: {exc}") from exc
        except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
            raise ImageError(f"{what} could not be unpacked: {exc}") from exc
        if layer.verify and got != layer.digest:
            raise ImageError(f"{what} is corrupt: its content hashes to {got}")
        if layer.diff_id and got_plain != layer.diff_id:
            raise ImageError(f"{what} is corrupt: its tar hashes to {got_plain}, the image "
                             f"config says {layer.diff_id}")
