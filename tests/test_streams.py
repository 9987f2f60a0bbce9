"""Process I/O: stdout and stderr kept apart, exact bytes, once per driver.

``output`` stays what the model reads (both streams interleaved in the order they
came, capped); ``stdout`` and ``stderr`` are the two streams alone, capped the same
way; ``encoding="bytes"`` gives each stream's exact bytes.
"""

from __future__ import annotations

import pytest
from support import bash

#: Bytes no text decoding keeps: NUL, a lone continuation byte, an overlong "/",
#: a truncated 3-byte sequence, and every byte value once.
NASTY = b"a\x00b\x80c\xc0\xafd\xe2\x82" + bytes(range(256))


def _printf(data: bytes) -> str:
    """A printf format that writes ``data`` exactly."""
    return "".join(f"\\{b:03o}" for b in data)


async def test_stdout_and_stderr_apart_and_interleaved_in_output(driver_backend):
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1)
    slot = await backend.acquire("streams")
    r = await bash(backend, slot, "echo out1; sleep 0.05; echo err1 >&2; sleep 0.05; "
                                  "echo out2; nosuchcommand-xyz; exit 3")
    assert r.returncode == 3
    assert r.stdout == "out1\nout2\n"
    assert r.stderr == "err1\nbash: nosuchcommand-xyz: command not found\n"
    assert r.output == "out1\nerr1\nout2\nbash: nosuchcommand-xyz: command not found\n"
    only = await bash(backend, slot, "echo just-out")
    assert (only.output, only.stdout, only.stderr) == ("just-out\n", "just-out\n", "")
    assert only.stdout is only.output  # the common path: no second copy
    err_only = await bash(backend, slot, "echo just-err >&2")
    assert (err_only.output, err_only.stdout, err_only.stderr) == ("just-err\n", "", "just-err\n")


async def test_exact_bytes_with_nul_and_invalid_utf8(driver_backend):
    backend = await driver_backend(slots_per_sandbox=2, max_sandboxes=1)
    slot = await backend.acquire("bytes")
    err = b"\xff\xfeE\x00rr"
    r = await bash(backend, slot, f"printf '{_printf(NASTY)}'; printf '{_printf(err)}' >&2",
                   encoding="bytes")
    assert r.success, r
    assert r.stdout == NASTY
    assert r.stderr == err
    assert r.metadata["stdout_bytes"] == len(NASTY) and r.metadata["stderr_bytes"] == len(err)
    assert "\ufffd" in r.output  # what the model reads stays text
    text = await bash(backend, slot, f"printf '{_printf(NASTY)}'")
    assert isinstance(text.stdout, str) and "\ufffd" in text.stdout


async def test_exact_bytes_are_capped_by_bytes(driver_backend):
    backend = await driver_backend(output_limit=1000)
    slot = await backend.acquire("cap")
    r = await bash(backend, slot, "head -c 5000 /dev/zero; echo tiny >&2", encoding="bytes")
    assert r.stdout == b"\x00" * 1000  # the first output_limit bytes, exactly
    assert r.stderr == b"tiny\n"
    assert r.metadata["stdout_bytes"] == 5000 and r.metadata["truncated"]


async def test_streams_capped_like_output(driver_backend):
    backend = await driver_backend(output_limit=1000)
    slot = await backend.acquire("cap-text")
    r = await bash(backend, slot, "echo first >&2; sleep 0.1; seq 1 3000; sleep 0.1; echo last >&2")
    assert r.metadata["truncated"]
    assert len(r.stdout) < 1200 and r.stdout.startswith("1\n") and r.stdout.endswith("3000\n")
    assert "output truncated" in r.stdout
    assert r.stderr == "first\nlast\n"
    assert len(r.output) < 1200 and r.output.startswith("first\n1\n")


async def test_a_bad_encoding_is_named(driver_backend):
    backend = await driver_backend()
    slot = await backend.acquire("bad")
    r = await bash(backend, slot, "echo x", encoding="latin-1")
    assert not r.success and "encoding" in r.error and "latin-1" in r.error


@pytest.mark.parametrize("command", ["sleep 5 >&2 & echo quick", "(echo late >&2; sleep 0.2) &"])
async def test_stderr_of_left_behind_jobs_does_not_block(driver_backend, command):
    backend = await driver_backend(execution_timeout_s=4.0)
    slot = await backend.acquire("bg")
    r = await bash(backend, slot, command)
    assert r.success and r.metadata["duration_s"] < 2
    after = await bash(backend, slot, "echo next")
    assert after.stdout == "next\n"
