"""Modal Volumes on the Modal driver, against the local Modal control plane.

A profile's volume ``{"source": "modal:NAME", "target": ...}`` is looked up with the real
SDK (``VolumeGetOrCreate``), mounted into the sandbox's container at ``target``
(``Sandbox.create(volumes=...)``, read-only ones with a read-only mount), and bound by the
agent into every slot there: read-only by default, writable and shared by the sandbox's
slots when ``read_only`` is false. Bad names and missing Volumes are refused with a
ConfigError naming them.
"""

from __future__ import annotations

import os
import uuid

import modal
import pytest
from conftest import running_sandboxes
from support import bash

from hermes_modal_tool import ConfigError, SandboxConfig

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the local control plane's containers need root")


@pytest.fixture
def volume(modal_server):
    """A new Modal Volume on the local control plane: (name, its host directory)."""
    if modal_server.isolation != "bwrap":
        pytest.skip("Volumes need the control plane's bwrap containers")
    name = f"hmt-test-{uuid.uuid4().hex[:8]}"
    return name, modal_server.create_volume(name)


async def test_a_modal_volume_is_read_by_every_slot_and_is_read_only(make_backend, modal_server, volume):
    name, host = volume
    token = uuid.uuid4().hex
    (host / "train.txt").write_text(token)
    os.chmod(host / "train.txt", 0o666)  # anyone may write it: only the mounts refuse
    backend = await make_backend(driver="modal", slots_per_sandbox=2,
                                 volumes=[{"source": f"modal:{name}", "target": "/datasets/train"}])
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    # Positive control: both slots of the sandbox read the Volume's file.
    for slot in (a, b):
        r = await bash(backend, slot, "cat /datasets/train/train.txt")
        assert r.output == token, r
    w = await bash(backend, a, "echo x >> /datasets/train/train.txt")
    assert not w.success and "Read-only file system" in w.output, w
    assert (host / "train.txt").read_text() == token  # the host's verdict
    (record,) = running_sandboxes(modal_server, backend.default_profile)
    assert record.volumes == [(str(host), "/datasets/train", True)]  # the container's mount too
    # ... which refuses the container's root as well (beside the agent's read-only binds).
    sb = await modal.Sandbox.from_id.aio(record.sandbox_id)
    p = await sb.exec.aio("sh", "-c", "cat /datasets/train/train.txt; echo x >> /datasets/train/train.txt")
    assert await p.wait.aio() != 0 and await p.stdout.read.aio() == token
    assert "Read-only file system" in await p.stderr.read.aio()
    pool = backend.get_status()["pools"][backend.default_profile]
    assert pool["volumes"] == [{"source": f"modal:{name}", "target": "/datasets/train",
                                "read_only": True}]


async def test_a_writable_modal_volume_is_shared_by_the_sandboxs_slots(make_backend, modal_server, volume):
    name, host = volume
    os.chmod(host, 0o1777)  # each slot writes as its own unprivileged uid
    backend = await make_backend(driver="modal", slots_per_sandbox=2, volumes=[
        {"source": f"modal:{name}", "target": "/scratch", "read_only": False}])
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    assert (await bash(backend, a, "echo from-a > /scratch/a.txt")).success
    assert (await bash(backend, b, "cat /scratch/a.txt")).output == "from-a\n"
    assert (host / "a.txt").read_text() == "from-a\n"  # in the Volume itself
    (record,) = running_sandboxes(modal_server, backend.default_profile)
    assert record.volumes == [(str(host), "/scratch", False)]


@pytest.mark.parametrize("volume_field, words", [
    ({"source": "modal:bad/name", "target": "/models"}, "names no valid Modal Volume"),
    ({"source": "modal:", "target": "/models"}, "names no valid Modal Volume"),
    ({"source": "modal:" + "x" * 65, "target": "/models"}, "names no valid Modal Volume"),
    ({"source": "/tmp", "target": "/models"}, "source must be 'modal:NAME'"),
])
def test_bad_modal_volumes_are_refused(volume_field, words):
    with pytest.raises(ConfigError, match=words):
        SandboxConfig(driver="modal", volumes=[volume_field])
    ok = SandboxConfig(driver="modal", volumes=[{"source": "modal:my-data_1.v2", "target": "/models"}])
    assert ok.volumes[0].source == "modal:my-data_1.v2"  # positive control


def test_a_volume_is_mounted_once_and_only_by_its_driver():
    with pytest.raises(ConfigError, match="mounted twice"):
        SandboxConfig(driver="modal", volumes=[{"source": "modal:d", "target": "/a"},
                                               {"source": "modal:d", "target": "/b"}])
    with pytest.raises(ConfigError, match="only the modal driver mounts"):
        SandboxConfig(driver="local", volumes=[{"source": "modal:d", "target": "/a"}])


async def test_a_missing_modal_volume_is_named(make_backend, modal_server):
    name = f"hmt-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigError, match=f"Modal Volume '{name}' not found.*modal volume create"):
        await make_backend(driver="modal", volumes=[{"source": f"modal:{name}", "target": "/models"}])
    # The control plane answers the SDK as Modal does: created on request, then found.
    made = modal.Volume.from_name(name, create_if_missing=True)
    await made.hydrate.aio()
    again = modal.Volume.from_name(name)
    await again.hydrate.aio()
    assert again.object_id == made.object_id and modal_server.volume_path(name).is_dir()
