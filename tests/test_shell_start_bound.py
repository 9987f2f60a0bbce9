"""A shell start stuck before its shell exists (mounting the slot's root, joining its
cgroups, waiting for a fork to finish with its layers) fails within the start's bound,
names what it was stuck in, and stops what the stuck step starts when it comes back;
the same slot's next start then works.

A stuck spawn cannot be made on demand with the real steps, so the agent's ``Shell``
runs here with its spawn step replaced by one that blocks until told to go on and then
starts a real bash; the bound, the cancellation and the clean-up are the agent's own.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from hermes_modal_tool.agent.shells.shell import Shell

LIMIT_S = 0.5


class _Admission:
    def hold(self, key: object) -> None:
        pass

    def release(self, key: object) -> None:
        pass


def _slot(tmp_path, pool: ThreadPoolExecutor) -> SimpleNamespace:
    agent = SimpleNamespace(
        spawn_limiter=asyncio.Semaphore(4), admission=_Admission(), closing=False, shells_starting=0,
        config={"shell_start_timeout": LIMIT_S}, executor=lambda name: pool, isolation="none")
    ctl = tmp_path / "ctl"
    ctl.mkdir()

    def write_ctl(name: str, data: bytes) -> str:
        (ctl / name).write_bytes(data)
        return str(ctl / name)

    return SimpleNamespace(agent=agent, index=3, layer_lock=asyncio.Lock(), root=None,
                           ctl_path=str(ctl), write_ctl=write_ctl, replay=None, background_sids=[],
                           in_netns=lambda fn: fn())  # as Slot.in_netns without egress


def _bash(started: list) -> tuple:
    """What ``Shell._popen`` returns: a real bash on three pipes."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    proc = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=in_r, stdout=out_w,
                            stderr=err_w, start_new_session=True)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    started.append(proc)
    return proc, in_w, out_r, None, err_r, None


async def test_a_stuck_spawn_fails_in_time_and_what_it_starts_late_is_stopped(tmp_path) -> None:
    pool = ThreadPoolExecutor(2)
    go = threading.Event()
    started: list = []
    shell = Shell(_slot(tmp_path, pool), asyncio.get_running_loop())

    def stuck() -> tuple:
        shell.start_phase = "in a test's blocked spawn"
        go.wait(30)
        return _bash(started)

    shell._popen = stuck
    t0 = time.monotonic()
    failed = await asyncio.wait_for(shell.ensure_ready(), 20)
    took = time.monotonic() - t0
    try:
        assert failed is not None and failed["returncode"] == 1, failed
        assert failed["error"].startswith(
            "slot 3: its shell did not start within 0.5s (it was stuck in a test's blocked "
            "spawn)"), failed
        assert took < 5, took  # the bound, not the blocked step's 30 s
        assert shell.starting is None and shell.proc is None and not shell.ready
        assert shell.slot.agent.shells_starting == 0  # background work no longer waits for it
        go.set()  # the blocked step comes back and starts its bash: it is stopped

        def reaped() -> int:
            end = time.monotonic() + 15
            while not started and time.monotonic() < end:
                time.sleep(0.01)
            return started[0].wait(15)

        assert await asyncio.to_thread(reaped) == -9, started
        assert shell.proc is None  # never attached

        shell._popen = lambda: _bash(started)  # the next start of the same slot works
        assert await asyncio.wait_for(shell.ensure_ready(), 20) is None
        assert shell.ready and shell.proc is started[1] and shell.bash_pid == started[1].pid
        assert shell.slot.agent.shells_starting == 0
    finally:
        go.set()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shell.close_fds()
        if shell.err_fd is not None:
            asyncio.get_running_loop().remove_reader(shell.err_fd)
            os.close(shell.err_fd)
        pool.shutdown(wait=True)
