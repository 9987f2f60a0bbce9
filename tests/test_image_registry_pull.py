"""A registry-style image end to end through the pull path: a profile names a registry
reference, the local driver pulls it (images/pull.py: skopeo) from a registry served
here on 127.0.0.1 (the OCI distribution API's read side over the test images' OCI
layout), unpacks it and runs the slot on it.

The suite's conftest sets ``HERMES_MODAL_TOOL_REGISTRY_IMAGES=host`` (registry images
keep the host's root); this test sets ``pull``, and checks the registry served the
manifest and every layer (a positive control that the pull path, not a local source,
made the slot's root).
"""

from __future__ import annotations

import collections
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from image_builder import OS_RELEASE, images_for_tests
from support import bash

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.oci.image.index.v1+json")


class LayoutRegistry:
    """Serves an OCI image layout as a read-only registry at ``http://127.0.0.1:PORT``:
    ``/v2/``, ``/v2/NAME/manifests/TAG-or-DIGEST`` and ``/v2/NAME/blobs/DIGEST`` (GET and
    HEAD), every NAME answering from the same layout. ``hits`` counts requests by kind."""

    def __init__(self, layout: Path) -> None:
        self.layout = layout
        self.hits: collections.Counter[str] = collections.Counter()
        index = json.loads((layout / "index.json").read_text())
        self.tags = {m["annotations"]["org.opencontainers.image.ref.name"]: m
                     for m in index["manifests"] if "org.opencontainers.image.ref.name" in m.get("annotations", {})}
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.answer(head=True)

            def do_GET(self) -> None:
                self.answer(head=False)

            def answer(self, head: bool) -> None:
                parts = self.path.split("?")[0].strip("/").split("/")
                body, ctype, digest = b"{}", "application/json", None
                if parts == ["v2"]:
                    registry.hits["ping"] += 1
                elif len(parts) >= 4 and parts[0] == "v2" and parts[-2] in ("manifests", "blobs"):
                    ref = parts[-1]
                    if parts[-2] == "manifests" and not ref.startswith("sha256:"):
                        desc = registry.tags.get(ref)
                        if desc is None:
                            return self.fail(404)
                        ref, ctype = desc["digest"], desc["mediaType"]
                    blob = registry.layout / "blobs" / "sha256" / ref.removeprefix("sha256:")
                    if not ref.startswith("sha256:") or not blob.is_file():
                        return self.fail(404)
                    body, digest = blob.read_bytes(), ref
                    if parts[-2] == "manifests":
                        ctype = json.loads(body).get("mediaType", MANIFEST_TYPES[0])
                    else:
                        ctype = "application/octet-stream"
                    registry.hits[parts[-2]] += 1
                else:
                    return self.fail(404)
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                if digest:
                    self.send_header("Docker-Content-Digest", digest)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def fail(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LayoutRegistry:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def registry(tmp_path_factory, tmp_path: Path, monkeypatch) -> Iterator[LayoutRegistry]:
    """The test images' layout served on 127.0.0.1 (plain HTTP: a loopback registry is
    pulled without TLS, as Docker does); registry images pulled (not the host's root),
    into a fresh cache."""
    images = images_for_tests(tmp_path_factory)
    with LayoutRegistry(Path(images["layout"])) as reg:
        monkeypatch.setenv("HERMES_MODAL_TOOL_REGISTRY_IMAGES", "pull")
        monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_CACHE", str(tmp_path / "cache"))
        yield reg


async def test_a_registry_image_is_pulled_unpacked_and_run(make_backend, registry) -> None:
    assert os.environ["HERMES_MODAL_TOOL_REGISTRY_IMAGES"] == "pull"
    assert "two" in registry.tags
    image = f"{registry.address}/hmt/demo:two"
    backend = await make_backend(image=image)
    slot = await backend.acquire("pulled")
    r = await bash(backend, slot, "cat /etc/os-release /usr/share/hmt/marker; pwd; "
                                  "ls /opt; ls /opt/opq; test -e /usr/bin/python3 || echo no-host-python")
    assert r.returncode == 0, r.output
    assert r.output == (OS_RELEASE + "from the image\n/srv/app\n"
                        "data\nopq\ndeep\nnew\nno-host-python\n"), r.output
    # Positive control: the registry served the manifest and every layer of the image.
    manifest = json.loads((registry.layout / "blobs" / "sha256" /
                           registry.tags["two"]["digest"].removeprefix("sha256:")).read_text())
    assert registry.hits["manifests"] >= 1, registry.hits
    assert registry.hits["blobs"] >= len(manifest["layers"]) + 1, (registry.hits, len(manifest["layers"]))
    status = backend.get_status()["drivers"]["local"]["images"]
    assert status["cached"] == 1, status
