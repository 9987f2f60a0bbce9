"""Modal mode on an image that is not the host's root.

The local Modal control plane runs containers on the host's root unless told otherwise,
so Modal-mode tests would never meet an image without ``python3`` or ``bwrap``. Here a
registry tag is given a real root filesystem (a busybox image: no python3, no bwrap) with
``LocalModalServer.image_roots``: the containers run on it (checked through the ``modal``
SDK), and a profile naming that image fails to start with the driver's message saying
what is missing and what to set, beside the same profile on the default image working.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import modal
import pytest
from image_builder import OS_RELEASE, busybox_rootfs
from support import bash

from hermes_modal_tool import SandboxError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the local control plane's containers need root")


@pytest.fixture
def busybox_image(modal_server, tmp_path: Path):
    """A registry tag whose containers run on a busybox root (no python3, no bwrap)."""
    if modal_server.isolation != "bwrap":
        pytest.skip("image roots need the control plane's bwrap containers")
    root = tmp_path / "rootfs"
    busybox_rootfs(root)
    assert not (root / "usr/bin/python3").exists() and not (root / "bin/python3").exists()
    tag = f"hmt-test/busybox-{uuid.uuid4().hex[:6]}:1"
    modal_server.image_roots[tag] = root
    yield tag
    del modal_server.image_roots[tag]


async def test_the_containers_run_on_the_image_root(modal_server, busybox_image) -> None:
    app = await modal.App.lookup.aio("hmt-image-root", create_if_missing=True)
    image = modal.Image.from_registry(busybox_image)
    sb = await modal.Sandbox.create.aio(app=app, image=image)
    try:
        p = await sb.exec.aio("sh", "-c", "cat /etc/os-release /usr/share/hmt/marker; "
                                          "PATH=/usr/bin:/bin command -v python3 bwrap || echo none; "
                                          "echo w > /tmp/t && cat /tmp/t; touch /etc/x 2>/dev/null || echo ro")
        out = await p.stdout.read.aio()
        assert await p.wait.aio() == 0
        assert out == OS_RELEASE + "from the image\nnone\nw\nro\n", out
    finally:
        await sb.terminate.aio()
    # Positive control: a sandbox of another image still runs on the host's root.
    sb = await modal.Sandbox.create.aio(app=app)
    try:
        p = await sb.exec.aio("sh", "-c", "command -v python3 >/dev/null && echo has-python3")
        assert await p.stdout.read.aio() == "has-python3\n"
    finally:
        await sb.terminate.aio()


async def test_a_profile_whose_image_has_no_python3_fails_saying_so(make_backend, modal_server,
                                                                    busybox_image) -> None:
    # Positive control: the same profile on the default image starts and runs.
    ok = await make_backend(driver="modal", slots_per_sandbox=1, min_sandboxes=0, max_sandboxes=1)
    slot = await ok.acquire("fine")
    assert (await bash(ok, slot, "echo fine")).output == "fine\n"
    make_backend.note(ok)
    await ok.stop()
    backend = await make_backend(driver="modal", image=busybox_image, add_python="no",
                                 slots_per_sandbox=1, min_sandboxes=0, max_sandboxes=1,
                                 acquire_timeout_s=60)
    with pytest.raises(SandboxError, match="no python3 or python in this image") as err:
        await backend.acquire("no-python")
    assert "set add_python" in str(err.value), err.value
