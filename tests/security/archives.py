"""Crafted archives for the unpacking attacks: docker archives of hand-made layers and
tar members of every kind (built with ``tarfile``, no tools)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", *, link: str = "",
           mode: int | None = None, uid: int = 0, gid: int = 0,
           pax: dict[str, str] | None = None, dev: tuple[int, int] = (0, 0)):
    """``(TarInfo, data)`` for :func:`layer`."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.uid, info.gid = uid, gid
    info.mode = mode if mode is not None else (0o755 if kind == tarfile.DIRTYPE else 0o644)
    info.linkname = link
    info.devmajor, info.devminor = dev
    info.pax_headers = dict(pax or {})
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def sparse(name: str, apparent: int):
    """A GNU sparse member (PAX format 1.0) of ``apparent`` bytes holding one byte of
    data at its end: a few hundred bytes in the archive."""
    sparse_map = b"1\n%d\n1\n" % (apparent - 1)
    body = sparse_map.ljust(512, b"\0") + b"x"
    info = tarfile.TarInfo("GNUSparseFile.0/" + name.rsplit("/", 1)[-1])
    if "/" in name:
        info.name = name.rsplit("/", 1)[0] + "/GNUSparseFile.0/" + name.rsplit("/", 1)[-1]
    info.size = len(body)
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                        "GNU.sparse.name": name, "GNU.sparse.realsize": str(apparent)}
    return info, body


def layer(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.size else None)
    return buf.getvalue()


def docker_archive(path: Path, layers: list[list], tag: str = "hmt/attack:latest") -> str:
    """Write a ``docker save`` tarball of ``layers`` (each a list of :func:`member`) to
    ``path``; returns its ``docker-archive:`` image string."""
    blobs = [layer(m) for m in layers]
    names = [f"{hashlib.sha256(b).hexdigest()}/layer.tar" for b in blobs]
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": [
                             "sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]}}).encode()
    manifest = json.dumps([{"Config": "config.json", "RepoTags": [tag], "Layers": names}]).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in [("manifest.json", manifest), ("config.json", config),
                           *zip(names, blobs, strict=True)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return f"docker-archive:{path}"


def snapshot_stream(meta: dict, members) -> bytes:
    """A snapshot tar stream: ``meta`` first (``hmt-snapshot.json``), then ``members``."""
    raw = json.dumps(meta).encode()
    return layer([member("hmt-snapshot.json", data=raw), *members])
