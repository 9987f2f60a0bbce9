"""One persistent bash session per slot.

Stdlib-only, Python 3.8.

How a command runs: the shell reads commands in a loop it is given when it starts::

    while :; do read -r -N 9 __hmt_h; ...; __hmt_n=${__hmt_h:0:8}; __hmt_f; printf '\\036%s %d\\036\\n' "$__hmt_n" "$?"; done

The agent writes the command text to the slot's control file ``cmd`` (one ``pwrite``:
bash ``source``s it, so ``cd``, ``export``, ``declare`` and functions persist, a
``return`` ends the command and bash's messages name the file, which the output
shows as ``bash``), then 9 bytes to the shell's stdin: a fresh random nonce and the
command's input (``n``: /dev/null, ``s``: the control file ``stdin``, ``e``: the control
file ``e``, which sets variables for the command). ``read -N 9`` takes them in one
``read`` (a line would cost bash one ``read`` per byte on a pipe). ``__hmt_f`` is a
read-only function, so a ``break`` in the command cannot leave the loop. Output goes to
a pipe the agent reads, stderr to a second one (:mod:`.output` keeps them interleaved
in arrival order and apart); the end of a command is the marker line with its nonce on
stdout, and when it comes the agent drains what stderr holds before the call ends.

Starting: ``Popen`` of the slot's ``bwrap`` blocks for 5-10 ms (it joins cgroups and
drops its uid between fork and exec), so it runs in a worker thread, never on the
agent's event loop; the slot's root layer is built there too. The shell is *ready* when
it has printed a marker after its init lines; a command's timeout clock starts when the
command is written to a ready shell, so the time a shell takes to start never counts
against a command. A start is bounded (:func:`.shellprocs.start_timeout`, 60 s, from its
turn among the starting shells): past it the call fails with an error naming the slot
and the step that was stuck, and what it started is killed, so a call never waits for a
shell forever. While the root is built and bwrap starts, the start holds the slot's
``layer_lock``, which forks, snapshots and resets hold while they change the slot's
layers. Timeouts and stopping: :mod:`.shellprocs`.
"""

import asyncio
import os
import subprocess
import threading
import time

from .. import protocol
from . import isolation, rootplan
from .output import OutputCollector, marker  # noqa: F401 - marker: re-exported for callers
from .shellprocs import ShellProcesses, new_nonce, start_timeout

# On SIGUSR1 (a timeout) return from what runs: the sourced command, or a function it
# runs. In the loop itself there is nothing to return from (the error is silenced), so a
# signal that comes just after the command ended cannot skip the end marker.
TRAP = "trap 'return 124 2>/dev/null' USR1\n"
INIT_LINES = "set +o history 2>/dev/null; shopt -s expand_aliases\n"
#: The command loop (``@CTL@``: the control directory as the shell sees it). ``read``
#: interrupted by a trapped signal returns > 128: read again; 1 is the end of stdin.
LOOP = ("__hmt_f() { case ${__hmt_h:8:1} in n) . @CTL@/cmd </dev/null;; "
        "s) . @CTL@/cmd <@CTL@/stdin;; e) . @CTL@/e;; *) :;; esac; }\n"
        "readonly -f __hmt_f\n"
        "while :; do \\builtin read -r -N 9 __hmt_h; case $? in 0) ;; 1) \\builtin exit;; "
        "*) \\builtin continue;; esac; __hmt_n=${__hmt_h:0:8}; __hmt_f; "
        "\\builtin printf '\\036%s %d\\036\\n' \"$__hmt_n\" \"$?\"; done\n")
#: Shells of a sandbox that may start at once (each takes ~10 ms of CPU, more on a busy
#: machine); ``Popen`` runs in as many threads (it blocks; the event loop must not).
SPAWN_THREADS = 4


class Shell(ShellProcesses):
    """A persistent bash process for one slot (started on demand, restarted when it dies)."""

    def __init__(self, slot, loop):
        self.slot = slot
        self.loop = loop
        self.proc = None
        self.stdin_fd = None
        self.out_fd = None
        self.err_fd = None
        self.info_fd = None
        self.init_pid = None
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
        self.timer = None
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
    def ensure_ready(self):
        """Start the shell unless it is ready or starting; return a future of the outcome.

        The outcome is None once the shell is ready, else a failed ``call`` result
        saying why it did not start (its output is what bwrap or bash printed), at the
        latest :func:`.shellprocs.start_timeout` seconds after its turn came. At most
        ``agent.spawn_limiter`` shells of the sandbox start at once (the rest wait their
        turn); ``Popen`` runs in the agent's "spawn" threads, the rest on the loop.
        """
        if self.starting is None:
            if self.ready:
                fut = self.loop.create_future()
                fut.set_result(None)
                return fut
            self.kill_on_start = False
            self.starting = self.loop.create_task(self._start())
        return self.starting

    async def _start(self):
        agent = self.slot.agent
        try:
            if self.proc is not None and not self.alive:
                self.close_fds()  # it died; _on_output already reaped it
                self.proc = None
            elif self.proc is not None:
                await self.stop()  # never became ready, or runs on a layer the slot left
            async with agent.spawn_limiter:
                if self.kill_on_start or agent.closing:
                    return protocol_result("the slot's shell was stopped before it started", 1)
                key = ("shell", self.slot.index)
                agent.admission.hold(key)  # a starting shell weighs like a running command
                try:
                    return await self._start_bounded(start_timeout(agent))
                finally:
                    agent.admission.release(key)
        finally:
            if self.starting is asyncio.current_task():
                self.starting = None

    async def _start_bounded(self, limit):
        """Spawn the shell and wait until it is ready, all within ``limit`` seconds (its turn
        among the starting shells does not count); past it the call fails, never hangs."""
        slot = self.slot
        deadline = self.loop.time() + limit
        self.start_phase = "waiting for a fork, snapshot or reset of the slot to change its layers"
        self.spawn_tid = None  # set by _popen in its thread: only this start's children are killed
        spawn = self.loop.create_task(self._spawn())
        try:
            done, _ = await asyncio.wait({spawn}, timeout=limit)
        except asyncio.CancelledError:
            spawn.cancel()
            raise
        if not done:
            phase = self.start_phase
            spawn.cancel()  # what the thread still starts is stopped when it returns
            self.free_stuck_spawn()
            return protocol_result(
                "slot %d: its shell did not start within %gs (it was stuck %s); the next "
                "command tries a new one" % (slot.index, limit, phase), 1)
        try:
            spawned = spawn.result()
        except Exception as exc:  # noqa: BLE001 - reported as the call's result
            return protocol_result("the slot's shell could not be started: %s" % (exc,), 1)
        if spawned is None:
            return protocol_result("the slot's shell was stopped before it started", 1)
        self._attach(*spawned)
        return await self._wait_ready(max(0.0, deadline - self.loop.time()), limit)

    async def _spawn(self):
        """``_popen`` in a "spawn" thread while the slot's layers stay put (a fork or
        snapshot holds ``slot.layer_lock`` while it changes them); None when the start was
        called off meanwhile."""
        slot = self.slot
        async with slot.layer_lock:
            if self.kill_on_start or slot.agent.closing:
                return None
            self.start_phase = "waiting for a free spawn thread"
            fut = self.loop.run_in_executor(slot.agent.executor("spawn"), self._popen)
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                fut.add_done_callback(self.discard_late_spawn)  # given up: stop what it starts
                raise

    def _popen(self):
        """Start bwrap (or bash); blocking, so it runs in a worker thread."""
        slot = self.slot
        agent = slot.agent
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pass_fds = ()
        info_r = info_w = None
        binds, bash = rootplan.shell_argv(agent.image_bash)  # an image's, or a static one
        self.spawn_tid = threading.get_native_id()  # whose children a stuck start may leave
        layer = None
        try:
            if slot.root is not None:
                self.start_phase = "building the slot's root filesystem"
                slot.ensure_root()  # in this thread: mounts and a fork, once per layer
                layer = slot.root.active
                info_r, info_w = os.pipe()
                pass_fds = (info_w,)
                argv = isolation.bwrap_root_argv(
                    agent.bwrap, slot.root.merged, slot.ctl_host, agent.network,
                    "slot-%d" % slot.index, info_w, slot.start_dir, agent.tmpfs_mb,
                    agent.contain_root) + binds + bash
                cwd = "/"
            elif agent.isolation == "bwrap":
                info_r, info_w = os.pipe()
                pass_fds = (info_w,)
                argv = isolation.bwrap_argv(
                    agent.bwrap, slot.ws_host, slot.ws_path, slot.ctl_host, agent.network,
                    agent.hide, "slot-%d" % slot.index, info_w, agent.tmpfs_mb,
                    slot.tmpfs.place if slot.tmpfs else None) + bash
                cwd = "/"
            else:
                argv = bash
                cwd = slot.ws_host
            preexec = isolation.make_preexec(
                agent.cgroups.slot_procs_files(slot.index) if agent.cgroups else [],
                agent.rlimits + slot.rlimits, slot.uid, slot.gid)
            self.start_phase = "in bwrap's start (Popen: fork, cgroups, uid drop, exec)"
            proc = subprocess.Popen(
                argv, stdin=in_r, stdout=out_w, stderr=err_w, env=slot.env, cwd=cwd,
                pass_fds=pass_fds, preexec_fn=preexec, close_fds=True,
                start_new_session=(agent.isolation != "bwrap"))
        except BaseException:
            for fd in (in_w, out_r, err_r, info_r):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
            os.close(err_w)
            if info_w is not None:
                os.close(info_w)
        return proc, in_w, out_r, info_r, err_r, layer

    def _attach(self, proc, in_w, out_r, info_r, err_r, layer):
        """Take over a started shell: read its output, write its init lines and the ready marker."""
        self.proc = proc
        self.layer = layer
        self.stdin_fd = in_w
        self.out_fd = out_r
        self.info_fd = info_r
        if info_r is not None:
            os.set_blocking(info_r, False)
        os.set_blocking(out_r, False)
        self.err_fd = err_r
        if err_r is not None:
            os.set_blocking(err_r, False)
            self.loop.add_reader(err_r, self._on_err)
        self.init_pid = None
        self.ns_link = None
        self.bash_pid = None
        self.is_ready = False
        self.exit_status = None
        self.used = False
        self.eof = self.loop.create_future()
        self.loop.add_reader(out_r, self._on_output)
        nonce = new_nonce()
        self.ready_collector = OutputCollector(nonce.encode(), 4096, self.loop)
        start = TRAP + INIT_LINES
        if self.slot.replay:  # a snapshot's shell state (agent/snapshots.py)
            start += ". %s 2>/dev/null\n" % shell_quote(self.slot.replay)
        if self.resume_dir:
            start += "cd %s 2>/dev/null\n" % shell_quote(self.resume_dir)
            self.resume_dir = None
        start += "\\builtin printf '\\036%%s 0\\036\\n' %s\n" % nonce
        start += LOOP.replace("@CTL@", shell_quote(self.slot.ctl_path))
        try:
            self._write(start.encode())
        except OSError:
            pass  # it died at once: its output and exit status say why
        if self.kill_on_start or self.slot.agent.closing:
            self.kill()

    async def _wait_ready(self, wait_s, limit):
        """Wait (at most ``wait_s``) for the marker that ends the init lines; ``limit`` is
        the whole start's bound (for the message)."""
        collector = self.ready_collector
        expired = []

        def expire():
            expired.append(True)
            self.kill()

        timer = self.loop.call_later(wait_s, expire)
        try:
            ended = await collector.wait()
        finally:
            timer.cancel()
            self.ready_collector = None
        if ended and self.alive:
            self.is_ready = True
            self.bash_pid = self._find_bash()
            return None
        text, _ = collector.text()
        status = self.exit_status
        if expired:
            return protocol_result(
                "slot %d: its shell did not start within %gs (bash was started but did not "
                "finish its init lines: the machine is overloaded, or the profile's environment "
                "(BASH_ENV) blocks it); it was killed and the next command tries a new one"
                % (self.slot.index, limit), 1, text)
        if self.slot.agent.closing:
            why = "the sandbox was stopped (the backend is shutting down)"
        else:
            why = "it exited with status %s" % (status,)
        return protocol_result("the slot's shell did not start: %s" % why,
                               status if isinstance(status, int) and status > 0 else 1, text)

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
        try:
            data = os.read(self.out_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
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
        try:
            data = os.read(self.err_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # every writer is gone
            self.loop.remove_reader(self.err_fd)
            return
        target = self.ready_collector or self.collector
        if target is not None:
            target.feed_err(data)

    def _drain_err(self, collector):
        """Read what stderr holds now (one empty read on the common path; at most
        1 MiB, should a process the command left behind keep writing)."""
        fd = self.err_fd
        for _ in range(16 if fd is not None else 0):
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
    def start(self, command_file, stdin_path, env, timeout, limit, on_done, one_line=False,
              raw=False):
        """Start one command, already written to ``command_file`` (the slot's ``cmd``
        control file); ``stdin_path``: ``/dev/null`` or a control file with its input;
        ``env``: variables for this command only; ``one_line``: the command is a single
        line, so bash's messages about it need no line number; ``raw``: also keep each
        stream's exact bytes (``encoding="bytes"``).

        ``on_done(result)`` is called once with a ``call`` result dict: from the
        output reader when the end marker arrives (no task or future on this path),
        or after the timeout/cancel procedure has killed what the command started.
        """
        self.started_at = time.monotonic()  # the timeout clock starts here, in a ready shell
        self.used = True  # from now on a reset must replace this shell
        nonce = new_nonce()  # only this slot's own output could forge it
        self.cmd_started = isolation.process_clock()
        collector = OutputCollector(nonce.encode(), limit, self.loop)
        collector.source = command_file.encode()
        collector.one_line = one_line
        if raw:
            collector.keep_raw()
        self.collector = collector
        self.on_done = on_done
        self.timeout = timeout
        self.timed_out = self.cancelled = self.interrupting = self.restarted = False
        self.stop_reason = None
        ctl = self.slot.ctl_path
        if env or command_file != ctl + "/cmd" or stdin_path not in ("/dev/null", ctl + "/stdin"):
            prefix = "".join("%s=%s " % (k, shell_quote(v)) for k, v in env.items())
            self.slot.write_ctl("e", ("%s. %s <%s\n" % (prefix, shell_quote(command_file),
                                                       shell_quote(stdin_path))).encode())
            mode = "e"
        else:
            mode = "n" if stdin_path == "/dev/null" else "s"
        try:
            if not self.alive:
                raise OSError("the shell is gone")
            self._write((nonce + mode).encode())  # one write: the shell reads it in one read
        except OSError:
            collector.finish(self.exit_status)  # reported as the shell having exited
        self.timer = self.loop.call_later(timeout, self._on_timeout)
        if collector.ended is not None:
            self._complete()

    async def run(self, command_file, stdin_path, env, timeout, limit):
        """Coroutine form of :meth:`start` (for the rare paths that want to await)."""
        fut = self.loop.create_future()
        self.start(command_file, stdin_path, env, timeout, limit, fut.set_result)
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
        self.timer.cancel()
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
        self.timer.cancel()
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
            if status is not None and status > 128 and self.slot.agent.isolation == "bwrap":
                status = 128 - status  # bwrap reports its child's death by signal N as 128+N
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


def protocol_result(error, returncode, output=""):
    """A failed ``call`` result (nothing of the command ran)."""
    return protocol.call_result(output=output, error=error, returncode=returncode)


def shell_quote(value):
    """Single-quote a string for bash."""
    return "'" + str(value).replace("'", "'\"'\"'") + "'"
