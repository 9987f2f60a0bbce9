"""Live output: ``execute_stream`` and ``on_output``, once per driver.

Output reaches the caller while the command runs (the first chunk of a command that
then sleeps arrives at once); stdout and stderr chunks keep their order and add up to
the result's streams; a slot that floods its output does not hold up its neighbours.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

from support import bash

from hermes_modal_tool import ExecutionResult, OutputEvent


async def test_first_chunk_arrives_while_the_command_sleeps(driver_backend):
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1)
    slot = await backend.acquire("live")
    await bash(backend, slot, "true")  # the shell is started
    t0 = time.monotonic()
    stream = backend.execute_stream(slot, "bash", {"command": "echo begin; sleep 5"})
    async with contextlib.aclosing(stream):
        first = await anext(stream)
        waited = time.monotonic() - t0
    assert isinstance(first, OutputEvent)
    assert (first.stream, first.data, first.slot_id) == ("stdout", "begin\n", slot.slot_id)
    assert waited < 0.2, waited
    # Closing the stream early cancelled the call: its sleep is gone, the slot is free.
    after = await bash(backend, slot, "pgrep -x sleep || echo none")
    assert after.stdout == "none\n"


async def test_events_keep_order_and_add_up_to_the_streams(driver_backend):
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1)
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    events: list[OutputEvent] = []
    script = ("for i in 1 2 3; do echo out$i; sleep 0.05; echo err$i >&2; sleep 0.05; done; "
              "printf '\\xe2\\x82'; sleep 0.05; printf '\\xac\\n'; seq 1 2000")
    ra, rb = await backend.execute_batch(
        [(a, "bash", {"command": script}), (b, "bash", {"command": "echo other >&2"})],
        on_output=events.append)
    got = {(0, "stdout"): "", (0, "stderr"): "", (1, "stdout"): "", (1, "stderr"): ""}
    for e in events:
        got[(e.index, e.stream)] += e.data
    assert got[(0, "stdout")] == ra.stdout and "€\n" in ra.stdout  # a character cut in two reads
    assert got[(0, "stderr")] == ra.stderr == "err1\nerr2\nerr3\n"
    assert got[(1, "stderr")] == rb.stderr == "other\n" and got[(1, "stdout")] == ""
    mine = [e for e in events if e.index == 0]
    order = "".join(e.data for e in mine)
    assert order.startswith("out1\nerr1\nout2\nerr2\nout3\nerr3\n")


async def test_stream_of_exact_bytes_and_the_result_last(driver_backend):
    backend = await driver_backend()
    slot = await backend.acquire("raw")
    items = [item async for item in backend.execute_stream(
        slot, "bash", {"command": "printf 'a\\000\\377'; printf '\\376' >&2; exit 4",
                       "encoding": "bytes"})]
    result = items[-1]
    assert isinstance(result, ExecutionResult) and result.returncode == 4
    chunks = items[:-1]
    assert b"".join(e.data for e in chunks if e.stream == "stdout") == b"a\x00\xff" == result.stdout
    assert b"".join(e.data for e in chunks if e.stream == "stderr") == b"\xfe" == result.stderr


async def test_a_failing_callback_does_not_break_the_call(driver_backend):
    backend = await driver_backend()
    slot = await backend.acquire("cb")

    def broken(_event: OutputEvent) -> None:
        raise RuntimeError("callback bug")

    r = await backend.execute(slot, "bash", {"command": "echo fine"}, on_output=broken)
    assert r.success and r.stdout == "fine\n"


async def test_a_flooding_slot_does_not_delay_its_neighbour(driver_backend):
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1, cpu=2.0)
    flood = await backend.acquire("flood")
    quiet = await backend.acquire("quiet")
    await bash(backend, quiet, "true")
    # The neighbour's echo alone first: on a machine other work loads (the loaded runs of
    # the suite), a fixed bound measured the load, not the flood.
    alone = []
    for _ in range(100):
        t0 = time.perf_counter()
        assert (await bash(backend, quiet, "echo hi")).stdout == "hi\n"
        alone.append(time.perf_counter() - t0)
    alone_p99 = statistics.quantiles(alone, n=100)[98]
    received = [0]
    flowing = asyncio.Event()

    def count(event: OutputEvent) -> None:
        received[0] += len(event.data)
        if received[0] >= 1_000_000:
            flowing.set()

    task = asyncio.ensure_future(backend.execute(flood, "bash", {"command": "yes", "timeout": 60},
                                                 on_output=count))
    try:
        await asyncio.wait_for(flowing.wait(), 20)
        latencies = []
        for _ in range(200):
            t0 = time.perf_counter()
            r = await bash(backend, quiet, "echo hi")
            latencies.append(time.perf_counter() - t0)
            assert r.stdout == "hi\n"
        assert received[0] > 2_000_000  # the flood kept streaming meanwhile
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"neighbour echo under a flood: median {statistics.median(latencies) * 1000:.2f} ms, "
          f"p99 {p99 * 1000:.2f} ms (alone {alone_p99 * 1000:.2f} ms); {received[0] / 1e6:.1f} MB streamed")
    # A flood that held the neighbour behind its output would cost it seconds: the bound
    # is 1 s, or five times what the neighbour saw alone just before. How small the p99 is
    # (the 50 ms target) is benchmarks/streaming.py's to measure: with three suites at once
    # on this 2-core machine the modal variant's p99 was 114 ms (9.9 ms alone, quieter).
    bound = max(1.0, 5 * alone_p99)
    assert p99 < bound, (f"neighbour echo p99 {p99 * 1000:.1f} ms under a flooding slot "
                         f"(alone {alone_p99 * 1000:.1f} ms, bound {bound * 1000:.0f} ms)")
