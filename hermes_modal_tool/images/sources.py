"""Where an image comes from: parse a profile's ``image`` and read its manifest and blobs.

Sources (see :func:`parse_source`):

- ``dir:/path``: an unpacked root filesystem, used as it is (no cache, no config);
- ``oci:/path[:tag]``: an OCI image layout directory;
- ``oci-archive:/path[:tag]``: a tar of an OCI image layout;
- ``docker-archive:/path[:repo:tag]``: a ``docker save`` tarball;
- anything else: a registry reference (``python:3.11``, ``ghcr.io/org/img@sha256:...``),
  pulled by :mod:`.pull` into an OCI layout first.

An :class:`ImageSource` names the image's *digest* (the manifest's; for a docker archive,
which has no manifest, the config's, the image id), its config and its layers in order.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tarfile
from dataclasses import dataclass, field
from typing import IO, Any

from ..errors import ImageError

LOCAL_PREFIXES = ("dir:", "oci:", "oci-archive:", "docker-archive:")
INDEX_TYPES = {"application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json"}
REF_NAME = "org.opencontainers.image.ref.name"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
         "s390x": "s390x", "riscv64": "riscv64"}


def host_arch() -> str:
    """The OCI architecture name of this machine (``amd64``, ``arm64`` ...)."""
    machine = platform.machine()
    return _ARCH.get(machine, machine)


@dataclass
class Source:
    """A parsed ``image`` string: ``kind`` is ``dir``, ``oci``, ``oci-archive``,
    ``docker-archive`` or ``registry``; ``path`` the local path (or the reference)."""

    image: str
    kind: str
    path: str
    tag: str | None = None


def is_local_source(image: str) -> bool:
    """True when ``image`` names a local source (one of :data:`LOCAL_PREFIXES`)."""
    return image.startswith(LOCAL_PREFIXES)


def modal_unsupported(image: str, profile: str) -> None:
    """Raise for a local source on the Modal driver (which pulls from a registry).

    Raises:
        ImageError: ``image`` is a ``dir:``, ``oci:``, ``oci-archive:`` or ``docker-archive:``
            source.
    """
    if is_local_source(image):
        raise ImageError(
            f"profile {profile!r}: image {image!r} is a file on this machine; the Modal driver "
            "pulls images from a registry: push it there (e.g. 'skopeo copy "
            f"{image.split(':', 1)[0]}:PATH docker://REGISTRY/NAME:TAG') and use that "
            "reference, which the local driver runs too")


def parse_source(image: str) -> Source:
    """Parse a profile's ``image``.

    Raises:
        ImageError: an empty path or a local path that does not exist.
    """
    for prefix in LOCAL_PREFIXES:
        if image.startswith(prefix):
            kind = prefix[:-1]
            rest = image[len(prefix):]
            if not rest:
                raise ImageError(f"image {image!r}: no path after {prefix!r}")
            path, tag = rest, None
            if kind != "dir" and not os.path.exists(path):
                # "/path:tag" (docker-archive: "/path:repo:tag"): the path is what exists.
                head = path
                while ":" in head and not os.path.exists(head):
                    head = head.rsplit(":", 1)[0]
                if os.path.exists(head):
                    path, tag = head, rest[len(head) + 1:] or None
            if not os.path.exists(path):
                raise ImageError(f"image {image!r}: {path} does not exist")
            return Source(image, kind, os.path.abspath(path), tag)
    if not image or any(c.isspace() for c in image):
        raise ImageError(f"image {image!r} is not a valid image reference")
    return Source(image, "registry", image)


class _Hashing:
    """A reader that hashes what passes through it (a layer's blob, checked at the end)."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data

    def drain(self) -> str:
        while self.read(1 << 20):
            pass
        return "sha256:" + self.sha.hexdigest()


@dataclass
class Layer:
    """One layer: its digest (of the blob as stored) and how to open it."""

    digest: str
    media_type: str
    size: int | None
    verify: bool = True  # docker archives name layers by file, not by digest

    def __post_init__(self) -> None:
        self.opener: Any = None
        self.diff_id: str | None = None  # the config's digest of the uncompressed tar

    def open(self) -> _Hashing:
        return _Hashing(self.opener())


@dataclass
class ImageSource:
    """A readable image: its digest, config (the OCI image config's ``config`` object) and
    layers, bottom first. Close it when done (an archive stays open while it is read)."""

    source: Source
    digest: str
    config: dict[str, Any]
    layers: list[Layer] = field(default_factory=list)
    closers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for c in self.closers:
            c.close()
        self.closers = []


class _Store:
    """Blobs of an OCI layout: a directory or a tar archive of one."""

    def __init__(self, image: str, path: str, archive: bool) -> None:
        self.image = image
        self.path = path
        self.tar: tarfile.TarFile | None = None
        if archive:
            try:
                self.tar = tarfile.open(path, "r:")
                self.names = {m.name.lstrip("./"): m for m in self.tar.getmembers()}
            except (tarfile.TarError, OSError) as exc:
                raise ImageError(f"image {image!r}: {path} is not a readable tar archive "
                                 f"({exc})") from exc

    def open(self, name: str) -> IO[bytes]:
        try:
            if self.tar is None:
                return open(os.path.join(self.path, name), "rb")
            member = self.names.get(name)
            fh = self.tar.extractfile(member) if member is not None else None
            if fh is None:
                raise FileNotFoundError(name)
            return fh
        except OSError as exc:
            raise ImageError(f"image {self.image!r}: {name} is missing from {self.path} "
                             f"({exc.strerror or exc})") from exc

    def json(self, name: str) -> Any:
        with self.open(name) as fh:
            data = fh.read()
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ImageError(f"image {self.image!r}: {name} in {self.path} is not valid "
                             f"JSON ({exc})") from exc

    def blob(self, digest: str) -> str:
        algo, _, hexpart = digest.partition(":")
        if not hexpart or "/" in hexpart or algo not in ("sha256", "sha512"):
            raise ImageError(f"image {self.image!r}: bad digest {digest!r}")
        return f"blobs/{algo}/{hexpart}"

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def _pick(image: str, index: dict[str, Any], tag: str | None, where: str) -> dict[str, Any]:
    manifests = index.get("manifests") or []
    if tag:
        found = [m for m in manifests if (m.get("annotations") or {}).get(REF_NAME) == tag]
        if not found:
            tags = sorted({(m.get("annotations") or {}).get(REF_NAME, "") for m in manifests} - {""})
            raise ImageError(f"image {image!r}: no tag {tag!r} in {where} (tags: "
                             f"{', '.join(tags) or 'none'})")
        return found[0]
    if len(manifests) == 1:
        return manifests[0]
    arch = host_arch()
    for m in manifests:
        plat = m.get("platform") or {}
        if plat.get("os") == "linux" and plat.get("architecture") == arch:
            return m
    if not manifests:
        raise ImageError(f"image {image!r}: {where} lists no image")
    raise ImageError(f"image {image!r}: {where} holds {len(manifests)} images: name one with "
                     f"':TAG'")


def _read_manifest(store: _Store, image: str, desc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Follow image indexes (the platform of this machine) down to one manifest."""
    for _ in range(4):
        digest = desc.get("digest", "")
        doc = store.json(store.blob(digest))
        kind = desc.get("mediaType") or doc.get("mediaType")
        if kind in INDEX_TYPES or (not doc.get("layers") and doc.get("manifests")):
            desc = _pick(image, doc, None, f"the index {digest}")
            continue
        return digest, doc
    raise ImageError(f"image {image!r}: image indexes nested too deep")


def open_oci(source: Source) -> ImageSource:
    """Open an OCI layout (``oci:``) or OCI archive (``oci-archive:``).

    Raises:
        ImageError: not a layout, no such tag, missing or malformed documents.
    """
    store = _Store(source.image, source.path, source.kind == "oci-archive")
    try:
        if source.kind == "oci" and not os.path.isfile(os.path.join(source.path, "index.json")):
            raise ImageError(f"image {source.image!r}: {source.path} is not an OCI layout "
                             "(no index.json)")
        index = store.json("index.json")
        digest, manifest = _read_manifest(store, source.image, _pick(
            source.image, index, source.tag, source.path))
        config = store.json(store.blob(manifest.get("config", {}).get("digest", "")))
        layers = []
        for d in manifest.get("layers") or []:
            layer = Layer(d.get("digest", ""), d.get("mediaType", ""), d.get("size"))
            layer.opener = (lambda name: lambda: store.open(name))(store.blob(layer.digest))
            layers.append(layer)
        _set_diff_ids(layers, config)
        return ImageSource(source, digest, config.get("config") or {}, layers, [store])
    except BaseException:
        store.close()
        raise


def _set_diff_ids(layers: list[Layer], config: dict[str, Any]) -> None:
    """Each layer's uncompressed digest from the config (checked while unpacking)."""
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) == len(layers):
        for layer, diff_id in zip(layers, diff_ids, strict=True):
            layer.diff_id = diff_id


def open_docker_archive(source: Source) -> ImageSource:
    """Open a ``docker save`` tarball (``docker-archive:``); ``tag`` picks one of its
    ``RepoTags`` when it holds several images.

    Raises:
        ImageError: not a docker archive, no such tag, missing files.
    """
    store = _Store(source.image, source.path, True)
    try:
        entries = store.json("manifest.json")
        if not isinstance(entries, list) or not entries:
            raise ImageError(f"image {source.image!r}: manifest.json of {source.path} lists "
                             "no image")
        entry = entries[0]
        if source.tag:
            want = source.tag if ":" in source.tag else source.tag + ":latest"
            found = [e for e in entries if want in (e.get("RepoTags") or [])
                     or any(t.endswith("/" + want) for t in e.get("RepoTags") or [])]
            if not found:
                tags = sorted(t for e in entries for t in e.get("RepoTags") or [])
                raise ImageError(f"image {source.image!r}: no {want!r} in {source.path} "
                                 f"(tags: {', '.join(tags) or 'none'})")
            entry = found[0]
        elif len(entries) > 1:
            raise ImageError(f"image {source.image!r}: {source.path} holds {len(entries)} "
                             "images: name one with ':REPO:TAG'")
        with store.open(entry["Config"]) as fh:
            raw = fh.read()
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()  # the image id
        config = json.loads(raw)
        layers = []
        for name in entry.get("Layers") or []:
            layer = Layer(name, "", None, verify=name.startswith("blobs/"))
            if layer.verify:
                layer.digest = name.replace("blobs/", "", 1).replace("/", ":", 1)
            layer.opener = (lambda n: lambda: store.open(n))(name)
            layers.append(layer)
        _set_diff_ids(layers, config)
        return ImageSource(source, digest, config.get("config") or {}, layers, [store])
    except (KeyError, ValueError, TypeError) as exc:
        store.close()
        raise ImageError(f"image {source.image!r}: {source.path} is not a valid docker "
                         f"archive ({exc!r})") from exc
    except BaseException:
        store.close()
        raise


def image_config(config: dict[str, Any]) -> dict[str, Any]:
    """What the local driver honours of an image config: ``env`` (dict), ``workdir``,
    ``user``; ``entrypoint`` and ``cmd`` are recorded, never run."""
    env = {}
    for item in config.get("Env") or []:
        key, sep, value = str(item).partition("=")
        if sep and key:
            env[key] = value
    return {"env": env, "workdir": config.get("WorkingDir") or None,
            "user": config.get("User") or None, "entrypoint": config.get("Entrypoint"),
            "cmd": config.get("Cmd")}
