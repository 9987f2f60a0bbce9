"""Processes beside a slot's shell: a Python REPL driven through a PTY, resize, signals,
wait with a timeout, list; released with the slot. Once per driver."""

from __future__ import annotations

import pytest
from image_builder import images_for_tests
from support import bash, eventually, processes

from hermes_modal_tool import SandboxError


async def test_a_python_repl_on_a_pty(driver_backend):
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1)
    slot = await backend.acquire("repl")
    await bash(backend, slot, "cd /tmp && export GREETING=hello")
    proc = await backend.start_process(slot, "python3 -q", rows=30, cols=100)
    assert proc.pty and proc.pid > 0
    await proc.read_until(b">>> ")
    await proc.write("import os, shutil; print(os.getcwd(), os.environ['GREETING'], shutil.get_terminal_size())\n")
    out = await proc.read_until(b"columns=100, lines=30")
    assert b"/tmp hello" in out  # the shell's directory and exported variables
    await proc.write("name = input('name? ')\n")
    await proc.read_until(b"name? ")
    await proc.write("Ada\n")
    await proc.write("print('hi', name)\n")
    await proc.read_until(b"hi Ada")
    # The shell stays free for calls meanwhile.
    assert (await bash(backend, slot, "echo shell-free")).stdout == "shell-free\n"
    # Ctrl-C through the terminal once the sleep runs (one typed with the line would
    # flush it from the terminal's input queue before Python reads it).
    await proc.write("import time; print('sl' + 'eeping'); time.sleep(60)\n")
    await proc.read_until(b"sleeping")
    await proc.write("\x03")
    await proc.read_until(b"KeyboardInterrupt")
    await proc.resize(50, 132)
    await proc.write("print(shutil.get_terminal_size())\n")
    await proc.read_until(b"columns=132, lines=50")
    assert await proc.wait(timeout_s=0.2) is None  # still running
    [listed] = await backend.list_processes(slot)
    assert listed["id"] == proc.id and listed["running"] and listed["pty"]
    await proc.write("exit(3)\n")
    assert await proc.wait(timeout_s=20) == 3
    [listed] = await backend.list_processes(slot)
    assert not listed["running"] and listed["returncode"] == 3
    with pytest.raises(SandboxError, match="has ended"):
        await proc.write("more\n")


async def test_pipes_signals_and_end_of_input(driver_backend):
    backend = await driver_backend()
    slot = await backend.acquire("pipes")
    cat = await backend.start_process(slot, "cat; echo done-$?", pty=False)
    await cat.write(b"\x00raw\xff\n", eof=True)
    assert await cat.wait(timeout_s=20) == 0
    assert await cat.read() == b"\x00raw\xff\ndone-0\n"
    sleeper = await backend.start_process(slot, "sleep 600", pty=False)
    await sleeper.signal("TERM")
    assert await sleeper.wait(timeout_s=20) == -15
    with pytest.raises(Exception, match="unknown signal"):
        await sleeper.signal("NOPE")


async def test_release_kills_the_slots_processes(driver_backend):
    backend = await driver_backend()
    slot = await backend.acquire("doomed")
    marker = "4242"
    proc = await backend.start_process(slot, f"sleep {marker}; echo never")
    assert await proc.wait(timeout_s=0.1) is None

    async def sleeping() -> bool:
        return any(f"sleep\x00{marker}".encode() in p.cmdline for p in processes().values())

    # Positive control: the process is running (seen on the host) before the release.
    assert await eventually(sleeping, bool, timeout=20)
    [listed] = await backend.list_processes(slot)
    assert listed["running"], listed
    await backend.release(slot, reset_workspace=True)
    assert not await eventually(sleeping, lambda alive: not alive, timeout=20)
    again = await backend.acquire("next")
    assert await backend.list_processes(again) == []


async def test_background_jobs_are_processes_and_keep_their_log(driver_backend):
    backend = await driver_backend()
    slot = await backend.acquire("bg")
    r = await bash(backend, slot, "echo one; sleep 0.3; echo two >&2; exit 5", background=True)
    assert r.success, r.error
    log = r.metadata["background"]["log"]
    job = await backend.process(slot, r.metadata["process"]["id"])
    assert job.pid == r.metadata["background"]["pid"] and not job.pty
    assert await job.wait(timeout_s=20) == 5
    assert await job.read() == b"one\ntwo\n"
    assert (await bash(backend, slot, f"cat {log}")).stdout == "one\ntwo\n"
    [listed] = await backend.list_processes(slot)
    assert (listed["running"], listed["returncode"]) == (False, 5)
    with pytest.raises(SandboxError, match="no process 999"):
        await backend.process(slot, 999)


async def test_a_slot_without_python3_says_so_and_keeps_plain_background_jobs(make_backend, tmp_path_factory,
                                                                               tmp_path, monkeypatch):
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_CACHE", str(tmp_path / "cache"))
    images = images_for_tests(tmp_path_factory)  # busybox only: no python3
    backend = await make_backend(image=images["two"])
    slot = await backend.acquire("no-python")
    with pytest.raises(SandboxError, match="python3 is not in the slot"):
        await backend.start_process(slot, "sh")
    r = await bash(backend, slot, "echo from-job", background=True)
    assert r.success, r.error
    assert "process" not in r.metadata and "job_" in r.metadata["background"]["log"]


async def test_a_slow_starting_helper_has_half_the_calls_timeout(make_backend):
    # The process's helper is a python3 the slot's shell starts. Under emulation or heavy
    # load its start-up can pass a fixed 15 s (the host-matrix VM's main job failed four
    # background jobs so); it has half the call's timeout, at least 15 s.
    backend = await make_backend(slots_per_sandbox=1, max_sandboxes=1)
    slot = await backend.acquire("slow-python")
    slow = ("mkdir -p ~/slowbin && printf '#!/bin/sh\\nsleep 17\\nexec %s \"$@\"\\n' \"$(command -v python3)\" "
            "> ~/slowbin/python3 && chmod +x ~/slowbin/python3 && export PATH=~/slowbin:$PATH")
    assert (await bash(backend, slot, slow)).success
    short = await bash(backend, slot, "echo too-soon", background=True, timeout=20)  # 15 s to connect
    assert not short.success and "did not connect within 15s" in (short.error or ""), short
    r = await bash(backend, slot, "echo started-late", background=True, timeout=60)  # 30 s
    assert r.success, r.error
    log = r.metadata["background"]["log"]
    out = await eventually(lambda: bash(backend, slot, f"cat {log}"), lambda res: "started-late" in res.output)
    assert "started-late" in out.output
