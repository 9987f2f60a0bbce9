"""Apply an image's layers to a directory, as the OCI image spec's layer section says.

Each layer is a tar (plain, gzip or zstd), applied in order over the layers below it:

- an entry replaces what the path held unless both are directories (then the directory
  stays and takes the entry's mode, owner and times);
- ``DIR/.wh.NAME`` (a *whiteout*) deletes ``DIR/NAME`` of the layers below;
- ``DIR/.wh..wh..opq`` (an *opaque* directory) deletes every entry of ``DIR`` from the
  layers below (entries this layer adds to ``DIR`` stay, in whatever order they come);
- hard links point at a path of the image.

No name of a layer is ever resolved through the host's file system: every entry is made
relative to a descriptor of the root (:class:`..agent.fs.beneath.Tree`): parents with
``openat2(RESOLVE_IN_ROOT)`` (a symlink ``/etc -> /host`` in a layer is followed as
``ROOT/host``), the last component never followed (a duplicate name replaces what was
there, whiteouts and opaque markers delete only inside the root); names with ``..`` are
refused.

Ownership, modes, times and extended attributes (``SCHILY.xattr.*``) are kept when
running as root (as the local driver does); otherwise ownership is skipped. What would
carry a privilege onto the host is not kept (see SECURITY.md, "Images and archives"):
device nodes are skipped (counted in the result), set-user-ID and set-group-ID bits are
cleared on files and ``security.capability`` is dropped (a slot has a single uid, its
root, so inside it they could grant nothing). Each layer's blob is hashed while it is
read and compared with its digest; :class:`.limits.Budget` bounds the bytes, entries and
layers while unpacking.
"""

from __future__ import annotations

import io
import logging
import os
import stat
import tarfile
from collections.abc import Callable
from typing import Any

from ..agent.fs.beneath import Tree, open_node, set_meta
from ..errors import ImageError
from .limits import Budget, ImageLimits
from .sources import ImageSource, Layer, _Hashing

log = logging.getLogger("hermes_modal_tool")

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_ROOT = os.geteuid() == 0
#: Extended attributes never kept: file capabilities would be a privilege on the host.
DROPPED_XATTRS = ("security.capability",)


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



class Unpacked:
    """What :func:`unpack_layers` did: ``entries``, apparent ``bytes``, and what it left
    out: ``devices`` (device nodes skipped; ``device_names`` the first ten), ``setid``
    (files whose set-user/group-ID bits were cleared), ``capabilities`` (files whose
    ``security.capability`` was dropped)."""

    def __init__(self) -> None:
        self.devices = 0
        self.device_names: list[str] = []
        self.setid = 0
        self.capabilities = 0

    def notes(self) -> dict[str, Any]:
        return {"devices_skipped": self.devices, "device_names": self.device_names,
                "setid_cleared": self.setid, "capabilities_dropped": self.capabilities}


def _xattrs(member: tarfile.TarInfo, done: Unpacked) -> list[tuple[str, bytes]]:
    out = []
    for key, value in (member.pax_headers or {}).items():
        if key.startswith("SCHILY.xattr."):
            name = key[len("SCHILY.xattr."):]
            if name in DROPPED_XATTRS:
                done.capabilities += 1
                continue
            out.append((name, value.encode("utf-8", "surrogateescape")))
    return out


def _mode(member: tarfile.TarInfo, done: Unpacked) -> int:
    mode = member.mode & 0o7777
    if not member.isdir() and mode & (stat.S_ISUID | stat.S_ISGID):
        done.setid += 1
        mode &= ~(stat.S_ISUID | stat.S_ISGID)
    return mode


def _meta(fd: int, member: tarfile.TarInfo, done: Unpacked, path_fd: bool = False) -> None:
    set_meta(fd, uid=member.uid if _ROOT else None, gid=member.gid,
             mode=_mode(member, done), mtime=member.mtime, xattrs=_xattrs(member, done),
             path_fd=path_fd, xattr_errors=False)


def _chunks(src: Any):
    while src is not None:
        data = src.read(1 << 20)
        if not data:
            return
        yield data


def apply_layer(root: str | Tree, tar: tarfile.TarFile, budget: Budget | None = None,
                done: Unpacked | None = None) -> int:
    """Apply one layer (an open tar stream) to ``root`` (a path, or a :class:`Tree`);
    returns the entries applied. ``budget`` is charged for every entry before it is
    written; ``done`` collects what was left out.

    Raises:
        ValueError: an entry with ``..`` in its name.
        ImageError: the budget is spent.
        OSError: an entry could not be made (a parent that is not a directory ...).
    """
    if not isinstance(root, Tree):
        with Tree(root, in_root=True) as t:
            return apply_layer(t, tar, budget, done)
    tree = root
    done = done if done is not None else Unpacked()
    added: set[tuple[int, int, str]] = set()  # (dev, ino of the parent, name) this layer made
    merged: set[tuple[int, int]] = set()  # directories of this layer a lower layer had too

    def clear_lower(dir_fd: int) -> None:
        """Remove what the lower layers put in the directory ``dir_fd`` (an opaque marker),
        however deep: a directory this layer merged with a lower one keeps only this
        layer's."""
        st = os.fstat(dir_fd)
        for name in os.listdir(dir_fd):
            if (st.st_dev, st.st_ino, name) not in added:
                tree.remove(dir_fd, name)
                continue
            child = tree.lstat(dir_fd, name)
            if child is not None and stat.S_ISDIR(child.st_mode) \
                    and (child.st_dev, child.st_ino) in merged:
                fd = open_node(dir_fd, name, stat.S_IFDIR)
                try:
                    clear_lower(fd)
                finally:
                    os.close(fd)

    dirs: list[tuple[list[str], tuple[int, int], tarfile.TarInfo]] = []
    count = 0
    for member in tar:
        parts = _parts(member.name)
        if not parts:
            continue
        count += 1
        if budget is not None:
            budget.entry(member.size if member.isreg() else 0)
        base = parts[-1]
        if base == OPAQUE or base.startswith(WHITEOUT):
            if base != OPAQUE and base[len(WHITEOUT):] in ("", ".", ".."):
                raise ValueError(f"whiteout {member.name!r} names no entry")
            try:
                parent = tree.parent(parts[:-1])
            except (FileNotFoundError, NotADirectoryError):
                continue  # nothing below to delete
            if base == OPAQUE:
                clear_lower(parent)
            else:
                tree.remove(parent, base[len(WHITEOUT):])
            tree.forget()
            continue
        parent = tree.parent(parts[:-1], create=True)
        pst = os.fstat(parent)
        added.add((pst.st_dev, pst.st_ino, base))
        if member.isdir():
            had = tree.make_dir(parent, base)
            st = tree.lstat(parent, base)
            if had:
                merged.add((st.st_dev, st.st_ino))
            dirs.append((parts, (st.st_dev, st.st_ino), member))
            continue
        if member.isreg():
            fd = tree.make_file(parent, base, _chunks(tar.extractfile(member)))
            try:
                _meta(fd, member, done)
            finally:
                os.close(fd)
            continue
        if member.islnk():
            target = _parts(member.linkname)
            if not target:
                raise ValueError(f"hard link {member.name!r} to the image's root")
            src = os.dup(tree.parent(target[:-1]))
            try:
                parent = tree.parent(parts[:-1], create=True)
                tree.make_link(parent, base, src, target[-1])
            finally:
                os.close(src)
            continue  # the link shares the target's metadata
        if member.issym():
            tree.make_symlink(parent, base, member.linkname)
            kind = stat.S_IFLNK
        elif member.isfifo():
            tree.make_node(parent, base, stat.S_IFIFO)
            kind = stat.S_IFIFO
        elif member.ischr() or member.isblk():
            done.devices += 1
            if len(done.device_names) < 10:
                done.device_names.append("/" + "/".join(parts))
            tree.remove(parent, base)  # the lower layers' entry is replaced all the same
            continue
        else:
            continue
        fd = open_node(parent, base, kind)
        try:
            _meta(fd, member, done, path_fd=True)
        finally:
            os.close(fd)
    for parts, ident, member in reversed(dirs):  # children first: their writes moved the times
        try:
            parent = tree.parent(parts[:-1])
            fd = open_node(parent, parts[-1], stat.S_IFDIR)
        except OSError:
            continue  # replaced by a later entry
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == ident:
                _meta(fd, member, done)
        finally:
            os.close(fd)
    tree.forget()
    return count


def unpack_layers(image: ImageSource, root: str,
                  progress: Callable[[int, int, Layer], None] | None = None,
                  limits: ImageLimits | None = None) -> Unpacked:
    """Apply every layer of ``image`` to the empty directory ``root``, within ``limits``
    (default: :meth:`ImageLimits.from_env`).

    ``progress(i, n, layer)`` is called before layer ``i`` (1-based) of ``n``.

    Returns:
        What was left out (device nodes, set-id bits, file capabilities).

    Raises:
        ImageError: a layer is missing, not a tar, does not match its digest, has an
            entry that would leave the root, or the image passes a limit (named).
    """
    budget = Budget(image.source.image, limits if limits is not None else ImageLimits.from_env())
    n = len(image.layers)
    budget.layers(n)
    done = Unpacked()
    with Tree(root, in_root=True) as tree:
        for i, layer in enumerate(image.layers, 1):
            if progress is not None:
                progress(i, n, layer)
            what = f"image {image.source.image!r}: layer {i}/{n} ({layer.digest})"
            try:
                fh = layer.open()
                plain = _Hashing(_decompressed(fh, layer.media_type))
                with tarfile.open(fileobj=plain, mode="r|") as tar:
                    apply_layer(tree, tar, budget, done)
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
    if done.devices:
        log.warning("image %r: %d device node(s) skipped (%s): devices from an image are "
                    "never made on the host", image.source.image, done.devices,
                    ", ".join(done.device_names))
    return done
