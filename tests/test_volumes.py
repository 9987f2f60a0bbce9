"""Volumes: a host directory bound into every slot of a profile at its target,
read-only by default (the kernel refuses writes even after a remount), shared without
copying; a writable volume is shared by the profile's slots; bad volumes are refused
with a ConfigError naming them."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from support import bash

from hermes_modal_tool import ConfigError, SandboxConfig, SandboxStartError


@pytest.fixture
def place():
    """A directory the slots' unprivileged uids can reach (pytest's tmp_path is 0700)."""
    top = Path(tempfile.mkdtemp(prefix="hmt-volume-test-"))
    os.chmod(top, 0o755)
    yield top
    shutil.rmtree(top)


@pytest.fixture
def dataset(place):
    src = place / "dataset"
    src.mkdir()
    token = uuid.uuid4().hex
    (src / "train.txt").write_text(token)
    os.chmod(src, 0o755)
    return src, token


@pytest.mark.parametrize("filesystem", ["overlay", "workspace-only"])
async def test_a_read_only_volume_is_seen_and_cannot_be_written(make_backend, dataset, filesystem):
    src, token = dataset
    backend = await make_backend(filesystem=filesystem, slots_per_sandbox=2,
                                 volumes=[{"source": str(src), "target": "/datasets/train"}])
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    # Positive control: both slots read the host's file, the same inode (no copy).
    ra = await bash(backend, a, "cat /datasets/train/train.txt; echo; stat -c %i /datasets/train/train.txt")
    rb = await bash(backend, b, "stat -c %i /datasets/train/train.txt")
    assert ra.output.split() == [token, str(os.stat(src / "train.txt").st_ino)], ra
    assert rb.output.split() == ra.output.split()[1:]
    # The bind is read-only: a file anyone may write (0666) is refused too (EROFS).
    os.chmod(src / "train.txt", 0o666)
    w = await bash(backend, a, "echo x >> /datasets/train/train.txt")
    assert not w.success and "Read-only file system" in w.output, w
    assert (src / "train.txt").read_text() == token  # the host's verdict
    # A slot that is root in its own namespace may remount its bind writable; the kernel's
    # permission checks still refuse its uid (it owns nothing there; see README: Volumes).
    os.chmod(src / "train.txt", 0o644)
    w = await bash(backend, a, "mount -o remount,rw,bind /datasets/train 2>/dev/null; "
                               "echo y > /datasets/train/new; echo y >> /datasets/train/train.txt; "
                               "rm -f /datasets/train/train.txt; true")
    assert w.success
    assert sorted(os.listdir(src)) == ["train.txt"]
    assert (src / "train.txt").read_text() == token
    pool = backend.get_status()["pools"][backend.default_profile]
    assert pool["filesystem"] == filesystem
    assert pool["volumes"] == [{"source": str(src), "target": "/datasets/train", "read_only": True}]


async def test_a_writable_volume_is_shared_by_the_profiles_slots(make_backend, place):
    shared = place / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # each slot writes as its own uid
    backend = await make_backend(slots_per_sandbox=2,
                                 volumes=[{"source": str(shared), "target": "/scratch", "read_only": False}])
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    assert (await bash(backend, a, "echo from-a > /scratch/a.txt")).success
    assert (await bash(backend, b, "cat /scratch/a.txt")).output == "from-a\n"
    st = os.stat(shared / "a.txt")
    assert (shared / "a.txt").read_text() == "from-a\n"
    assert st.st_uid != 0  # the slot's own unprivileged uid outside, not the host's root
    # ... so another slot cannot change it (the sticky directory keeps it to its owner).
    r = await bash(backend, b, "rm -f /scratch/a.txt; echo x >> /scratch/a.txt")
    assert not r.success and (shared / "a.txt").read_text() == "from-a\n"


@pytest.mark.parametrize("volume, words", [
    ({"source": "/tmp", "target": "models"}, "absolute path"),
    ({"source": "/tmp", "target": "/etc/models"}, "system directory /etc"),
    ({"source": "/tmp", "target": "/"}, "absolute path below '/'"),
    ({"source": "/tmp", "target": "/usr"}, "system directory /usr"),
    ({"source": "/tmp", "target": "/data/models"}, "overlaps workspace_base"),
    ({"source": "/nonexistent-hmt-volume", "target": "/models"}, "does not exist"),
    ({"source": "/tmp", "target": "/models", "mode": "rw"}, "mode"),
])
def test_bad_volumes_are_refused(volume, words):
    with pytest.raises(ConfigError, match=words):
        SandboxConfig(volumes=[volume])


async def test_a_source_the_slots_cannot_reach_is_refused_at_start(make_backend, tmp_path):
    (tmp_path / "private").mkdir()  # under pytest's 0700 directory
    with pytest.raises(SandboxStartError, match="cannot reach it"):
        await make_backend(volumes=[{"source": str(tmp_path / "private"), "target": "/private"}])


def test_overlapping_targets_are_refused():
    with pytest.raises(ConfigError, match="overlap"):
        SandboxConfig(volumes=[{"source": "/tmp", "target": "/models"},
                               {"source": "/tmp", "target": "/models/big"}])
    ok = SandboxConfig(volumes=[{"source": "/tmp", "target": "/models/"}])  # positive control
    assert ok.volumes[0].target == "/models" and ok.volumes[0].read_only
