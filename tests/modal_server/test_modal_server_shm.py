"""The local Modal control plane gives each sandbox a memory-backed ``/dev/shm`` (a tmpfs
sized to its ``memory``), shared by its execs and gone with the sandbox, as on Modal."""

from __future__ import annotations

from typing import Any

import modal
import pytest

from hermes_modal_tool.testing.modal_server import LocalModalServer
from hermes_modal_tool.testing.modal_server._shm import SOURCE, default_mib

from .conftest import run

pytestmark = pytest.mark.timeout(60)


def shm_mounts(server: LocalModalServer) -> list[str]:
    """The sandbox ``/dev/shm`` tmpfs mount points under ``server``'s state directory
    (another server on the machine, such as a second test run's, has its own)."""
    under = f"{server.state_dir}/"
    with open("/proc/self/mountinfo") as fh:
        return [p for p in (line.split()[4] for line in fh if f" - tmpfs {SOURCE} " in line)
                if p.startswith(under)]


async def test_each_sandbox_has_a_memory_backed_dev_shm_of_its_memory(
        server: LocalModalServer, app: Any) -> None:
    before = shm_mounts(server)
    sized = await modal.Sandbox.create.aio(app=app, memory=96)
    plain = await modal.Sandbox.create.aio(app=app)
    for sb, mib in ((sized, 96), (plain, default_mib())):
        code, out, _ = await run(sb, "sh", "-c", "stat -f -c %T /dev/shm; df -m --output=size /dev/shm | tail -1")
        assert code == 0 and out.split() == ["tmpfs", str(mib)], out
    # Shared by the sandbox's execs, not with another sandbox; full at its size.
    assert (await run(sized, "sh", "-c", "echo hi > /dev/shm/f"))[0] == 0
    assert (await run(sized, "cat", "/dev/shm/f"))[1] == "hi\n"
    assert (await run(plain, "sh", "-c", "ls -A /dev/shm"))[1] == ""
    code, out, _ = await run(sized, "sh", "-c", "head -c 200M /dev/zero > /dev/shm/big; echo rc=$?; "
                                                "du -m /dev/shm/big | cut -f1")
    assert "rc=1" in out and int(out.split()[-1]) <= 96, out
    mine = [p for p in shm_mounts(server) if p not in before]
    assert sorted(mine) == sorted(str(server.sandboxes[sb.object_id].state_dir / "fs" / "shm")
                                  for sb in (sized, plain))
    # Gone with the sandbox (terminate), and with the server (stop) for those still running.
    await sized.terminate.aio()
    await sized.wait.aio(raise_on_termination=False)
    assert [p for p in shm_mounts(server) if p not in before] == [
        str(server.sandboxes[plain.object_id].state_dir / "fs" / "shm")]
    await server.stop()
    assert [p for p in shm_mounts(server) if p not in before] == []
