"""File tools confined to a slot's workspace, safe against symlink and swap tricks.

Stdlib-only, Python 3.8.

Paths are relative to the workspace root, or absolute under the path the slot
sees its workspace at (``/data/slot_3/...``). Every path is walked one component
at a time with ``openat``-style calls and ``O_NOFOLLOW`` from a descriptor of the
workspace root, so a symlink swapped in between a check and a use cannot lead
outside it (the kernel refuses to follow it). Symlinks inside the workspace are
followed only while they stay inside it; ``..`` cannot climb above the root.
When the slot runs as its own uid, files the agent creates are given to that uid,
and a file not owned by it is refused (so a hard link to a foreign file is no way
out).
"""

import errno
import os
import stat

from ..fs.trees import empty_dir

MAX_READ_BYTES = 64 * 1024 * 1024
READ_CHUNK = 1024 * 1024
# An archive is built in the agent's memory and sent in one frame: cap it even when
# the caller gives no max_bytes (a sparse 100 GB file must not exhaust the agent).
MAX_ARCHIVE_BYTES = 128 * 1024 * 1024
MAX_LINKS = 40


def preload():
    """Import what the archive and checksum tools use (lazily, for a fast start); must run
    before a tool runs with a slot's credentials, which cannot read the agent's own files."""
    import gzip  # noqa: F401
    import hashlib  # noqa: F401
    import io  # noqa: F401
    import tarfile  # noqa: F401
    import time  # noqa: F401
    import zipfile  # noqa: F401


class FileToolError(Exception):
    """Raised for a bad path or file operation; the message is shown to the model."""


class Workspace:
    """The files a slot's tools reach: ``host`` (as the agent sees it) shown at ``path``.

    Two layouts:

    - workspace-only: ``host`` is the slot's workspace, ``path`` where the slot sees it;
      absolute paths outside ``path`` are refused;
    - a whole root (``path == "/"``): ``host`` is the slot's root filesystem and ``cwd`` its
      workspace; absolute paths are in the slot's view, relative ones relative to ``cwd``,
      ``..`` stops at the root and absolute symlinks resolve inside it (as the kernel's
      ``RESOLVE_IN_ROOT`` does). Permissions are the slot's: the caller runs the tools
      with the slot's filesystem uid (:class:`.mounts.FsCreds`).
    """

    def __init__(self, host, path, uid=None, gid=None, cwd=None):
        self._host = host  # a path, or a callable giving it (a slot's root changes on reset)
        self.path = path.rstrip("/") or "/"
        self.uid = uid
        self.gid = gid
        self.cwd = cwd
        self.rooted = self.path == "/"

    @property
    def host(self):
        return self._host() if callable(self._host) else self._host

    # -- path walking --------------------------------------------------------
    def _parts(self, path):
        if not isinstance(path, str):
            raise FileToolError("path must be a string, got %s" % type(path).__name__)
        if "\x00" in path:
            raise FileToolError("path contains a NUL byte: %r" % path)
        if self.rooted:
            if not path.startswith("/") and self.cwd:
                path = self.cwd + "/" + path
        elif path.startswith("/"):
            if path == self.path or path.startswith(self.path + "/"):
                path = path[len(self.path):]
            else:
                raise FileToolError(
                    "path %r is outside the workspace %s; use a relative path or one under it"
                    % (path, self.path))
        return [p for p in path.split("/") if p not in ("", ".")]

    def walk(self, path, create_parents=False, follow_last=True):
        """Resolve ``path`` to ``(dir_fd, name, shown)``; ``name`` is None for the root.

        With ``follow_last=False`` a final symlink is returned itself, not resolved.

        The caller owns ``dir_fd`` and must close it. ``shown`` is the path the
        slot would use.
        """
        todo = self._parts(path)
        root = os.open(self.host, os.O_RDONLY | os.O_DIRECTORY)
        stack = [root]
        names = []
        links = 0
        try:
            while todo:
                part = todo.pop(0)
                if part == "..":
                    if len(stack) == 1:
                        if self.rooted:
                            continue  # ".." of "/" is "/"
                        raise FileToolError("path %r escapes the workspace" % path)
                    os.close(stack.pop())
                    names.pop()
                    continue
                try:
                    st = os.stat(part, dir_fd=stack[-1], follow_symlinks=False)
                except FileNotFoundError:
                    if not todo:
                        break
                    if not create_parents:
                        raise FileToolError(
                            "no such directory: %s" % self._show(names + [part])) from None
                    os.mkdir(part, 0o755, dir_fd=stack[-1])
                    self._own(part, stack[-1])
                    st = os.stat(part, dir_fd=stack[-1], follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode) and (todo or follow_last):
                    links += 1
                    if links > MAX_LINKS:
                        raise FileToolError("too many symbolic links in %r" % path)
                    target = os.readlink(part, dir_fd=stack[-1])
                    if target.startswith("/"):
                        rel = self._link_target(target, path)
                        for fd in stack[1:]:
                            os.close(fd)
                        del stack[1:]
                        names = []
                        todo = rel + todo
                    else:
                        todo = [p for p in target.split("/") if p not in ("", ".")] + todo
                    continue
                if not todo:
                    break
                if not stat.S_ISDIR(st.st_mode):
                    raise FileToolError("not a directory: %s" % self._show(names + [part]))
                fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=stack[-1])
                stack.append(fd)
                names.append(part)
            else:
                part = None
            if part is not None:
                names.append(part)
            dir_fd = stack.pop()
            for fd in stack:
                os.close(fd)
            return dir_fd, part, self._show(names)
        except BaseException:
            for fd in stack:
                os.close(fd)
            raise

    def _link_target(self, target, path):
        if self.rooted:
            return [p for p in target.split("/") if p not in ("", ".")]
        if target == self.path or target.startswith(self.path + "/"):
            return [p for p in target[len(self.path):].split("/") if p not in ("", ".")]
        raise FileToolError("path %r goes through a symbolic link to %s, outside the workspace"
                            % (path, target))

    def _show(self, names):
        if self.rooted:
            return "/" + "/".join(names)
        return "/".join([self.path] + list(names))

    def _own(self, name, dir_fd):
        if self.uid is not None:
            os.chown(name, self.uid, self.gid, dir_fd=dir_fd, follow_symlinks=False)

    def _check_owner(self, st, shown):
        if self.uid is not None and st.st_uid != self.uid:
            raise FileToolError("%s is not owned by this slot" % shown)

    # -- operations ---------------------------------------------------------------
    def open_read(self, path):
        """Open a regular file for reading; return ``(fileobj, stat, shown)``."""
        dir_fd, name, shown = self.walk(path)
        try:
            if name is None:
                raise FileToolError("%s is a directory" % shown)
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            except FileNotFoundError:
                raise FileToolError("no such file: %s" % shown) from None
            except OSError as exc:
                raise FileToolError("cannot open %s: %s" % (shown, exc.strerror)) from None
        finally:
            os.close(dir_fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise FileToolError("%s is %s" % (shown, kind))
        try:
            self._check_owner(st, shown)
        except FileToolError:
            os.close(fd)
            raise
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st, shown

    def read_bytes(self, path, offset=0, limit=None):
        fh, st, shown = self.open_read(path)
        with fh:
            if offset >= st.st_size and stat.S_ISREG(st.st_mode):
                return b"", st, shown  # past the end (even past what lseek takes): empty
            if offset:
                fh.seek(offset)
            want = MAX_READ_BYTES if limit is None else min(limit, MAX_READ_BYTES)
            data = fh.read(want)
        return data, st, shown

    def open_for_write(self, path, append=False, truncate=True, must_exist=False, readable=False):
        """``(fd, shown)``: the slot's regular file ``path`` open for writing (blocking I/O),
        created with its parents unless ``must_exist``. Never through a link (O_NOFOLLOW);
        a FIFO the slot made never blocks the agent (O_NONBLOCK while opening; refused);
        an existing file of another owner is refused; emptied when ``truncate`` (only
        after those checks); owned by the slot's user. ``readable``: O_RDWR (a resumed
        upload reads what is there). Used by ``write_file`` and the upload stream.

        Raises:
            FileToolError: a directory, not a regular file, another owner's, missing
                (with ``must_exist``), or the open failed (its reason).
        """
        dir_fd, name, shown = self.walk(path, create_parents=not must_exist)
        try:
            if name is None:
                raise FileToolError("%s is a directory" % shown)
            flags = ((os.O_RDWR if readable else os.O_WRONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                     | (os.O_APPEND if append else 0))
            created = False
            try:
                try:
                    if must_exist:
                        raise FileExistsError
                    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
                    created = True
                except FileExistsError:
                    fd = os.open(name, flags, dir_fd=dir_fd)
            except IsADirectoryError:
                raise FileToolError("%s is a directory" % shown) from None
            except FileNotFoundError:
                raise FileToolError("no such file: %s" % shown) from None
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # a FIFO (nothing reads it)
                    raise FileToolError("%s is not a regular file" % shown) from None
                raise FileToolError("cannot write %s: %s" % (shown, exc.strerror)) from None
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileToolError("%s is not a regular file" % shown)
            if not created:
                self._check_owner(st, shown)
            os.set_blocking(fd, True)
            if truncate:
                os.ftruncate(fd, 0)
            if self.uid is not None:
                os.fchown(fd, self.uid, self.gid)
        except BaseException:
            os.close(fd)
            raise
        return fd, shown

    def write_bytes(self, path, data, append=False):
        fd, shown = self.open_for_write(path, append=append, truncate=not append)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return shown

    def list_dir(self, path=".", recursive=False, max_entries=1000):
        """Return ``(entries, truncated)``; each entry is ``{path, type, size}``."""
        dir_fd, name, shown = self.walk(path)
        try:
            if name is not None:
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                except FileNotFoundError:
                    raise FileToolError("no such directory: %s" % shown) from None
                except OSError as exc:
                    raise FileToolError("cannot list %s: %s" % (shown, exc.strerror)) from None
            else:
                fd = os.dup(dir_fd)
        finally:
            os.close(dir_fd)
        entries = []
        truncated = self._scan(fd, "", recursive, max_entries, entries)
        return entries, truncated, shown

    def _scan(self, fd, prefix, recursive, max_entries, out):
        try:
            names = sorted(os.listdir(fd))
            for entry in names:
                if len(out) >= max_entries:
                    return True
                try:
                    st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                rel = prefix + entry
                kind = ("dir" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode)
                        else "file" if stat.S_ISREG(st.st_mode) else "other")
                out.append({"path": rel, "type": kind, "size": st.st_size})
                if recursive and kind == "dir":
                    try:
                        sub = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    except OSError:
                        continue
                    if self._scan(sub, rel + "/", True, max_entries, out):
                        return True
            return False
        finally:
            os.close(fd)

    def archive(self, path=".", fmt="tar.gz", max_bytes=None, max_entries=None):
        """Archive a directory (or one file) without following symlinks; return bytes."""
        if fmt not in ("tar.gz", "tar", "zip"):
            raise FileToolError("unknown archive_format %r; use tar.gz, tar or zip" % fmt)
        import io  # imported here: the agent starts faster without them
        import tarfile
        import time
        import zipfile

        entries, truncated, shown = self.list_dir(path, recursive=True,
                                                  max_entries=max_entries or 100000)
        if truncated and max_entries:
            raise FileToolError("%s has more than max_entries=%d entries" % (shown, max_entries))
        buf = io.BytesIO()
        base = shown[len(self.path):].lstrip("/")
        total = [0]
        cap = min(max_bytes or MAX_ARCHIVE_BYTES, MAX_ARCHIVE_BYTES)

        def add_bytes(n):
            total[0] += n
            if total[0] > cap:
                if max_bytes and max_bytes <= MAX_ARCHIVE_BYTES:
                    raise FileToolError("archive of %s exceeds max_bytes=%d" % (shown, max_bytes))
                raise FileToolError("archive of %s exceeds the %d byte archive limit; archive "
                                    "a subdirectory or read files one by one"
                                    % (shown, MAX_ARCHIVE_BYTES))

        if fmt == "zip":
            zf = zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED)
        else:
            tf = tarfile.open(fileobj=buf, mode="w:gz" if fmt == "tar.gz" else "w")
        try:
            for entry in entries:
                rel = entry["path"]
                if self.rooted:  # an absolute path in the slot's view
                    full = shown.rstrip("/") + "/" + rel
                else:
                    full = (base + "/" + rel) if base else rel
                if entry["type"] == "file":
                    fh, st, _ = self.open_read(full)
                    with fh:
                        data = fh.read(cap - total[0] + 1)  # one byte over: the cap is hit
                    add_bytes(len(data))
                    if fmt == "zip":
                        zf.writestr(rel, data)
                    else:
                        info = tarfile.TarInfo(rel)
                        info.size = len(data)
                        info.mode = st.st_mode & 0o777
                        info.mtime = int(st.st_mtime)
                        tf.addfile(info, io.BytesIO(data))
                elif entry["type"] == "dir" and fmt != "zip":
                    info = tarfile.TarInfo(rel)
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    info.mtime = int(time.time())
                    tf.addfile(info)
                elif entry["type"] == "symlink" and fmt != "zip":
                    dir_fd, name, _ = self.walk(full, follow_last=False)
                    try:
                        target = os.readlink(name, dir_fd=dir_fd)
                    finally:
                        os.close(dir_fd)
                    info = tarfile.TarInfo(rel)
                    info.type = tarfile.SYMTYPE
                    info.linkname = target
                    tf.addfile(info)
        finally:
            if fmt == "zip":
                zf.close()
            else:
                tf.close()
        data = buf.getvalue()
        if len(data) > cap:
            raise FileToolError("archive of %s is %d bytes, over max_bytes=%d"
                                % (shown, len(data), cap))
        return data, len(entries), shown

    def wipe(self):
        """Empty the workspace (the directory itself stays, owned by the slot).

        Raises OSError when something in it could not be removed (an immutable file, a
        mount): such a workspace must not go to the next tenant (the host quarantines it).
        """
        empty_dir(self.host)
        left = sorted(os.listdir(self.host)) if os.path.isdir(self.host) else []
        if left:
            raise OSError(errno.ENOTEMPTY, "could not empty the workspace: %d entries remain "
                          "(first: %r)" % (len(left), left[0]))
        if not os.path.isdir(self.host):
            os.makedirs(self.host, exist_ok=True)
        os.chmod(self.host, 0o700 if self.uid is not None else 0o755)
        if self.uid is not None:
            os.chown(self.host, self.uid, self.gid)
