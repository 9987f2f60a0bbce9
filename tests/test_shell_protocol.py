"""How a command reaches the slot's shell: its text on the shell's command pipe (no file
write per call), or through the ``cmd`` file when it is too large for the pipe, holds a NUL byte or
has variables of its own; either way with the semantics of a sourced script."""

from __future__ import annotations

import asyncio

import pytest
from support import bash

from hermes_modal_tool.agent.shells.shellprocs import FRAME, HEADER
from hermes_modal_tool.agent.shells.shellstart import INLINE_MAX

#: Commands in the shell's one read (the frame), just past it, that hold as much as the
#: pipe takes, and more (these go through ``cmd``).
SIZES = {"in the frame": FRAME - HEADER - 1, "past the frame": FRAME - HEADER + 1, "small": 100,
         "at the pipe's limit": INLINE_MAX - FRAME - 1, "past it": INLINE_MAX + 10,
         "large": 300_000}


def padded(command: str, size: int) -> str:
    """``command``, then a comment line making the text ``size`` bytes long (newline added
    by the agent not counted)."""
    pad = size - len(command.encode()) - 2
    return command + "\n#" + "x" * pad


@pytest.mark.parametrize("size", list(SIZES))
async def test_a_command_of_any_size_runs_as_a_sourced_script(backend, slot, size):
    n = SIZES[size]
    r = await bash(backend, slot, padded("cd /tmp && export SEEN=yes; echo \"$LINENO ${#PWD}\"; "
                                         "f() { return 3; }; echo héllo; return 7", n))
    assert r.returncode == 7 and r.output == "1 4\nhéllo\n", (r.output, r.error)
    r = await bash(backend, slot, padded("echo $PWD $SEEN; nosuchcmd-x", n))
    assert r.output == "/tmp yes\nbash: line 1: nosuchcmd-x: command not found\n", r.output
    r = await bash(backend, slot, padded("true\nif then", n))
    assert r.returncode == 2 and "/run/hmt" not in r.output, r.output
    assert r.output.startswith("bash: line 2: syntax error near unexpected token"), r.output


async def test_commands_do_not_rewrite_the_command_file(backend, slot):
    """A command that fits the pipe is not written to a file: the slot's ``cmd`` control
    file keeps what the shell started with (its command runner) whatever runs."""
    before = await bash(backend, slot, "stat -c %Y.%s /run/hmt/cmd; cat /run/hmt/cmd")
    assert before.success and "__hmt_f()" in before.output, (before.output, before.error)
    for i in range(5):
        assert (await bash(backend, slot, f"echo {i}")).output == f"{i}\n"
    after = await bash(backend, slot, "stat -c %Y.%s /run/hmt/cmd; cat /run/hmt/cmd")
    assert after.output == before.output


async def test_odd_bytes_stdin_and_env_on_either_path(backend, slot):
    """Text that is not ASCII (through ``cmd``) and the stdin and env arguments keep their
    meaning; a NUL byte, which neither path could carry, is refused by name."""
    r = await bash(backend, slot, "printf '%s' 'café' | od -An -tx1 | tr -d ' \\n'")
    assert r.output == "636166c3a9", r.output
    r = await bash(backend, slot, "echo a\x00b")
    assert not r.success and "'command'" in r.error and "NUL" in r.error, r.error
    for n in (30, 50, INLINE_MAX * 2):
        r = await bash(backend, slot, padded("tr a-z A-Z", n), stdin="in put\n")
        assert r.output == "IN PUT\n", r.output
        r = await bash(backend, slot, padded('echo "$ONLY"', n), env={"ONLY": "now"})
        assert r.output == "now\n", r.output
    assert (await bash(backend, slot, 'echo "${ONLY-unset}"')).output == "unset\n"


async def test_a_command_reads_nothing_of_the_protocol(backend, slot):
    """The shell's stdin is /dev/null for every command; the command pipe is on a
    close-on-exec descriptor, so no program a command runs holds it."""
    r = await bash(backend, slot, "cat; read -r x; echo \"read=$? x=$x\"; ls /proc/self/fd")
    assert r.output == "read=1 x=\n0\n1\n2\n3\n", r.output
    r = await bash(backend, slot, "readlink /proc/self/fd/0")
    assert r.output == "/dev/null\n", r.output
    assert (await bash(backend, slot, "echo after")).output == "after\n"


async def test_a_batch_result_never_waits_for_a_slow_neighbour(backend, slot):
    """Results of calls that reach the agent in one write go back together, but a fast
    call's result does not wait for a slow one of its batch: it is sent within the hold
    (``agent.calls.HOLD_S``), and the batch's last result at once."""
    other = await backend.acquire("neighbour")
    try:
        assert other.sandbox_id == slot.sandbox_id
        sb = backend._pools[slot.profile]._sandboxes[slot.sandbox_id]
        frames = [{"op": "call", "slot": s.index, "tool": "bash", "args": {"command": c}, "timeout": 30}
                  for s, c in ((other, "sleep 3; echo slow"), (slot, "echo fast"))]
        (_, slow), (_, fast) = (sb.submit(f, 60, flush=False) for f in frames)
        sb.flush()  # one write: one batch for the agent
        done, _ = await asyncio.wait({slow, fast}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {fast} and fast.result()["result"]["output"] == "fast\n", fast.result()
        assert not slow.done()
        assert (await slow)["result"]["output"] == "slow\n"
        both = await backend.execute_batch([(slot, "bash", {"command": f"echo {i}"}) for i in range(3)]
                                           + [(other, "bash", {"command": "echo last"})])
        assert [r.output for r in both] == ["0\n", "1\n", "2\n", "last\n"]
    finally:
        await backend.release(other)


async def test_a_shell_started_with_fd_10_open_still_takes_its_commands(make_backend):
    """The loop reads its commands on fd 10, where bash saves the command pipe: it closes
    10 first, so a descriptor 10 the shell already had (here opened by the profile's
    ``BASH_ENV`` file, which bash sources before anything else) cannot take the pipe's place."""
    opener = '$(printf "exec 10</dev/null\\n" > /tmp/.fd10; echo /tmp/.fd10)'
    backend = await make_backend(env_vars={"BASH_ENV": opener})
    slot = await backend.acquire("fd10")
    r = await bash(backend, slot, "echo ok; readlink /proc/$$/fd/10")
    assert r.success and r.output.startswith("ok\npipe:"), (r.output, r.error)
    assert (await bash(backend, slot, "echo again")).output == "again\n"
