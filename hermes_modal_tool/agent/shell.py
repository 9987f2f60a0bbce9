"""One persistent bash session per slot, and the capped collection of its output.

Stdlib-only, Python 3.8.

How a command runs: the agent writes the command text to the slot's control
directory and sends bash one short line on its stdin::

    __hmt_n=NONCE; { . CTL/cmd; } </dev/null 2>&1; printf '\\036%s %d\\036\\n' "$__hmt_n" "$?"

``.`` (source) runs the command in the shell itself, so ``cd``, ``export``,
``declare`` and functions persist. Output goes to one pipe the agent reads; the
end of a command is the marker line with a fresh random nonce, so a command
cannot end another command's output by printing something that looks like it.

Starting: ``Popen`` of the slot's ``bwrap`` blocks for 5-10 ms (it joins cgroups and
drops its uid between fork and exec), so it runs in a worker thread, never on the
agent's event loop. The shell is *ready* when it has printed a marker after its
init lines; a command's timeout clock starts when the command is written to a
ready shell, so the time a shell takes to start never counts against a command.

Timeouts: the shell traps SIGUSR1 with ``return 124`` (which ends the sourced
command even inside a shell loop; never the runner, so a signal that comes just as
the command ends cannot skip the end marker); the agent sends it and kills every
process of the command (found in the slot's cgroup, else by a scan of /proc) except
the shell, its init and background jobs (TERM, 0.5 s grace, KILL). If the shell
itself does not come back within 5 s it is killed and the next command gets a fresh
shell in the directory the old one was in.
"""

import asyncio
import os
import re
import select
import signal
import subprocess
import time

from .. import protocol
from . import isolation
from .procs import slot_level, tree_usage

MARK = b"\x1e"
# On SIGUSR1 (a timeout) return from what is being sourced: the command, or a function
# it runs. Not from the runner itself: a signal that comes just after the command ended
# must not skip the end marker.
TRAP = "trap 'case ${BASH_SOURCE[0]} in @RUNNERS@) ;; *) return 124 2>/dev/null;; esac' USR1\n"
INIT_LINES = "set +o history 2>/dev/null; shopt -s expand_aliases\n"
# Sourced for each command: the command, then the end marker with its exit code.
# ``\\builtin printf``: a command that redefines printf cannot hide the marker.
RUNNER = ("{ . @CMD@; } <@IN@\n"
          "\\builtin printf '\\036%s %d\\036\\n' \"$__hmt_n\" \"$?\"\n")
TERM_GRACE_S = 0.5
#: Bytes after a marker's prefix within which its end must come (an exit code: "-1".."255").
MARKER_TAIL = 8
SHELL_GRACE_S = 5.0  # generous: a starved but healthy shell must not be replaced
READY_TIMEOUT_S = 60.0  # a shell not ready by then is killed and its call fails


class OutputCollector:
    """Collects one command's output up to its end marker, keeping head and tail.

    Args:
        nonce: the command's marker nonce (bytes).
        limit: the output cap in characters; at most about ``4 * limit`` bytes are held.
    """

    __slots__ = ("_prefix", "limit", "head", "tail", "dropped", "_pending", "returncode",
                 "done", "_keep", "source", "one_line")

    def __init__(self, nonce, limit, loop):
        self._prefix = MARK + nonce + b" "
        self.source = None  # the sourced command file's path (bytes): bash names it in errors
        self.one_line = False
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self._pending = bytearray()
        self.returncode = None
        self.done = loop.create_future()
        self._keep = len(self._prefix) + 16

    def feed(self, data):
        """Take output; linear in it, and never holding more than a marker's length of it
        unstored (output that prints the marker's prefix without its end is output)."""
        if self.done.done():
            return
        pend = self._pending
        pend += data
        plen = len(self._prefix)
        while True:
            idx = pend.find(self._prefix)
            if idx < 0:
                break
            end = pend.find(MARK, idx + plen, idx + plen + MARKER_TAIL)
            if end >= 0:
                try:
                    self.returncode = int(pend[idx + plen:end])
                except ValueError:
                    self.returncode = -1
                self._store(bytes(pend[:idx]))
                del pend[:]
                self.done.set_result(True)
                return
            if len(pend) - (idx + plen) < MARKER_TAIL:
                self._store(bytes(pend[:idx]))  # maybe the marker: wait for its end
                del pend[:idx]
                return
            # Not a marker (a real one ends within a few digits): it is output.
            self._store(bytes(pend[:idx + 1]))
            del pend[:idx + 1]
        if len(pend) > self._keep:
            cut = len(pend) - self._keep
            self._store(bytes(pend[:cut]))
            del pend[:cut]

    def append(self, data):
        """Add output that belongs to this command but came after its end marker."""
        self._store(data)

    def _unname(self, data):
        if self.source is None or self.source not in data:
            return data
        return _unname_in(data, self.source, self.one_line)

    def finish(self, returncode=None):
        """End collection without a marker (shell died or was killed)."""
        if self.done.done():
            return
        self._store(bytes(self._pending))
        del self._pending[:]
        self.returncode = returncode
        self.done.set_result(False)

    def _store(self, data):
        if not data:
            return
        cap = 2 * self.limit
        room = cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
            if not data:
                return
        self.tail += data
        if len(self.tail) > cap:
            extra = len(self.tail) - cap
            self.dropped += extra
            del self.tail[:extra]

    def text(self):
        """Return ``(text, truncated)``: decoded with replacement, capped, marker in the middle.

        Bash names the file it sources in its messages (``/run/hmt/cmd: line 1: x: command
        not found``): that internal path is shown as bash's own name, as a terminal shows it
        (``bash: x: command not found``; ``bash: line N:`` for a command of several lines).
        """
        head = self._unname(bytes(self.head)).decode("utf-8", "replace")
        tail = self._unname(bytes(self.tail)).decode("utf-8", "replace")
        total = len(head) + len(tail) + self.dropped
        if total <= self.limit:
            return head + tail, False
        keep = self.limit // 2
        text = head + tail
        if self.dropped == 0:
            omitted = len(text) - 2 * keep
            return (text[:keep] + marker(omitted) + text[len(text) - keep:], True)
        first = head[:keep]
        last = tail[len(tail) - keep:] if len(tail) >= keep else (head + tail)[-keep:]
        omitted = total - len(first) - len(last)
        return first + marker(omitted) + last, True


def _unname_in(data, source, one_line):
    pattern = re.compile(re.escape(source) + rb": line (\d+): ")
    return pattern.sub(b"bash: " if one_line else rb"bash: line \1: ", data)


def marker(omitted):
    return "\n\n... [output truncated: %d characters omitted] ...\n\n" % omitted


class Shell:
    """A persistent bash process for one slot (started on demand, restarted when it dies)."""

    def __init__(self, slot, loop):
        self.slot = slot
        self.loop = loop
        self.proc = None
        self.stdin_fd = None
        self.out_fd = None
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
        self.runner = self.stdin_runner = None
        self.used = False
        self.cmd_started = (0, 0)
        self.pids_events = 0
        self.on_done = None
        self.timer = None
        self.timeout = 0.0
        self.started_at = 0.0
        self.timed_out = self.cancelled = self.interrupting = self.restarted = False
        self.stop_reason = None

    @property
    def alive(self):
        return self.proc is not None and self.eof is not None and not self.eof.done()

    @property
    def ready(self):
        """Whether a command can be written to the shell now (it runs and has read its init)."""
        return self.is_ready and self.alive

    # -- lifecycle ---------------------------------------------------------
    def ensure_ready(self):
        """Start the shell unless it is ready or starting; return a future of the outcome.

        The outcome is None once the shell is ready, else a failed ``call`` result
        saying why it did not start (its output is what bwrap or bash printed). At most
        ``agent.spawn_limiter`` shells of the sandbox start at once (the rest wait their
        turn); ``Popen`` runs in ``agent.spawner`` (a thread), the rest on the loop.
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
                await self.stop()  # never became ready
            async with agent.spawn_limiter:
                if self.kill_on_start or agent.closing:
                    return protocol_result("the slot's shell was stopped before it started", 1)
                key = ("shell", self.slot.index)
                agent.admission.hold(key)  # a starting shell weighs like a running command
                try:
                    spawned = await self.loop.run_in_executor(agent.spawner, self._popen)
                except Exception as exc:  # noqa: BLE001 - reported as the call's result
                    return protocol_result("the slot's shell could not be started: %s" % (exc,), 1)
                else:
                    self._attach(*spawned)
                    return await self._wait_ready()
                finally:
                    agent.admission.release(key)
        finally:
            self.starting = None

    def _popen(self):
        """Start bwrap (or bash); blocking, so it runs in a worker thread."""
        slot = self.slot
        agent = slot.agent
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        pass_fds = ()
        info_r = info_w = None
        bash = ["bash", "--noprofile", "--norc"]
        try:
            if slot.root is not None:
                slot.root.ensure()
                info_r, info_w = os.pipe()
                pass_fds = (info_w,)
                argv = isolation.bwrap_root_argv(
                    agent.bwrap, slot.root.merged, slot.ctl_host, agent.network,
                    "slot-%d" % slot.index, info_w, slot.start_dir, agent.tmpfs_mb) + bash
                cwd = "/"
            elif agent.isolation == "bwrap":
                info_r, info_w = os.pipe()
                pass_fds = (info_w,)
                argv = isolation.bwrap_argv(
                    agent.bwrap, slot.ws_host, slot.ws_path, slot.ctl_host, agent.network,
                    agent.hide, "slot-%d" % slot.index, info_w, agent.tmpfs_mb) + bash
                cwd = "/"
            else:
                argv = bash
                cwd = slot.ws_host
            preexec = isolation.make_preexec(
                agent.cgroups.slot_procs_files(slot.index) if agent.cgroups else [],
                agent.rlimits + slot.rlimits, slot.uid, slot.gid)
            proc = subprocess.Popen(
                argv, stdin=in_r, stdout=out_w, stderr=out_w, env=slot.env, cwd=cwd,
                pass_fds=pass_fds, preexec_fn=preexec, close_fds=True,
                start_new_session=(agent.isolation != "bwrap"))
        except BaseException:
            for fd in (in_w, out_r, info_r):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
            if info_w is not None:
                os.close(info_w)
        return proc, in_w, out_r, info_r

    def _attach(self, proc, in_w, out_r, info_r):
        """Take over a started shell: read its output, write its init lines and the ready marker."""
        self.proc = proc
        self.stdin_fd = in_w
        self.out_fd = out_r
        self.info_fd = info_r
        if info_r is not None:
            os.set_blocking(info_r, False)
        os.set_blocking(out_r, False)
        self.init_pid = None
        self.ns_link = None
        self.bash_pid = None
        self.is_ready = False
        self.exit_status = None
        self.used = False
        self.eof = self.loop.create_future()
        self.loop.add_reader(out_r, self._on_output)
        ctl = self.slot.ctl_path
        runner = RUNNER.replace("@CMD@", ctl + "/cmd")
        self.runner = self.slot.write_ctl("r", runner.replace("@IN@", "/dev/null").encode())
        self.stdin_runner = self.slot.write_ctl("s", runner.replace("@IN@", ctl + "/stdin").encode())
        nonce = os.urandom(4).hex()
        self.ready_collector = OutputCollector(nonce.encode(), 4096, self.loop)
        runners = "|".join(shell_quote(p) for p in (self.runner, self.stdin_runner))
        start = TRAP.replace("@RUNNERS@", runners.replace("'", "'\\''")) + INIT_LINES  # in '...'
        if self.slot.replay:  # a snapshot's shell state (agent/snapshots.py)
            start += ". %s 2>/dev/null\n" % shell_quote(self.slot.replay)
        if self.resume_dir:
            start += "cd %s 2>/dev/null\n" % shell_quote(self.resume_dir)
            self.resume_dir = None
        start += "\\builtin printf '\\036%%s 0\\036\\n' %s\n" % nonce
        try:
            self._write(start.encode())
        except OSError:
            pass  # it died at once: its output and exit status say why
        if self.kill_on_start or self.slot.agent.closing:
            self.kill()

    async def _wait_ready(self):
        collector = self.ready_collector
        expired = []

        def expire():
            expired.append(True)
            self.kill()

        timer = self.loop.call_later(READY_TIMEOUT_S, expire)
        try:
            ended = await collector.done
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
            why = "it was not ready within %gs (the machine is overloaded?)" % READY_TIMEOUT_S
        elif self.slot.agent.closing:
            why = "the sandbox was stopped (the backend is shutting down)"
        else:
            why = "it exited with status %s" % (status,)
        return protocol_result("the slot's shell did not start: %s" % why,
                               status if isinstance(status, int) and status > 0 else 1, text)

    def _find_bash(self):
        """Host pid of bash: the bwrap init's only child (or the process itself without bwrap)."""
        if self.slot.agent.isolation != "bwrap":
            return self.proc.pid
        init = self._init()
        if not init:
            return None
        try:
            with open("/proc/%d/task/%d/children" % (init, init)) as fh:
                kids = fh.read().split()
        except OSError:
            return None
        return int(kids[0]) if len(kids) == 1 else None

    def usage(self):
        """``(wants_cpu, cpu_seconds)`` of the shell and what runs in it: whether a process
        is runnable (R) or in disk wait (D), and the CPU time used since the shell started
        (by processes still running and by those that ended)."""
        if not self.ready or self.bash_pid is None:
            return False, 0.0
        return tree_usage(self.bash_pid)

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
            ready.finish(None)  # EOF before the marker: handled below, then by _wait_ready
        if data:
            if collector is not None:
                collector.feed(data)
                if collector.done.done() and not self.interrupting:
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

    def _reap(self, block):
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=1.0 if block else 0)
        except subprocess.TimeoutExpired:
            return None

    def close_fds(self):
        for name in ("stdin_fd", "out_fd", "info_fd"):
            fd = getattr(self, name)
            if fd is not None:
                if name == "out_fd":
                    try:
                        self.loop.remove_reader(fd)
                    except (ValueError, OSError):
                        pass
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, None)

    # -- processes ---------------------------------------------------------
    def _init(self):
        if self.init_pid is None and self.info_fd is not None:
            self.init_pid = isolation.read_child_pid(self.info_fd)
            if self.init_pid:
                try:
                    self.ns_link = os.readlink("/proc/%d/ns/pid" % self.init_pid)
                except OSError:
                    self.ns_link = None
        return self.init_pid

    def shell_pid(self):
        """Host pid of bash itself."""
        if self.bash_pid is not None and self.alive:
            return self.bash_pid
        if self.slot.agent.isolation != "bwrap":
            return self.proc.pid if self.proc else None
        self._init()
        if self.ns_link is None:
            return None
        for pid, nspid, _, _ in isolation.ns_processes(ns_link=self.ns_link):
            if nspid == 2:
                return pid
        return None

    def command_processes(self):
        """Host pids of what the running command started: processes of the slot that
        began after it did, except bash, init and background jobs' sessions."""
        keep_sids = set(self.slot.background_sids)
        since = self.cmd_started
        cgroups = self.slot.agent.cgroups
        if self.slot.agent.isolation == "bwrap":
            self._init()
            if self.ns_link is None:
                return []
            if cgroups:  # the slot's cgroup holds exactly its processes: no scan of all /proc
                procs = slot_level(cgroups.slot_pids(self.slot.index))
            else:
                procs = isolation.ns_processes(ns_link=self.ns_link)
            return [pid for pid, nspid, nssid, start in procs
                    if nspid not in (1, 2) and nssid not in keep_sids
                    and isolation.started_after(pid, start, since)]
        if self.proc is None:
            return []
        procs = isolation.ns_processes(session=self.proc.pid)
        return [pid for pid, _, _, start in procs
                if pid != self.proc.pid and isolation.started_after(pid, start, since)]

    def slot_processes(self):
        """Every process of the slot except bash and init (for a hard reset without namespaces)."""
        if self.proc is None:
            return []
        return [pid for pid, _, _, _ in isolation.ns_processes(session=self.proc.pid)
                if pid != self.proc.pid]

    def cwd(self):
        pid = self.shell_pid()
        if pid is None:
            return None
        try:
            real = os.readlink("/proc/%d/cwd" % pid)
        except OSError:
            return None
        slot = self.slot
        if slot.agent.isolation == "bwrap":
            return real  # already in the slot's view
        return real

    def kill(self):
        """Kill the shell and every process of the slot (a hard reset).

        With namespaces, killing the slot's init ends every process in its PID
        namespace; the outer bwrap then reaps it and exits (killing both at once
        would leave the init as a zombie for PID 1 to reap).
        """
        slot = self.slot
        if self.proc is None:
            if self.starting is not None:
                self.kill_on_start = True  # it waits for its turn, or Popen runs in its thread
            return
        init = self._init()
        if init is None and self.info_fd is not None:
            # Just spawned: bwrap writes the init's pid within milliseconds.
            select.select([self.info_fd], [], [], 0.2)
            init = self._init()
        if init:
            isolation._kill(init, signal.SIGKILL)
        else:
            self._kill_hard()
        if slot.agent.isolation != "bwrap":
            for pid in self.slot_processes():
                isolation._kill(pid, signal.SIGKILL)
            for sid in slot.background_sids:
                for pid, _, _, _ in isolation.ns_processes(session=sid):
                    isolation._kill(pid, signal.SIGKILL)

    def _kill_hard(self):
        """Kill the outer bwrap, its children and the slot's cgroup (when the init is unknown
        or does not go away)."""
        outer = self.proc.pid
        isolation._kill(outer, signal.SIGKILL)
        for pid in isolation.children_of(outer):
            isolation._kill(pid, signal.SIGKILL)
        if self.slot.agent.cgroups:
            self.slot.agent.cgroups.kill_slot(self.slot.index)

    async def stop(self):
        """Kill everything and wait (bounded) until the shell is reaped."""
        starting = self.starting
        if starting is not None and starting is not asyncio.current_task():
            self.kill()  # ends a start in progress (at once, or as soon as Popen returns)
            try:
                await asyncio.wait_for(asyncio.shield(starting), READY_TIMEOUT_S)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        if self.proc is None:
            return
        self.is_ready = False
        self.kill()
        if self.eof is not None and not self.eof.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.eof), 2.0)
            except asyncio.TimeoutError:
                self._kill_hard()
                try:
                    await asyncio.wait_for(asyncio.shield(self.eof), 3.0)
                except asyncio.TimeoutError:
                    pass
        self._reap(block=True)
        if self.slot.agent.cgroups:
            self.slot.agent.cgroups.kill_slot(self.slot.index)  # anything that escaped
        self.close_fds()
        self.proc = None

    # -- running commands --------------------------------------------------
    def start(self, command_file, stdin_path, env, timeout, limit, on_done, one_line=False):
        """Start one command (already written to ``command_file``; ``one_line``: it is a
        single line, so bash's messages about it need no line number).

        ``on_done(result)`` is called once with a ``call`` result dict: from the
        output reader when the end marker arrives (no task or future on this path),
        or after the timeout/cancel procedure has killed what the command started.
        """
        self.started_at = time.monotonic()  # the timeout clock starts here, in a ready shell
        self.used = True  # from now on a reset must replace this shell
        nonce = os.urandom(4).hex()  # only this slot's own output could forge it
        self.cmd_started = isolation.process_clock()
        self.pids_events = self.slot.pids_events()
        collector = OutputCollector(nonce.encode(), limit, self.loop)
        collector.source = command_file.encode()
        collector.one_line = one_line
        self.collector = collector
        self.on_done = on_done
        self.timeout = timeout
        self.timed_out = self.cancelled = self.interrupting = self.restarted = False
        self.stop_reason = None
        if env:
            prefix = "".join("%s=%s " % (k, shell_quote(v)) for k, v in env.items())
            line = ("__hmt_n=%s; { %s. %s; } <%s; \\builtin printf '\\036%%s %%d\\036\\n' "
                    "\"$__hmt_n\" \"$?\"\n" % (nonce, prefix, command_file, shell_quote(stdin_path)))
        else:
            # Short form: bash reads its input one byte at a time, so keep it short.
            runner = self.runner if stdin_path == "/dev/null" else self.stdin_runner
            line = "__hmt_n=%s;. %s\n" % (nonce, runner)
        try:
            if not self.alive:
                raise OSError("the shell is gone")
            self._write(line.encode())
        except OSError:
            collector.finish(self.exit_status)  # reported as the shell having exited
        self.timer = self.loop.call_later(timeout, self._on_timeout)
        if collector.done.done():
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
        if self.collector is not None and not self.collector.done.done():
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
        text, truncated = collector.text()
        ended = collector.done.result() if collector.done.done() else False
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
        if self.slot.pids_events() > self.pids_events:
            # fork() failed with EAGAIN at the slot's pids limit at least once.
            data["limits_hit"] = ["pids"]
            note = "the slot's process limit (pids_limit) was reached: fork failed"
            if error is not None:
                error += " (%s)" % note
            elif rc not in (0, None):
                error = "exit code %s; %s" % (rc, note)
        on_done, self.on_done = self.on_done, None
        on_done({
            "output": text, "error": error, "returncode": rc, "timed_out": self.timed_out,
            "truncated": truncated, "duration_s": time.monotonic() - self.started_at, "data": data,
        })

    async def interrupt(self, collector):
        """Stop the running command: USR1 to bash, TERM then KILL its processes."""
        shell = self.shell_pid()
        if shell:
            isolation._kill(shell, signal.SIGUSR1)
        deadline = time.monotonic() + SHELL_GRACE_S
        sig = signal.SIGTERM
        term_until = time.monotonic() + TERM_GRACE_S
        while not collector.done.done() and time.monotonic() < deadline:
            for pid in self.command_processes():
                isolation._kill(pid, sig)
            if time.monotonic() > term_until:
                sig = signal.SIGKILL
            try:
                await asyncio.wait_for(asyncio.shield(collector.done), 0.05)
            except asyncio.TimeoutError:
                pass
        if not collector.done.done():
            # bash itself is stuck (or ignores the trap): restart it where it was.
            self.restarted = True
            self.resume_dir = self.cwd()
            self.kill()
            collector.finish(124)
            await self.stop()
        else:
            for pid in self.command_processes():
                isolation._kill(pid, signal.SIGKILL)
            await self._flush_job_notices(collector)

    async def _flush_job_notices(self, collector):
        """Collect bash's notices about the jobs just killed (``... Killed  sleep 100``)
        into this command's output: bash prints them after the command line it runs
        when it reaped them, which would otherwise be the next command's."""
        for _ in range(50):  # at most about 0.5 s for bash (or the slot's init) to reap them
            if not self.command_processes():
                break
            await asyncio.sleep(0.01)
        if not self.alive:
            return
        nonce = os.urandom(4).hex()
        flush = OutputCollector(nonce.encode(), collector.limit, self.loop)
        self.collector = flush  # fed by _on_output; completes nothing while interrupting
        try:
            self._write((":\n\\builtin printf '\\036%%s 0\\036\\n' %s\n" % nonce).encode())
            await asyncio.wait_for(asyncio.shield(flush.done), SHELL_GRACE_S)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            self.collector = collector
        collector.append(bytes(flush.head) + bytes(flush.tail))


def protocol_result(error, returncode, output=""):
    """A failed ``call`` result (nothing of the command ran)."""
    return protocol.call_result(output=output, error=error, returncode=returncode)


def shell_quote(value):
    """Single-quote a string for bash."""
    return "'" + str(value).replace("'", "'\"'\"'") + "'"
