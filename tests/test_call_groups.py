"""The grouped batch path on the host (``_call_group.py``, ``PoolCalls.submit_group`` and
``group_results``, ``Sandbox.submit_group``/``_on_results``): what its per-call shortcuts
must still give, the results a plain constructor gives and the bookkeeping of one call at
a time."""

from __future__ import annotations

import dataclasses

import pytest

from hermes_modal_tool import ExecutionResult, protocol


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
