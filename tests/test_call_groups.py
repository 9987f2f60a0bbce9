"""The grouped batch path on the host (``_call_group.py``, ``PoolCalls.submit_group`` and
``group_results``, ``Sandbox.submit_group``/``_on_results``): what its per-call shortcuts
must still give, the results a plain constructor gives and the bookkeeping of one call at
a time."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from hermes_modal_tool import ExecutionResult, SlotState, protocol
from hermes_modal_tool._call_group import CallGroup


class _ViaConstructor(ExecutionResult):
    """A subclass: ``from_agent`` makes it through the dataclass constructor (and
    ``__post_init__``), the path the bare-instance shortcut must agree with."""


AGENT_RESULTS = [
    {"output": "hi\n", "returncode": 0, "duration_s": 0.25},  # a compact result
    {"output": "", "returncode": 3},  # exit code 3: an error named, no duration
    {"output": "x", "error": "bad path", "returncode": None, "data": {"reason": "bad_request"}},
    {"output": "", "error": "no exit code", "returncode": None},  # reason filled in: not_run
    {"output": "t", "returncode": 124, "timed_out": True, "truncated": True, "duration_s": 1.0},
    {"output": "o\ne\n", "returncode": 0, "stdout": "o\n", "stderr": "e\n"},
    {"output": "ab", "returncode": 0, "stdout_b64": "YQA=", "stderr_b64": "Yg==", "stdout_bytes": 2},
    {"output": "ab", "returncode": 0, "stdout_b64": "YWI="},  # stderr empty, bytes
    {"output": "f", "returncode": 0, "data": {"path": "a.txt", "returncode": None}},  # data overrides
    protocol.call_result(output="full\n", returncode=0),  # a whole result, every key
    {}, {"returncode": None}, {"output": "n\n", "returncode": "0"},  # plain keys, odd values
]


@pytest.mark.parametrize("tool", ["bash", "read_file"])
@pytest.mark.parametrize("result", AGENT_RESULTS)
def test_from_agent_gives_what_the_constructor_gives(result, tool):
    """Every field as the constructor's path sets it (``__post_init__``'s defaults
    included) and no other attribute: a field added to ExecutionResult later and not
    set by the shortcut fails here. Red with the shortcut's ``reason`` default left out
    (results 3 and 4), or with ``stderr`` not made bytes beside bytes ``stdout`` (8)."""
    fast = ExecutionResult.from_agent(dict(result), "sb_slot_1", "e" * 32, tool)
    slow = _ViaConstructor.from_agent(dict(result), "sb_slot_1", "e" * 32, tool)
    assert type(fast) is ExecutionResult and type(slow) is _ViaConstructor
    assert vars(fast) == vars(slow)
    assert set(vars(fast)) == {f.name for f in dataclasses.fields(ExecutionResult)}
    assert fast == ExecutionResult(**vars(slow))


def test_a_call_group_answers_each_of_its_ids_once():
    """Ids outside the group, and a second answer, change nothing; ``on_complete`` runs
    once, with the last outcome; ``unanswered`` lists the rest last first."""
    group = CallGroup()
    group.open(10, 3)
    done = []
    group.on_complete = done.append
    assert group.unanswered() == [12, 11, 10]
    assert not group.answer(9, "before") and not group.answer(13, "after")
    assert not group.answer(11, {"output": "b"})
    assert not group.answer(11, {"output": "again"})
    assert group.unanswered() == [12, 10]
    assert not group.answer(12, ValueError("c"))
    assert done == []
    assert group.answer(10, {"output": "a"})
    assert done == [group] and group.left == 0 and group.unanswered() == []
    assert group.outcome(11) == {"output": "b"} and isinstance(group.outcome(12), ValueError)


async def test_a_groups_calls_are_counted_and_released_like_single_ones(make_backend):
    """In one sandbox's group: a sent call, one refused before sending (its own timeout
    past the maximum), one that fails in the sandbox, one that times out. The slots are
    executing while they run and acquired after; their call counts, the pool's calls and
    rate count the three sent (not the refused one), its failures two, its timeouts one.
    Red with a group's calls not ended, not counted in the rate or their timeouts not
    counted."""
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=2)
    a, b = await backend.acquire("a"), await backend.acquire("b")
    pool = backend._pools[a.profile]
    stats0 = dict(pool.stats)
    rate0 = sum(n for _, n in pool._rate_window)
    calls0 = dict(a._calls)
    task = asyncio.ensure_future(backend.execute_batch([
        (a, "bash", {"command": "sleep 0.5; echo ok"}),
        (a, "bash", {"command": "sleep 5", "timeout": 0.3}),
        (b, "bash", {"command": "echo never", "timeout": 10 ** 9}),
        (b, "bash", {"command": "(exit 3)"}),
    ]))
    await asyncio.sleep(0.2)
    assert a.state is SlotState.EXECUTING  # the positive control: counted as running
    ok, timed_out, refused, failed = await task
    assert timed_out.returncode == 124 and timed_out.metadata["timed_out"]
    assert ok.success and ok.output == "ok\n"
    assert not refused.success and refused.metadata["reason"] == "bad_request"
    assert "longer than" in refused.error
    assert failed.returncode == 3 and failed.error == "exit code 3"
    assert a.state is SlotState.ACQUIRED and b.state is SlotState.ACQUIRED
    assert a._calls["bash"] == calls0.get("bash", 0) + 2
    assert b._calls["bash"] == 1
    assert pool.stats["calls"] - stats0["calls"] == 3
    assert pool.stats["failures"] - stats0["failures"] == 2
    assert pool.stats["timeouts"] - stats0["timeouts"] == 1
    assert sum(n for _, n in pool._rate_window) - rate0 == 3
    assert len({ok.execution_id, failed.execution_id}) == 2 and len(ok.execution_id) == 32


async def test_a_malformed_results_frame_fails_only_the_calls_it_names(make_backend):
    """A ``results`` frame from the agent with entries that are not ``[id, object]``:
    the one naming a call with a result that is not an object fails that call (no
    answer: ``lost``), the others are passed over, and a good entry after them in the
    same frame still answers its call; the sandbox lives on. Red before (the entry
    ``[second]`` raised ValueError in the sandbox's reader)."""
    backend = await make_backend(min_sandboxes=1, max_sandboxes=1, slots_per_sandbox=3)
    slots = [await backend.acquire(f"t{i}") for i in range(3)]
    sb = slots[0]._sandbox.sandbox
    task = asyncio.ensure_future(backend.execute_batch(
        [(s, "bash", {"command": f"sleep 2; echo real-{i}"}) for i, s in enumerate(slots)]))
    await asyncio.sleep(0.3)
    first, second, third = sorted(sb._groups)
    sb._on_data(protocol.encode({"id": 0, "results": [
        [first, "not an object"], [second], 7, [[], {}], [second, {"output": "injected\n", "returncode": 0}]]}))
    bad, good, real = await asyncio.wait_for(task, 10)
    assert not bad.success and bad.metadata["reason"] == "lost" and "not an object" in bad.error
    assert good.success and good.output == "injected\n"
    assert real.success and real.output == "real-2\n"  # the control: the agent's own answer
    assert not sb.dead
    [again] = await backend.execute_batch([(slots[0], "bash", {"command": "echo again"})])
    assert again.output == "again\n"
