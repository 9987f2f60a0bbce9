"""What each call costs the agent, and what it must still do: the slot's layer checked
for a full disk with ``fstatfs`` of its descriptor (agent/fs/slotdisk.py), stderr drained before a
call ends after one ``FIONREAD`` (agent/shells/shell.py)."""

from __future__ import annotations

import errno
import os
import tempfile

import pytest

from hermes_modal_tool.agent.fs import slotdisk
from hermes_modal_tool.agent.shells.output import OutputCollector
from hermes_modal_tool.agent.shells.shell import Shell

loop_devices = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/loop-control"),
                                  reason="layer file systems need root and /dev/loop-control")


def _fill(root: str) -> int:
    """Write 1 MiB files under ``root`` until the file system refuses; the bytes written."""
    chunk, written = b"x" * (1 << 20), 0
    for i in range(64):
        try:
            with open(os.path.join(root, f"f{i}"), "wb") as fh:
                fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            return written
        written += len(chunk)
    raise AssertionError("a layer of 8 MiB took 64 MiB")


@loop_devices
def test_a_layers_full_state_is_read_from_its_descriptor():
    """``full`` answers from the layer's descriptor (one ``fstatfs``): not full while
    the layer takes writes, full once the kernel refused one with ENOSPC, and a new
    layer attached after a release is not full (nothing is remembered per number)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        disks = slotdisk.LayerDisks(d, slotdisk.MIN_MB)
        disks.prepare()
        mfd = disks.attach()
        try:
            assert disks.full(mfd) is False
            written = _fill(slotdisk.fd_path(mfd))
            assert written > 0  # the positive control: it held something, then refused
            assert disks.full(mfd) is True
        finally:
            disks.release(mfd)
        again = disks.attach()
        try:
            # The kernel hands out the lowest free descriptor: most likely the same number.
            assert disks.full(again) is False
        finally:
            disks.release(again)
            disks.close()


def _shell_reading(err_fd: int) -> Shell:
    shell = Shell.__new__(Shell)  # only its stderr descriptor is used by _drain_err
    shell.err_fd = err_fd
    return shell


def test_stderr_written_before_the_end_marker_is_drained():
    """At a command's end the agent takes what its stderr pipe holds (written before the
    end marker): all of it when something is there, nothing (and no error) when empty or
    when every writer is gone."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        shell = _shell_reading(r)
        collector = OutputCollector(b"0123abcd", 1 << 20, None)
        shell._drain_err(collector)  # empty: nothing, no exception
        assert collector.err_total == 0
        os.write(w, b"err line\n")
        os.write(w, b"y" * 60000)
        shell._drain_err(collector)
        assert collector.err_total == 9 + 60000
        assert bytes(collector.head).startswith(b"err line\ny")
        shell._drain_err(collector)  # drained: nothing more
        assert collector.err_total == 9 + 60000
        os.write(w, b"last")
        os.close(w)
        w = -1
        shell._drain_err(collector)  # what was written before the writer went
        assert collector.err_total == 9 + 60000 + 4
        shell._drain_err(collector)  # at its end: nothing, no exception
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
