"""One persistent bash session per slot.

Stdlib-only, Python 3.8.

How a command runs: the shell reads commands in a loop it is given when it starts
(``shellstart.LOOP``), with /dev/null as its stdin and the command pipe on fd 10::

    { while :; do read -r -N 64 -u 10 __hmt_h; ...; __hmt_f; printf '\\036%s %d\\036\\n' "${__hmt_h:0:8}" "$?"; done; } </dev/null

The agent writes one message to the shell's command pipe (:func:`.shellprocs.frame`): a
64-byte frame with a 17-byte header (a fresh random nonce, the mode, the text's length
in hex) and, when it fits, the command's text padded with spaces; a longer text follows
the frame. ``__hmt_f`` runs it with ``eval`` in the shell itself, so ``cd``, ``export``,
``declare`` and functions persist and a ``return`` ends the command; it was sourced from
the control file ``cmd``, so bash's messages name that file, which the output shows as
``bash``. The mode is the command's input: ``p`` (``l`` when the text follows the
frame), /dev/null; ``q`` (``m``), the control file ``stdin``. ``read -N`` takes each
part in one ``read`` (a line would cost bash one ``read`` per byte on a pipe), so most
commands cost bash one ``read``. A command too large for the pipe, not ASCII (``read
-N`` counts characters, the header bytes), with a NUL byte or with variables of its own
goes through files instead (frame only, length 0): ``n`` and ``s`` source ``cmd`` (input
as ``p`` and ``q``), ``e`` sources the control file ``e``, which sets the variables.
``__hmt_f`` is a read-only function, so a ``break`` in the command cannot leave the
loop. Output goes to a pipe the agent reads, stderr to a second one (:mod:`.output`
keeps them interleaved in arrival order and apart); the end of a command is the marker
line with its nonce on stdout, and when it comes the agent drains what stderr holds
before the call ends.

Starting: :mod:`.shellstart`. Timeouts and stopping: :mod:`.shellprocs`.
"""

import fcntl
import os
import time

from ..limits import isolation
from .output import OutputCollector, marker  # noqa: F401 - marker: re-exported for callers
from .shellprocs import FRAME, ShellProcesses, frame, new_nonce
from .shellstart import SPAWN_THREADS, ShellStart, protocol_result, shell_quote  # noqa: F401


class Shell(ShellStart, ShellProcesses):
    """A persistent bash process for one slot (started on demand, restarted when it dies)."""

    def __init__(self, slot, loop):
        self.slot = slot
        self.loop = loop
        self.proc = None
        self.stdin_fd = None
        self.pipe_room = 0  # bytes a command may take on the command pipe (set at start)
        self.out_fd = None
        self.err_fd = None
        self.info_fd = None
        self.init_pid = None
        self.told_watch = None  # (info fd, timer) of a kill waiting for the init's pid
        self.ns_link = None
        self.bash_pid = None  # host pid of bash, known once the shell is ready
        self.collector = None
        self.ready_collector = None  # waits for the marker that ends the init lines
        self.starting = None  # the task that starts the shell, while it runs
        self.kill_on_start = False  # kill() came before the shell could be killed
        self.is_ready = False
        self.exit_status = None
        self.eof = None
        self.resume_dir = None
        self.used = False
        self.cmd_started = (0, 0)
        self.on_done = None
        self.timer = None  # the running command's deadline (``agent.deadlines`` entry)
        self.timeout = 0.0
        self.started_at = 0.0
        self.timed_out = self.cancelled = self.interrupting = self.restarted = False
        self.stop_reason = None
        self.layer = None  # the slot's root layer the shell runs on (None: no layered root)
        self.start_phase = ""  # what the start does now (for the message when it is stuck)
        self.spawn_tid = None  # native id of the thread that ran the last Popen

    @property
    def alive(self):
        return self.proc is not None and self.eof is not None and not self.eof.done()

    @property
    def ready(self):
        """Whether a command can be written to the shell now: it runs, has read its init,
        and its root is the slot's layer in use (a shell left on a layer a fork or snapshot
        replaced is stopped by the next :meth:`ensure_ready` and a new one started)."""
        return self.is_ready and self.alive and (self.layer is None or self.layer is self.slot.root.active)

    # -- lifecycle ---------------------------------------------------------
    def _write(self, data):
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.stdin_fd, view)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            view = view[n:]

    def _on_output(self):
        data = _read_pipe(self.out_fd)
        if data is None:
            return
        collector = self.collector
        if self.ready_collector is not None:
            ready = self.ready_collector
            if data:
                ready.feed(data)  # before the marker only bwrap or bash itself prints
                return
            self._drain_err(ready)  # bwrap's or bash's own complaint, if any
            ready.finish(None)  # EOF before the marker: handled below, then by _wait_ready
        if data:
            if collector is not None:
                collector.feed(data)
                if collector.ended is not None and not self.interrupting:
                    self._complete()
            return
        # EOF: the shell (and everything holding its output pipe) is gone.
        self.loop.remove_reader(self.out_fd)
        self.exit_status = self._reap(block=True)  # bwrap exits with its child: immediate
        if not self.eof.done():
            self.eof.set_result(self.exit_status)
        if collector is not None:
            collector.finish(self.exit_status)
            if not self.interrupting:
                self._complete()

    def _on_err(self):
        """Stderr is readable: feed it to the running command (or the starting shell)."""
        data = _read_pipe(self.err_fd)
        if data is None:
            return
        if not data:  # every writer is gone
            self.loop.remove_reader(self.err_fd)
            return
        target = self.ready_collector or self.collector
        if target is not None:
            target.feed_err(data)

    def _drain_err(self, collector):
        """Read what stderr holds now (at most 1 MiB, should a process the command left
        behind keep writing). The common path, an empty pipe, costs one ``FIONREAD``
        (~0.9 µs): a read would fail with EAGAIN, and Python makes an exception of it
        (~2.8 µs)."""
        fd = self.err_fd
        if fd is None:
            return
        if _FIONREAD is not None:
            try:
                if fcntl.ioctl(fd, _FIONREAD, _NO_BYTES) == _NO_BYTES:
                    return
            except OSError:
                pass  # the reads below find out
        for _ in range(16):
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            collector.feed_err(data)

    def pause_output(self):
        """Stop reading the shell's pipes (live output waits to be sent; the command
        blocks on a full pipe meanwhile)."""
        for fd in (self.out_fd, self.err_fd):
            if fd is not None:
                self.loop.remove_reader(fd)

    def resume_output(self):
        """Read the shell's pipes again after :meth:`pause_output`."""
        if self.out_fd is not None and self.eof is not None and not self.eof.done():
            self.loop.add_reader(self.out_fd, self._on_output)
        if self.err_fd is not None:
            self.loop.add_reader(self.err_fd, self._on_err)

    def close_fds(self):
        if self.err_fd is not None:
            try:
                self.loop.remove_reader(self.err_fd)
            except (ValueError, OSError):
                pass
            try:
                os.close(self.err_fd)
            except OSError:
                pass
            self.err_fd = None
        super().close_fds()

    # -- running commands --------------------------------------------------
    def start(self, command, stdin_path, env, timeout, limit, on_done, one_line=False,
              raw=False):
        """Start one command: ``command`` is its text (``bytes``); ``stdin_path``:
        ``/dev/null`` or the control file ``stdin`` with its input; ``env``: variables for
        this command only; ``one_line``: the command is a single line, so bash's messages
        about it need no line number; ``raw``: also keep each stream's exact bytes
        (``encoding="bytes"``).

        A text goes down the shell's command pipe in its frame (:func:`.shellprocs.frame`),
        in one write, when it fits the pipe and needs no file (ASCII, no NUL byte, no
        ``env``): else it is written to ``cmd``.

        ``on_done(result)`` is called once with a ``call`` result dict: from the
        output reader when the end marker arrives (no task or future on this path),
        or after the timeout/cancel procedure has killed what the command started.
        """
        self.started_at = time.monotonic()  # the timeout clock starts here, in a ready shell
        self.used = True  # from now on a reset must replace this shell
        nonce = new_nonce()  # only this slot's own output could forge it
        self.cmd_started = isolation.process_clock()
        ctl = self.slot.ctl_path
        collector = OutputCollector(nonce.encode(), limit, self.loop)
        collector.source = (ctl + "/cmd").encode()  # what bash names in its messages
        collector.one_line = one_line
        if raw:
            collector.keep_raw()
        self.collector = collector
        self.on_done = on_done
        self.timeout = timeout
        self.timed_out = self.cancelled = self.interrupting = self.restarted = False
        self.stop_reason = None
        null = stdin_path == "/dev/null"
        own_env = bool(env) or not (null or stdin_path == ctl + "/stdin")
        if (not own_env and command.isascii() and b"\0" not in command
                and len(command) + FRAME <= self.pipe_room):
            message = frame(nonce, "p" if null else "q", command)
        else:
            cmd = self.slot.write_ctl("cmd", command)
            if own_env:
                prefix = "".join("%s=%s " % (k, shell_quote(v)) for k, v in env.items())
                self.slot.write_ctl("e", ("%s. %s <%s\n" % (prefix, shell_quote(cmd),
                                                           shell_quote(stdin_path))).encode())
                message = frame(nonce, "e")
            else:
                message = frame(nonce, "n" if null else "s")
        try:
            if not self.alive:
                raise OSError("the shell is gone")
            self._write(message)  # one write: the shell reads the header in one read
        except OSError:
            collector.finish(self.exit_status)  # reported as the shell having exited
        self.timer = self.slot.agent.deadlines.add(timeout, _timed_out, self)
        if collector.ended is not None:
            self._complete()

    async def run(self, command, stdin_path, env, timeout, limit):
        """Coroutine form of :meth:`start` (for the rare paths that want to await)."""
        fut = self.loop.create_future()
        self.start(command, stdin_path, env, timeout, limit, fut.set_result)
        return await fut

    def cancel(self, reason=None):
        """Stop the running command (its result says it was cancelled, or ``reason``)."""
        if self.collector is not None:
            self.cancelled = True
            self.stop_reason = reason
            self._begin_interrupt()

    def _on_timeout(self):
        if self.collector is not None and self.collector.ended is None:
            self.timed_out = True
            self._begin_interrupt()

    def _begin_interrupt(self):
        if self.interrupting:
            return
        self.interrupting = True
        self.slot.agent.deadlines.drop(self.timer)
        self.slot.agent.own(self._interrupt_then_complete())

    async def _interrupt_then_complete(self):
        try:
            await self.interrupt(self.collector)
        finally:
            self.interrupting = False
            self._complete()

    def _complete(self):
        collector = self.collector
        if collector is None:
            return
        self.collector = None
        self.slot.agent.deadlines.drop(self.timer)
        self._drain_err(collector)  # written before the end marker: it belongs here
        text, truncated = collector.text()
        streams, cut = collector.result_fields()
        ended = bool(collector.ended)
        error = None
        rc = collector.returncode
        if self.slot.agent.closing:
            error = "the sandbox was stopped (the backend is shutting down) while the command ran"
            rc = None
        elif self.cancelled and self.stop_reason:
            error = self.stop_reason
            rc = 1
        elif self.cancelled:
            error = "cancelled; its processes were killed"
        elif self.timed_out:
            rc = 124
            error = "command timed out after %gs; its processes were killed" % self.timeout
            if self.restarted:
                error += ("; the shell itself did not stop and was restarted in the same directory "
                          "(exported variables and functions were lost)")
        elif not ended:
            status = self.exit_status
            if status is not None and 128 < status <= 128 + 64 and self.slot.agent.isolation == "bwrap":
                # bwrap reports its child's death by signal N (1..64) as 128+N; above that
                # it is the shell's own exit code (bash's 254 when it cannot fork, say).
                status = 128 - status
            if status is not None and status < 0:
                error = "the shell was killed by signal %d" % -status
                rc = 128 - status
            else:
                error = "the shell exited"
                rc = status if status is not None else 1
            if self.slot.memory_limit_hit():
                error += " (memory limit reached)"
            error += "; the next command starts a fresh shell in the workspace"
        elif rc == 137 and self.slot.memory_limit_hit():
            error = "killed: the slot's memory limit was reached"
        data = {}
        if self.slot.pids_limit_hit():
            # fork() failed with EAGAIN at the slot's pids limit at least once.
            data["limits_hit"] = ["pids"]
            note = "the slot's process limit (pids_limit) was reached: fork failed"
            if error is not None:
                error += " (%s)" % note
            elif rc not in (0, None):
                error = "exit code %s; %s" % (rc, note)
        on_done, self.on_done = self.on_done, None
        result = {
            "output": text, "error": error, "returncode": rc, "timed_out": self.timed_out,
            "truncated": truncated or cut, "duration_s": time.monotonic() - self.started_at,
            "data": data,
        }
        if streams:
            result.update(streams)
        on_done(result)


#: ``FIONREAD``'s answer (the bytes a pipe holds, a native int) when it holds none.
_NO_BYTES = bytes(4)
try:
    from termios import FIONREAD as _FIONREAD  # its number differs between architectures
except ImportError:  # a Python built without termios: an EAGAIN read instead
    _FIONREAD = None


def _timed_out(shell):
    shell._on_timeout()


def _read_pipe(fd):
    """What a readable pipe holds (up to 64 KiB): None when nothing after all, ``b""`` at
    its end (or when reading failed)."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""
