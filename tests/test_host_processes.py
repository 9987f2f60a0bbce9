"""``ToolBackend(..., host_processes=K)``: one backend over K host processes.

The shared behaviour suite runs on it too (``driver`` ``local-hosts`` in conftest.py).
Here: the sandboxes really are spread (each agent is a child of one host process, each
process owns its share), every method that reaches a sandbox is routed, objects cross
between processes intact (snapshots exported from one and imported into another, file
objects, preview tickets), a killed host process fails only its own slots and is
replaced, and a killed caller leaves no host process, agent or sandbox behind.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support import SMALL, agent_processes, bash, eventually, processes
from test_tracing import spans  # noqa: F401 - the fixture

from hermes_modal_tool import SandboxConfig, ToolBackend
from hermes_modal_tool.errors import ConfigError, SnapshotError, UsageError
from hermes_modal_tool.hostprocs import router
from hermes_modal_tool.hostprocs._router_data import RouterData

#: Methods of ToolBackend built only on the routed ones (checked below: they never touch
#: the pools, snapshots or previews of the process they run in).
BUILT_ON_ROUTED = {"acquire", "release", "upload", "download", "execute", "execute_stream", "start_process", "process", "list_processes",
                   "read_artifact", "list_artifacts", "archive_artifacts", "profile", "with_profiles",
                   "__aenter__", "__aexit__"}


def test_every_method_that_reaches_a_sandbox_is_routed() -> None:
    public = {n for n, m in inspect.getmembers(ToolBackend, callable)
              if not n.startswith("_") or n in ("__aenter__", "__aexit__", "_process_request", "_acquire",
                                                 "_release", "_upload", "_download")}
    routed = set(vars(router.HostRouter)) | set(vars(RouterData))
    assert public - routed - BUILT_ON_ROUTED == set(), "a new method must be routed or listed as built on them"
    for name in BUILT_ON_ROUTED - {"with_profiles", "profile"}:
        source = inspect.getsource(getattr(ToolBackend, name))
        for private in ("self._pools", "self._snapshots", "self._setups", "_previews("):
            assert private not in source, f"{name} uses {private}: it must be routed"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_host_processes_is_refused_by_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="host_processes") as err:
        ToolBackend(SandboxConfig(**SMALL), host_processes=bad)  # type: ignore[arg-type]
    assert repr(bad) in str(err.value)


def test_the_environment_gives_the_default(monkeypatch) -> None:
    monkeypatch.setenv("HERMES_MODAL_TOOL_HOST_PROCESSES", "3")
    assert ToolBackend(SandboxConfig(**SMALL)).host_processes == 3  # (nothing starts before start())
    assert ToolBackend(SandboxConfig(**SMALL), host_processes=1).host_processes == 1
    assert type(ToolBackend(SandboxConfig(**SMALL), host_processes=1)) is ToolBackend
    monkeypatch.setenv("HERMES_MODAL_TOOL_HOST_PROCESSES", "two")
    with pytest.raises(ConfigError, match="HERMES_MODAL_TOOL_HOST_PROCESSES='two'"):
        ToolBackend(SandboxConfig(**SMALL))
    monkeypatch.setenv("HERMES_MODAL_TOOL_HOST_PROCESSES", "0")
    with pytest.raises(ConfigError, match="HERMES_MODAL_TOOL_HOST_PROCESSES='0'.*got 0"):
        ToolBackend(SandboxConfig(**SMALL))


async def test_sandboxes_are_spread_over_the_host_processes(make_backend) -> None:
    backend = await make_backend(slots_per_sandbox=2, min_sandboxes=2, max_sandboxes=4, host_processes=2)
    slots = [await backend.acquire(f"t{i}") for i in range(4)]
    status = backend.get_status()
    hosts = status["host_processes"]
    assert [h["held_slots"][backend.default_profile] for h in hosts] == [2, 2]
    assert status["acquired_slots"] == 4 and status["sandboxes"] >= 2
    assert status["pools"][backend.default_profile]["max_sandboxes"] == 4  # the profile's, not a sum
    # Each agent is the child of one host process, and both host processes have agents.
    parents = {p.ppid for p in agent_processes().values()}
    assert parents == {h["pid"] for h in hosts}
    assert {s.sandbox_id.split("-")[-1].split(".")[0] for s in slots} == {"h0", "h1"}
    results = await backend.execute_batch([(s, "bash", {"command": f"echo {s.trajectory_id} $((6*7))"})
                                           for s in slots])
    assert [r.output for r in results] == [f"t{i} 42\n" for i in range(4)]
    events = []
    r = await backend.execute(slots[3], "bash", {"command": "echo one; sleep 0.2; echo two"},
                              on_output=events.append)
    assert r.output == "one\ntwo\n" and "".join(e.data for e in events) == "one\ntwo\n"
    assert {e.index for e in events} == {0}


async def test_objects_cross_between_host_processes(make_backend, tmp_path) -> None:
    backend = await make_backend(slots_per_sandbox=2, min_sandboxes=2, max_sandboxes=2, host_processes=2)
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    assert a._sandbox is not b._sandbox
    await bash(backend, a, "echo from-a > kept.txt; cd /tmp; export MARK=m1")
    snap = await backend.snapshot(a)
    data = b"".join([piece async for piece in backend.export_snapshot(snap)])
    await backend.release(a)
    imported = await backend.import_snapshot([data[i:i + 4096] for i in range(0, len(data), 4096)])
    [forked] = await backend.fork(imported, 1, ["fork"])
    r = await bash(backend, forked, f'cat {forked.workspace_dir}/kept.txt; pwd; echo "$MARK"')
    assert r.output == "from-a\n/tmp\nm1\n", r
    # File objects go through a temporary file; offsets keep their meaning.
    payload = os.urandom(300_000)
    await backend.upload(b, io.BytesIO(payload), "in.bin")
    back = io.BytesIO()
    moved = await backend.download(b, "in.bin", back)
    assert back.getvalue() == payload and moved.size == len(payload)
    part = io.BytesIO(payload[:100_000])
    await backend.download(b, "in.bin", part, offset=100_000)
    assert part.getvalue() == payload
    proc = await backend.start_process(b, "cat", pty=False)
    await proc.write(b"through the router\n")
    assert b"through the router" in await proc.read_until(b"router")
    assert imported.holders() == ["caller", "fork"]  # as ToolBackend's: the caller, each held fork
    await backend.release_snapshot(snap)
    await backend.release_snapshot(imported)
    assert imported.holders() == ["fork"]
    [live] = backend.get_status()["snapshots"]  # the imported one: its fork still holds it
    assert live["snapshot_id"] == imported.snapshot_id and live["holders"] == ["fork"]
    await backend.release(forked)
    assert backend.get_status()["snapshots"] == []


async def test_spans_are_made_on_the_callers_side(make_backend, spans, tmp_path) -> None:  # noqa: F811
    backend = await make_backend(host_processes=2)
    slot = await backend.acquire("traced")
    ok, bad = await backend.execute_batch([(slot, "bash", {"command": "echo ok"}),
                                           (slot, "bash", {"command": "exit 7"})])
    (tmp_path / "in.bin").write_bytes(b"x" * 70_000)
    up = await backend.upload(slot, tmp_path / "in.bin", "in.bin")
    await backend.download(slot, "in.bin", tmp_path / "out.bin")
    await backend.release(slot)
    done = spans.get_finished_spans()
    calls = [s for s in done if s.name == "hermes_modal_tool.execute"]
    assert [c.attributes["hmt.exit_code"] for c in calls] == [0, 7]
    assert {c.attributes["hmt.sandbox_id"] for c in calls} == {slot.sandbox_id}
    by_name = {s.name: s for s in done}
    assert by_name["hermes_modal_tool.upload"].attributes["hmt.bytes"] == 70_000
    assert by_name["hermes_modal_tool.download"].attributes["hmt.sha256"] == up.sha256
    assert by_name["hermes_modal_tool.release"].attributes["hmt.usage.calls.bash"] == 2
    assert ok.success and not bad.success


async def test_a_preview_ticket_made_here_is_taken_there_once(make_backend) -> None:
    backend = await make_backend(host_processes=2)
    slot = await backend.acquire("web")
    preview = await backend.expose(slot, 8000)
    url = preview.ticket_url("/x")
    host, port = preview.url.split("//")[1].rstrip("/").rsplit(":", 1)
    path = "/" + url.split("/", 3)[3]
    assert await _status(host, int(port), path) == 303  # traded for a cookie in the host process
    assert await _status(host, int(port), path) == 403  # single use
    forged = path[:-4] + ("0000" if not path.endswith("0000") else "1111")
    assert await _status(host, int(port), forged) == 403
    assert await backend.unexpose(slot) == 1 and preview.revoked


async def _status(host: str, port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    line = await reader.readline()
    writer.close()
    return int(line.split()[1])


async def test_a_killed_host_process_fails_only_its_slots_and_is_replaced(make_backend) -> None:
    backend = await make_backend(slots_per_sandbox=2, min_sandboxes=2, max_sandboxes=2, host_processes=2,
                                 execution_timeout_s=60)
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    victim = a._sandbox
    batch = asyncio.ensure_future(backend.execute_batch([
        (a, "bash", {"command": "sleep 30"}), (b, "bash", {"command": "sleep 1; echo b-done"})]))
    await asyncio.sleep(0.5)
    os.kill(victim.pid, signal.SIGKILL)
    ra, rb = await asyncio.wait_for(batch, 20)
    assert not ra.success and ra.metadata["reason"] == "sandbox_died", ra
    assert f"host process {victim.index}" in ra.error and "exited" in ra.error
    assert rb.success and rb.output == "b-done\n", rb
    assert a.state.value == "error"
    assert await backend.release(a) is None  # a dead host process's slot releases quietly
    status = await eventually(lambda: asyncio.sleep(0, backend.get_status()),
                              lambda s: all(h["alive"] for h in s["host_processes"])
                              and s["available_slots"] >= 2, timeout=30)
    pids = {h["pid"] for h in status["host_processes"]}
    assert victim.pid not in pids and len(pids) == 2
    fresh = await backend.acquire("after")
    assert (await bash(backend, fresh, "echo alive")).output == "alive\n"


def test_a_killed_caller_leaves_nothing_behind(tmp_path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys
        from hermes_modal_tool import SandboxConfig, ToolBackend
        async def main():
            backend = ToolBackend(SandboxConfig(**{SMALL!r}, name="orphans"), host_processes=2)
            await backend.start()
            slot = await backend.acquire("x")
            await backend.execute(slot, "bash", {{"command": "echo up"}})
            print("ready", flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None and caller.stdout.readline() == "ready\n"
        below = _descendants(caller.pid)
        assert any(p.is_host_process for p in below.values()) and any(p.is_agent for p in below.values())
        caller.kill()
        caller.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and set(below) & set(processes()):
            time.sleep(0.2)
        left = set(below) & set(processes())
        assert not left, f"left behind: {[processes()[p].cmdline[:80] for p in left if p in processes()]}"
    finally:
        if caller.poll() is None:
            caller.kill()


def _descendants(root: int) -> dict:
    procs = processes()
    found: dict = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, p in procs.items() if p.ppid in frontier and pid not in found}
        found.update({pid: procs[pid] for pid in frontier})
    return found


def test_section_s_measures_one_backend_over_host_processes() -> None:
    """The README's command, tiny: a row of one ToolBackend(host_processes=2) whose CPU is
    split into the caller's (router) and the host processes' (named ``hmt-host``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "engine.py"), "--quick",
                          "--sections", "s", "--no-swerex", "--counts", "2", "--loops", "asyncio",
                          "--host-processes", "2", "--scale-slots", "4"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    [line] = [ln for ln in run.stdout.splitlines() if ln.startswith("SCALING_JSON ")]
    rows = json.loads(line.split(" ", 1)[1])["rows"]
    [one, split] = rows
    assert (one["host_processes"], split["host_processes"], split["split"]) == (1, 2, "backend")
    assert one["wrong"] == split["wrong"] == 0 and split["calls_per_s"] > 0
    assert split["host_us_by_process"]["router"] > 0 and split["host_us_by_process"]["host_processes"] > 0
    assert "cleanup: CLEAN" in run.stdout


def test_the_batch_command_spreads_its_trajectories_over_host_processes(tmp_path) -> None:
    from cli_helpers import bash as call
    from cli_helpers import run, write_jsonl

    (tmp_path / "up.txt").write_text("uploaded\n")
    rows = [{"id": f"t{i}", "calls": [call(f"echo t{i} > mine.txt && cat mine.txt", output_contains=f"t{i}")]}
            for i in range(4)]
    rows.append({"id": "child", "fork": "t0", "calls": [call("cat mine.txt", output_contains="t0")]})
    rows.append({"id": "files", "calls": [{"tool": "upload", "args": {"local": str(tmp_path / "up.txt"),
                                                                      "remote": "up.txt"}},
                                          call("cat up.txt", output_contains="uploaded")]})
    batch = write_jsonl(tmp_path / "batch.jsonl", rows)
    out = tmp_path / "results.jsonl"
    result = run("batch", str(batch), "-o", str(out), "--no-progress", "--slots-per-sandbox", "2",
                 "--max-sandboxes", "2", "--host-processes", "2")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["ok"] for r in records), records
    assert {r["slot_id"].split("-")[-1].split(".")[0] for r in records} == {"h0", "h1"}


async def test_snapshot_sandbox_gives_every_host_process_the_image(make_backend, modal_server) -> None:
    """``snapshot_sandbox(use=True)`` runs in one host process; the new image becomes the
    profile's in all of them (their next sandboxes start from it)."""
    backend = await make_backend(driver="modal", slots_per_sandbox=1, min_sandboxes=2, max_sandboxes=4,
                                 host_processes=2)
    image_id = await backend.snapshot_sandbox(setup=["mkdir -p /workspace/shared && echo prepared > "
                                                     "/workspace/shared/marker"])
    assert backend.profile().image == image_id
    held = [await backend.acquire(f"t{i}") for i in range(4)]  # 2 warm sandboxes, then 2 new ones
    new = [s for s in held if s.sandbox_id.endswith(".1")]
    assert {s.sandbox_id.split("-")[-1].split(".")[0] for s in new} == {"h0", "h1"}, [s.sandbox_id for s in held]
    for slot in new:
        assert (await bash(backend, slot, "cat /workspace/shared/marker")).output == "prepared\n"
    running = [r.image_id for r in modal_server.sandboxes.values() if r.status == "running"]
    assert running.count(image_id) == 2, running


async def test_a_bad_import_fails_at_once_and_names_what_was_wrong(make_backend) -> None:
    backend = await make_backend(host_processes=2)
    with pytest.raises(UsageError, match="got int"):
        await backend.import_snapshot(42)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="each chunk must be bytes, got str"):
        await backend.import_snapshot([b"x" * 10, "text"])  # type: ignore[list-item]
    # A stream of more pieces than the host process takes unanswered, which it refuses:
    # the refusal comes back, and the backend goes on.
    with pytest.raises(SnapshotError):
        await asyncio.wait_for(backend.import_snapshot([b"not a tar stream " * 4096] * 64), 30)
    slot = await backend.acquire("still-fine")
    assert (await bash(backend, slot, "echo ok")).output == "ok\n"
