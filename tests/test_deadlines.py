"""Many deadlines on one loop timer (hermes_modal_tool/deadlines.py)."""

from __future__ import annotations

import asyncio

import pytest

from hermes_modal_tool import deadlines as deadlines_mod
from hermes_modal_tool.deadlines import Deadlines


async def test_due_callbacks_run_in_order_and_dropped_ones_never() -> None:
    loop = asyncio.get_running_loop()
    timers = Deadlines(loop)
    fired: list[tuple[str, float]] = []
    t0 = loop.time()

    def note(name: str) -> None:
        fired.append((name, loop.time() - t0))

    timers.add(0.06, note, "c")
    timers.add(0.02, note, "a")  # earlier than the armed timer: re-armed for it
    dropped = timers.add(0.04, note, "never")
    timers.add(0.04, note, "b")
    timers.drop(dropped)
    timers.drop(dropped)  # twice: nothing more
    assert len(timers) == 3
    await asyncio.sleep(0.12)
    assert [name for name, _ in fired] == ["a", "b", "c"]
    for (_, at), due in zip(fired, (0.02, 0.04, 0.06), strict=True):
        assert at >= due - 0.002  # never early (loop clock)
    assert len(timers) == 0


async def test_a_failing_callback_does_not_stop_the_others() -> None:
    loop = asyncio.get_running_loop()
    seen: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    timers = Deadlines(loop)
    fired: list[int] = []

    def boom(_arg: int) -> None:
        raise RuntimeError("boom")

    timers.add(0.01, boom, 1)
    timers.add(0.01, fired.append, 2)
    await asyncio.sleep(0.05)
    assert fired == [2]
    assert isinstance(seen[0]["exception"], RuntimeError)


async def test_dropped_entries_do_not_pile_up() -> None:
    timers = Deadlines(asyncio.get_running_loop())
    live = [timers.add(60.0, print, i) for i in range(10)]
    for i in range(100_000):
        timers.drop(timers.add(30.0 + i * 1e-6, print, i))
    assert len(timers) == 10
    # Rebuilt whenever the dropped outnumber the live ones past COMPACT_AT.
    assert len(timers._heap) <= 2 * deadlines_mod.COMPACT_AT + len(live) + 1
    timers.close()
    assert len(timers) == 0


async def test_close_stops_everything() -> None:
    loop = asyncio.get_running_loop()
    timers = Deadlines(loop)
    fired: list[int] = []
    entry = timers.add(0.01, fired.append, 1)
    timers.close()
    timers.drop(entry)  # after close: nothing
    await asyncio.sleep(0.03)
    assert fired == []


@pytest.mark.parametrize("delay", [0.0, -1.0])
async def test_a_deadline_already_past_fires_on_the_next_pass(delay: float) -> None:
    timers = Deadlines(asyncio.get_running_loop())
    fired: list[str] = []
    timers.add(delay, fired.append, "now")
    assert fired == []  # never from inside add()
    await asyncio.sleep(0.01)
    assert fired == ["now"]
