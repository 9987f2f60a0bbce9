"""OpenTelemetry spans: acquire, one execute per tool call (tool, slot, exit code, queue
and run time), release, snapshot, fork, sandbox start/stop; a caller's traceparent is
the parent; without the package nothing of OpenTelemetry is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from hermes_modal_tool import tracing


@pytest.fixture
def spans(monkeypatch):
    """The spans the engine ends, through the SDK's in-memory exporter (a provider of the
    test's own: the global one is left alone)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer(provider.get_tracer(tracing.SCOPE))
    yield exporter
    tracing.set_tracer(None)
    provider.shutdown()


def named(exporter, name):
    return [s for s in exporter.get_finished_spans() if s.name == f"hermes_modal_tool.{name}"]


async def test_a_rollout_is_one_trace(make_backend, spans):
    backend = await make_backend(start=False, min_sandboxes=0, max_sandboxes=1)
    tracer = tracing._tracer
    with tracer.start_as_current_span("rollout") as parent:
        slot = await backend.acquire("traj-1")
        ok, bad = await backend.execute_batch([(slot, "bash", {"command": "sleep 0.3"}),
                                               (slot, "bash", {"command": "exit 3"})])
        snap = await backend.snapshot(slot)
        [child] = await backend.fork(snap, 1)
        await backend.release(child)
        await backend.release_snapshot(snap)
        used = await backend.release(slot)
    await backend.stop()
    assert ok.success and bad.returncode == 3

    trace_id = parent.get_span_context().trace_id
    [acquire] = named(spans, "acquire")
    [start] = named(spans, "sandbox.start")
    assert acquire.parent.span_id == parent.get_span_context().span_id
    assert start.parent.span_id == acquire.context.span_id  # the acquire started it
    assert acquire.attributes["hmt.slot_id"] == slot.slot_id
    calls = named(spans, "execute")
    assert len(calls) == 2 and all(c.context.trace_id == trace_id for c in calls)
    by_code = {c.attributes["hmt.exit_code"]: c for c in calls}
    slept, failed = by_code[0], by_code[3]
    assert slept.attributes["hmt.tool"] == "bash" and slept.attributes["hmt.slot_id"] == slot.slot_id
    # The run time is the command's own; the second call waited for the first in its slot.
    assert slept.attributes["hmt.run_s"] >= 0.3 > failed.attributes["hmt.run_s"]
    assert failed.attributes["hmt.queue_s"] >= 0.3
    assert slept.status.status_code is not StatusCode.ERROR
    assert failed.status.status_code is StatusCode.ERROR
    [snapshot] = named(spans, "snapshot")
    assert snapshot.attributes["hmt.snapshot_id"] == snap.snapshot_id
    [fork] = named(spans, "fork")
    assert fork.attributes["hmt.count"] == 1
    releases = named(spans, "release")
    assert {r.attributes["hmt.slot_id"] for r in releases} == {slot.slot_id, child.slot_id}
    mine = next(r for r in releases if r.attributes["hmt.slot_id"] == slot.slot_id)
    assert mine.attributes["hmt.usage.wall_s"] == used.wall_s
    assert named(spans, "sandbox.stop")  # stop() outside the rollout: its own trace
    assert all(s.context.trace_id == trace_id for s in spans.get_finished_spans()
               if s.name != "hermes_modal_tool.sandbox.stop")


async def test_a_callers_traceparent_is_the_parent(make_backend, spans):
    backend = await make_backend()
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.use_traceparent(tp):
        slot = await backend.acquire("traj-2")
    await backend.release(slot)  # outside: a trace of its own
    [acquire] = named(spans, "acquire")
    assert format(acquire.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(acquire.parent.span_id, "016x") == "b7ad6b7169203331"
    [release] = named(spans, "release")
    assert release.context.trace_id != acquire.context.trace_id
    with pytest.raises(ValueError, match="not a valid W3C traceparent"):
        with tracing.use_traceparent("00-nothex-01"):
            pass


def test_without_opentelemetry_nothing_is_imported(tmp_path):
    """In a Python where the package cannot be imported, a whole rollout runs and no
    OpenTelemetry module is loaded (positive control: the same code with it loads it)."""
    code = textwrap.dedent("""
        import asyncio, sys
        if sys.argv[1] == "without":
            sys.modules["opentelemetry"] = None  # as if not installed: find_spec says None
        from hermes_modal_tool import SandboxConfig, ToolBackend, tracing
        async def main():
            async with ToolBackend(SandboxConfig(name="otel-probe", slots_per_sandbox=1)) as b:
                slot = await b.acquire("t")
                [r] = await b.execute_batch([(slot, "bash", {"command": "echo hi"})])
                assert r.output == "hi\\n", r
                await b.release(slot)
        asyncio.run(main())
        print(tracing.ENABLED, sorted(m for m in sys.modules if m.startswith("opentelemetry.")))
    """)
    out = {}
    for mode in ("without", "with"):
        run = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
        out[mode] = run.stdout.strip().splitlines()[-1]
    assert out["without"] == "False []"
    assert out["with"].startswith("True [") and "opentelemetry.trace" in out["with"]
