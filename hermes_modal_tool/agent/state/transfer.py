"""Snapshots as tar streams: export a frozen layer chain, import one (the agent's side).

Stdlib-only, Python 3.8.

Format (a POSIX tar, pax headers): first ``hmt-snapshot.json`` (format version, the
layer roots ``mounts``, the number of layers, the shell state and the file tools'
directory), then each layer's files, top layer first, as ``L{k}/m{i}/path`` (layer ``k``,
mount ``i``). Owners are made portable: the uid/gid of the slot that wrote a layer
becomes 0 (its root); an importing sandbox maps 0 to each fork's own uid. Whiteouts
are the character devices 0/0 overlayfs uses; overlay markers and other extended
attributes travel as pax records ``HMT.xattr.NAME`` (base64).

Both directions stream: the tar is written (or read) by a worker thread through a pipe,
and the host moves it in chunks of at most :data:`CHUNK_BYTES`, one request per chunk.
An import checks every member: relative names below its layer, no ``..``, nothing
below a symbolic link it made, hard links to earlier members only, devices only as
whiteouts; and writes each beneath a descriptor of its layer's directory
(:mod:`.beneath`): no symlink is followed, a member whose name is taken replaces what
was there (never writes through it), owners and modes are set on the file's own
descriptor.
"""

import base64
import io
import itertools
import json
import os
import stat
import threading

from ..fs import beneath, trees
from ..fs.rootfs import _Layer
from .snapshots import SnapshotError, store

#: Largest chunk of a stream per request (bytes, before base64).
CHUNK_BYTES = 4 * 1024 * 1024
META = "hmt-snapshot.json"
FORMAT = 1
#: Extended attributes that never travel (meaningful only on the file system they are on).
LOCAL_XATTRS = ("trusted.overlay.origin", "trusted.overlay.impure", "trusted.overlay.uuid",
                "trusted.overlay.nlink", "trusted.overlay.upper")
_ids = itertools.count(1)


class _Stream:
    """One export or import: a pipe between a worker thread and the requests."""

    def __init__(self, kind):
        self.kind = kind
        self.r, self.w = os.pipe()
        self.error = None
        self.result = None
        self.thread = None

    def start(self, fn):
        own = "w" if self.kind == "export" else "r"  # the thread's end of the pipe

        def run():
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 - reported on the next request
                self.error = exc
            finally:
                self.close(own)
        self.thread = threading.Thread(target=run, name="hermes-modal-tool-%s" % self.kind, daemon=True)
        self.thread.start()

    def close(self, *ends):
        """Close ends ``"r"``/``"w"`` of the pipe once each (an fd number is reused)."""
        with _close_lock:
            for end in ends or ("r", "w"):
                fd = getattr(self, end)
                if fd is not None:
                    setattr(self, end, None)
                    try:
                        os.close(fd)
                    except OSError:
                        pass


_close_lock = threading.Lock()


def _streams(agent):
    s = getattr(agent, "snapshot_streams", None)
    if s is None:
        s = agent.snapshot_streams = {}
    return s


def _open_stream(streams, kind, work, **attrs):
    """Register a new ``kind`` stream ("export" or "import") whose worker thread runs
    ``work(file)`` on its end of the pipe (written for an export, read for an import);
    ``attrs`` are kept on the stream. Returns the stream's id."""
    stream = _Stream(kind)
    stream.__dict__.update(attrs)
    sid = "%s%d" % ("x" if kind == "export" else "i", next(_ids))
    streams[sid] = stream
    end = os.fdopen(stream.w, "wb", closefd=False) if kind == "export" else \
        os.fdopen(stream.r, "rb", closefd=False)
    stream.start(lambda: work(end))
    return sid


def _stream_of(streams, sid, kind):
    stream = streams.get(sid)
    if stream is None or stream.kind != kind:
        raise SnapshotError("no %s stream %r" % (kind, sid))
    return stream


async def _finish(loop, streams, sid):
    """Wait for stream ``sid``'s worker thread (off the loop), then drop the stream."""
    stream = streams[sid]
    await loop.run_in_executor(None, stream.thread.join)
    del streams[sid]
    stream.close()


async def serve(agent, msg):
    op = msg.get("op")
    loop = agent.loop
    streams = _streams(agent)
    if op == "export_snapshot":
        sid = msg.get("stream")
        if sid is None:
            frozen = store(agent).get(msg.get("snapshot"))
            frozen.users += 1  # kept while it is read
            return {"stream": _open_stream(streams, "export", lambda out: _write_tar(agent, frozen, out),
                                           frozen=frozen)}
        stream = _stream_of(streams, sid, "export")
        data = await loop.run_in_executor(agent.executor("files"), _read_chunk, stream.r,
                                          int(msg.get("max_bytes") or CHUNK_BYTES))
        eof = not data
        if eof:
            await _finish(loop, streams, sid)
            store(agent).unuse(stream.frozen)
            if stream.error is not None:
                raise SnapshotError("export failed: %s: %s" % (type(stream.error).__name__, stream.error))
        return {"data": base64.b64encode(data).decode("ascii"), "eof": eof}
    # import_snapshot
    sid = msg.get("stream")
    if sid is None:
        st = store(agent)
        st.seq += 1
        base = os.path.join(agent.state_dir, "imports", "i%d" % st.seq)
        os.makedirs(base, mode=0o700)
        return {"stream": _open_stream(streams, "import", lambda src: _read_tar(agent, base, src),
                                       base=base)}
    stream = _stream_of(streams, sid, "import")
    data = msg.get("data")
    if data:
        raw = base64.b64decode(data)
        try:
            await loop.run_in_executor(agent.executor("files"), _write_all, stream.w, raw)
        except OSError:
            pass  # the reader stopped: its error is reported at the end
    if not msg.get("end"):
        return {"received": len(data or "")}
    stream.close("w")
    await _finish(loop, streams, sid)
    if stream.error is not None:
        agent.own(_remove(agent, stream.base))
        raise SnapshotError("import failed: %s" % (stream.error,))
    meta, sizes = stream.result
    st = store(agent)
    parent = None
    for k in reversed(range(meta["layers"])):
        frozen = st.add(os.path.join(stream.base, "L%d" % k), 0, parent, sizes[k], meta.get("state") or "")
        frozen.ws = meta.get("workspace")
        if parent is not None:
            parent.users += 1
        parent = frozen
    parent.holds = 1
    return {"snapshot": parent.id, "size_bytes": sum(sizes), "depth": meta["layers"],
            "total_bytes": st.total_bytes()}


async def _remove(agent, path):
    await agent.loop.run_in_executor(agent.executor("files"), trees.remove_tree, path)


def _read_chunk(fd, limit):
    out = []
    got = 0
    while got < limit:
        data = os.read(fd, min(limit - got, 1 << 20))
        if not data:
            break
        out.append(data)
        got += len(data)
    return b"".join(out)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_tar(agent, frozen, out):
    import tarfile  # here, not at the top: it costs ~5 ms of every agent's start

    mounts = agent.upper_plan.mounts
    chain = []
    layer = frozen
    while layer is not None:
        chain.append(layer)
        layer = layer.parent
    meta = {"format": FORMAT, "mounts": mounts, "layers": len(chain), "state": frozen.state,
            "workspace": frozen.ws}
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        raw = json.dumps(meta).encode()
        info = tarfile.TarInfo(META)
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
        for k, layer in enumerate(chain):
            for i in range(len(mounts)):
                top = _Layer(layer.path).dirs(i)[0]
                _add_tree(tar, top, "L%d/m%d" % (k, i), layer.owner)
    out.close()


def _add_tree(tar, top, prefix, owner):
    stack = [("", top)]
    while stack:
        rel, path = stack.pop()
        info = tar.gettarinfo(path, arcname=prefix + ("/" + rel if rel else ""))
        if info is None:
            continue  # a socket: not part of a state
        if info.uid == owner:
            info.uid, info.uname = 0, ""
        if info.gid == owner:
            info.gid, info.gname = 0, ""
        try:
            names = os.listxattr(path, follow_symlinks=False)
        except OSError:
            names = []
        for name in names:
            if name not in LOCAL_XATTRS:
                value = os.getxattr(path, name, follow_symlinks=False)
                info.pax_headers["HMT.xattr." + name] = base64.b64encode(value).decode("ascii")
        if info.isreg():
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
        else:
            tar.addfile(info)
        if info.isdir():
            with os.scandir(path) as it:
                for entry in sorted(it, key=lambda e: e.name, reverse=True):
                    stack.append(((rel + "/" if rel else "") + entry.name, entry.path))


def _read_tar(agent, base, src):
    import tarfile

    mounts = agent.upper_plan.mounts
    meta = None
    sizes = {}
    links = set()
    seen = set()
    trees_open = {}  # (layer, mount) -> Tree of that layer's upper directory

    def upper(k, i):
        path = os.path.join(base, "L%d" % k, "upper" if i == 0 else "layers/%d/upper" % i)
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path
    dirs = []  # (tree, parts, (dev, ino), member, xattrs): set last, children first
    try:
        with tarfile.open(fileobj=src, mode="r|") as tar:
            for member in tar:
                if meta is None:
                    meta = _read_meta(tar, member, mounts)
                    continue
                k, i, parts = _check_member(member, meta, mounts, links, seen)
                tree = trees_open.get((k, i))
                if tree is None:
                    tree = trees_open[(k, i)] = beneath.Tree(upper(k, i), in_root=False)
                xattrs = [(n[len("HMT.xattr."):], base64.b64decode(v))
                          for n, v in member.pax_headers.items() if n.startswith("HMT.xattr.")]
                _write_member(tar, member, tree, parts, xattrs, trees_open, dirs)
                if member.isreg():
                    sizes[k] = sizes.get(k, 0) + member.size
        for tree, parts, ident, member, xattrs in reversed(dirs):
            fd = beneath.open_node(tree.parent(parts[:-1]), parts[-1], stat.S_IFDIR) if parts \
                else os.dup(tree.fd)
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == ident:
                    beneath.set_meta(fd, member.uid, member.gid, stat.S_IMODE(member.mode),
                                     member.mtime, xattrs)
            finally:
                os.close(fd)
    finally:
        for tree in trees_open.values():
            tree.close()
    if meta is None:
        raise SnapshotError("empty snapshot stream")
    for k in range(meta["layers"]):  # every layer has every mount's upper, if empty
        for i in range(len(mounts)):
            upper(k, i)
    return meta, [sizes.get(k, 0) for k in range(meta["layers"])]


def _read_meta(tar, member, mounts):
    if member.name != META or not member.isreg() or member.size > 64 * 1024 * 1024:
        raise SnapshotError("not a snapshot stream: it must start with %s" % META)
    meta = json.loads(tar.extractfile(member).read().decode())
    if meta.get("format") != FORMAT:
        raise SnapshotError("snapshot format %r; this agent reads %d" % (meta.get("format"), FORMAT))
    if list(meta.get("mounts") or []) != list(mounts):
        raise SnapshotError("the snapshot's layer roots %s differ from this sandbox's %s "
                            "(another image or profile?)" % (meta.get("mounts"), mounts))
    if not isinstance(meta.get("layers"), int) or not 1 <= meta["layers"] <= 128:
        raise SnapshotError("bad layer count %r" % (meta.get("layers"),))
    return meta


def _check_member(member, meta, mounts, links, seen):
    """``(layer, mount, path parts below the mount)`` of a member, after the checks of the
    module doc."""
    parts = member.name.split("/")
    if (len(parts) < 2 or member.name.startswith("/") or any(p in ("", ".", "..") for p in parts)
            or not parts[0].startswith("L") or not parts[1].startswith("m")):
        raise SnapshotError("bad member name %r" % member.name)
    try:
        k, i = int(parts[0][1:]), int(parts[1][1:])
    except ValueError:
        raise SnapshotError("bad member name %r" % member.name) from None
    if not (0 <= k < meta["layers"] and 0 <= i < len(mounts)):
        raise SnapshotError("member %r is outside the snapshot's layers" % member.name)
    if any("/".join(parts[:j]) in links for j in range(1, len(parts))):
        raise SnapshotError("member %r is below a symbolic link" % member.name)
    # A FIFO is a file the slot made (the exporter writes them); a device only as a whiteout.
    if (member.ischr() or member.isblk()) and not (member.ischr() and member.devmajor == 0
                                                   and member.devminor == 0):
        raise SnapshotError("device %r is not a whiteout" % member.name)
    if member.islnk() and member.linkname not in seen:
        raise SnapshotError("hard link %r to %r, not an earlier member" % (member.name, member.linkname))
    if member.issym():
        links.add(member.name)
    seen.add(member.name)
    return k, i, parts[2:]


def _write_member(tar, member, tree, parts, xattrs, trees_open, dirs):
    """Make one member beneath its layer's ``tree`` (see :mod:`.beneath`): a duplicate
    name replaces what was there, nothing is followed."""
    if not parts:  # the layer root itself
        if not member.isdir():
            raise SnapshotError("layer root %r is not a directory" % member.name)
        st = os.fstat(tree.fd)
        dirs.append((tree, parts, (st.st_dev, st.st_ino), member, xattrs))
        return
    parent = tree.parent(parts[:-1], create=True)
    name = parts[-1]
    if member.isdir():
        tree.make_dir(parent, name)
        st = tree.lstat(parent, name)
        dirs.append((tree, parts, (st.st_dev, st.st_ino), member, xattrs))
        return
    if member.islnk():
        lk = member.linkname.split("/")
        src_tree = trees_open.get((int(lk[0][1:]), int(lk[1][1:])))
        if src_tree is None or len(lk) < 3:
            raise SnapshotError("hard link %r to %r, not a file" % (member.name, member.linkname))
        src = os.dup(src_tree.parent(lk[2:-1]))
        try:
            tree.make_link(tree.parent(parts[:-1], create=True), name, src, lk[-1])
        finally:
            os.close(src)
        return
    if member.isreg():
        reader = tar.extractfile(member)
        fd = tree.make_file(parent, name, iter(lambda: reader.read(1 << 20), b""))
        try:
            beneath.set_meta(fd, member.uid, member.gid, stat.S_IMODE(member.mode), member.mtime, xattrs)
        finally:
            os.close(fd)
        return
    if member.issym():
        tree.make_symlink(parent, name, member.linkname)
        kind = stat.S_IFLNK
    elif member.isfifo():
        tree.make_node(parent, name, stat.S_IFIFO)
        kind = stat.S_IFIFO
    elif member.ischr():  # a whiteout (0/0: checked)
        tree.make_node(parent, name, stat.S_IFCHR, os.makedev(0, 0))
        kind = stat.S_IFCHR
    else:
        raise SnapshotError("member %r of an unknown type" % member.name)
    fd = beneath.open_node(parent, name, kind)
    try:
        beneath.set_meta(fd, member.uid, member.gid, stat.S_IMODE(member.mode), member.mtime, xattrs,
                         path_fd=True)
    finally:
        os.close(fd)
