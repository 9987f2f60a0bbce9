"""The processes of a slot's shell: finding them, stopping a command, killing the shell.

Stdlib-only, Python 3.8. Mixed into :class:`.shell.Shell`.

Timeouts: the shell traps SIGUSR1 with ``return 124`` (which ends the sourced
command even inside a shell loop; never the loop that reads commands, where it has
nothing to return from, so a signal that comes just as the command ends cannot skip
the end marker); the agent sends it and kills every process of the command (found in
the slot's cgroup, else by a scan of /proc) except the shell, its init and background
jobs (TERM, 0.5 s grace, KILL). If the shell itself does not come back within 5 s it is
killed and the next command gets a fresh shell in the directory the old one was in.
"""

import asyncio
import os
import signal
import subprocess
import time

from ..limits import isolation
from . import owned
from .output import OutputCollector
from .procs import slot_level, tree_usage

TERM_GRACE_S = 0.5
SHELL_GRACE_S = 5.0  # generous: a starved but healthy shell must not be replaced
#: Seconds a shell may take to start once it has its turn among the starting shells
#: (the slot's root, ``Popen`` of bwrap, bash's init lines); past them the call that
#: waits fails with an error naming the slot and the stuck step, and what was started is
#: killed. The init config's ``shell_start_timeout`` (seconds) overrides it: tests set it
#: through the host's ``HERMES_MODAL_TOOL_SHELL_START_TIMEOUT_S`` (see ``sandbox.py``).
READY_TIMEOUT_S = 60.0
#: Seconds :meth:`ShellProcesses.stop` waits for a killed shell's outer process to exit
#: (after its output pipe closed) before going on without its exit status.
REAP_WAIT_S = 1.0
#: Seconds a stop waits for a just-spawned bwrap to tell its init's pid (``--info-fd``).
INIT_WAIT_S = 0.2
#: Bytes of a command's header on the shell's command pipe: its nonce (8), its mode (1)
#: and the length of its text, in hex (8) (see ``shellstart.LOOP``).
HEADER = 17
#: Bytes the shell reads for each command in one ``read``: the header and, when it fits,
#: the text, padded with spaces; a longer text follows the frame (a second ``read``).
#: Most commands fit, so most take one read; a longer frame costs bash more per call
#: (``read -N`` handles each character).
FRAME = 64
#: The mode of a text in the frame -> the mode of one that follows it (stdin /dev/null or
#: the ``stdin`` control file).
_LONG = {"p": "l", "q": "m"}
#: The mode of an empty command: the shell only prints the end marker.
NOOP = ":"


def new_nonce():
    """8 random hex characters (a command's end-marker nonce), from a buffer refilled
    every 512 nonces (one ``getrandom`` for many commands)."""
    buf = _NONCES
    if not buf:
        raw = os.urandom(2048).hex()
        buf.extend(raw[i:i + 8] for i in range(0, len(raw), 8))
    return buf.pop()


_NONCES = []


def frame(nonce, mode, text=b""):
    """What the shell reads for one command (bytes): its header, and ``text`` (ASCII
    bytes; modes ``p`` and ``q`` only) padded to :data:`FRAME` bytes when it fits, else
    after the frame (the mode becomes ``l`` or ``m``)."""
    follows = len(text) > FRAME - HEADER
    head = ("%s%s%08x" % (nonce, _LONG[mode] if follows else mode, len(text))).encode()
    return head.ljust(FRAME) + text if follows else (head + text).ljust(FRAME)


def kill_spawned(outer):
    """Kill a shell's outer process (bwrap, or bash without it) and its children: stopped
    first, so that it cannot fork one meanwhile (see ``ShellProcesses._kill_hard``)."""
    isolation._kill(outer, signal.SIGSTOP)
    _wait_stopped(outer)
    for pid in isolation.children_of(outer):
        isolation._kill(pid, signal.SIGKILL)
    isolation._kill(outer, signal.SIGKILL)


def _wait_stopped(pid, limit_s=1.0):
    """Wait (a few ms; at most ``limit_s``) until ``pid`` is stopped, a zombie or gone."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if isolation.process_state(pid) in (None, "T", "t", "Z", "X"):
            return
        time.sleep(0.001)


def start_timeout(agent):
    """The bound on a shell's start for ``agent`` (seconds; see :data:`READY_TIMEOUT_S`)."""
    value = (agent.config or {}).get("shell_start_timeout")
    return float(value) if value else READY_TIMEOUT_S


class ShellProcesses:
    """Mixed into :class:`.shell.Shell`: needs ``slot``, ``loop``, ``proc``, ``collector``,
    ``info_fd``, ``init_pid``, ``ns_link``, ``bash_pid``, ``eof`` and ``_write``."""

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

    def _reap(self, block):
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=1.0 if block else 0)
        except subprocess.TimeoutExpired:
            return None

    async def _reaped(self, proc, limit):
        """Reap ``proc``, the shell's outer process, waiting for it (at most ``limit``
        seconds) without blocking the loop that serves the other slots: once its output
        pipe is at its end it exits within milliseconds, but on a busy machine a blocking
        wait would hold every slot up meanwhile."""
        end = self.loop.time() + limit
        delay = 0.0005
        while (self.proc is proc and self._reap(block=False) is None
               and self.loop.time() < end):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def discard_late_spawn(self, fut):
        """Done-callback of a ``Popen`` the start gave up on: kill and reap what it started
        (never attached: the slot may have a new shell by now)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        proc, in_w, out_r, info_r, err_r, _ = fut.result()
        kill_spawned(proc.pid)
        for fd in (in_w, out_r, info_r, err_r):
            if fd is not None:
                os.close(fd)
        self.loop.run_in_executor(self.slot.agent.executor("files"), proc.wait)

    def free_stuck_spawn(self):
        """Kill the child of a ``Popen`` stuck between fork and exec (in ``preexec_fn``, or
        joining a cgroup), so that its thread returns (and :meth:`discard_late_spawn` stops
        what it started). Only children of the spawn thread that still run the agent's own
        executable are killed: they have not exec'd bwrap or bash yet, so no other slot's
        shell is among them."""
        tid = self.spawn_tid
        if tid is None:
            return
        try:
            with open("/proc/self/task/%d/children" % tid) as fh:
                kids = [int(p) for p in fh.read().split()]
            own = os.readlink("/proc/self/exe")
        except OSError:
            return
        for pid in kids:
            try:
                if os.readlink("/proc/%d/exe" % pid) == own:
                    isolation._kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def close_fds(self):
        self._forget_told_watch()  # before its descriptor is closed
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
        """Every process of the slot except bash and init (for a hard reset without namespaces):
        its shell's session, and of it only the slot's own (a shell reaped already may have
        left its number to a neighbour's new one: :func:`.owned.session_members`)."""
        if self.proc is None:
            return []
        return [pid for pid in owned.session_members(self.slot, self.proc.pid) if pid != self.proc.pid]

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
            # Just spawned: bwrap tells the init's pid within milliseconds (stop() waits for
            # it first). Kill it then, from the loop: never wait here for it.
            self._kill_when_told()
        elif init:
            isolation._kill(init, signal.SIGKILL)
        else:
            self._kill_hard()
        if slot.agent.isolation != "bwrap":
            for pid in self.slot_processes():
                isolation._kill(pid, signal.SIGKILL)
            for sid in slot.background_sids:  # found in /proc; and only the slot's own now
                for pid in owned.session_members(slot, sid):
                    isolation._kill(pid, signal.SIGKILL)

    def _kill_when_told(self):
        """Kill the slot's init as soon as bwrap tells its pid (``--info-fd``, watched by
        the loop), or everything the hard way after :data:`INIT_WAIT_S`; returns at once.
        A shell ended or replaced meanwhile is left alone."""
        if self.told_watch is not None:
            return  # a kill is already waiting for the pid
        fd, proc = self.info_fd, self.proc

        def finish():
            if self.told_watch is None or self.told_watch[0] != fd:
                return
            self._forget_told_watch()
            if self.proc is not proc or self.info_fd != fd:
                return
            init = self._init()
            if init:
                isolation._kill(init, signal.SIGKILL)
            else:
                self._kill_hard()

        self.loop.add_reader(fd, finish)
        self.told_watch = (fd, self.loop.call_later(INIT_WAIT_S, finish))

    def _forget_told_watch(self):
        if self.told_watch is not None:
            fd, timer = self.told_watch
            self.told_watch = None
            timer.cancel()
            try:
                self.loop.remove_reader(fd)
            except (ValueError, OSError):
                pass

    def _kill_hard(self):
        """Kill the outer bwrap, its children and the slot's cgroup (when the init is unknown
        or does not go away).

        bwrap is stopped first: killed while it sets its child up (before ``--info-fd``
        has the child's pid), its child would wait forever for it to say "go" (an eventfd
        bwrap writes once the uid maps are set), outside the slot's cgroup where there is
        none (a Modal container), holding the shell's output pipe, so the shell would never
        be seen to end. A stopped bwrap forks no more: its children are all found."""
        kill_spawned(self.proc.pid)
        if self.slot.agent.cgroups:
            self.slot.agent.cgroups.kill_slot(self.slot.index)

    async def stop(self, on_kill=None):
        """Kill everything and wait (bounded) until the shell is reaped; ``on_kill()`` runs
        right after SIGKILL is sent to every process of the slot (not when there was no
        shell to kill): from then on none of them runs the tenant's code (a process with
        SIGKILL pending never returns to user space), though they take a moment to go.

        The kill of the init alone would end them too, but only as the init exits, after
        the kernel has torn the slot's mounts down (about 2 ms back to back on 2 cores);
        with cgroups each process of the slot is sent SIGKILL at once as well."""
        starting = self.starting
        if starting is not None and starting is not asyncio.current_task():
            self.kill()  # ends a start in progress (at once, or as soon as Popen returns)
            try:
                await asyncio.wait_for(asyncio.shield(starting), start_timeout(self.slot.agent) + 5.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        if self.proc is None:
            return
        self.is_ready = False
        await self._init_told(INIT_WAIT_S)
        self.kill()
        if on_kill is not None:
            if self.slot.agent.cgroups:  # bwrap is spared: it ends with its init and reaps it
                self.slot.agent.cgroups.kill_slot(self.slot.index, spare=self.proc.pid, one=True)
            on_kill()
        if self.eof is not None and not self.eof.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.eof), 2.0)
            except asyncio.TimeoutError:
                self._kill_hard()
                try:
                    await asyncio.wait_for(asyncio.shield(self.eof), 3.0)
                except asyncio.TimeoutError:
                    pass
        proc = self.proc
        if proc is None:
            return  # another stop() ended it meanwhile
        await self._reaped(proc, REAP_WAIT_S)
        if self.proc is not proc:
            return  # ... or while this one waited
        if self.slot.agent.cgroups:
            self.slot.agent.cgroups.kill_slot(self.slot.index)  # anything that escaped
        self.close_fds()
        self.proc = None

    async def _init_told(self, limit):
        """Wait (at most ``limit`` seconds) until bwrap has told its init's pid, watching
        ``--info-fd`` from the loop: a shell stopped just after its spawn is then killed
        through its init at once (:meth:`kill` would only schedule that)."""
        if self.info_fd is None or self._init():
            return
        told = self.loop.create_future()
        fd = self.info_fd
        self.loop.add_reader(fd, lambda: told.done() or told.set_result(None))
        try:
            await asyncio.wait_for(told, limit)
        except asyncio.TimeoutError:
            pass
        finally:
            self.loop.remove_reader(fd)

    async def interrupt(self, collector):
        """Stop the running command: USR1 to bash, TERM then KILL its processes."""
        shell = self.shell_pid()
        if shell:
            isolation._kill(shell, signal.SIGUSR1)
        deadline = time.monotonic() + SHELL_GRACE_S
        sig = signal.SIGTERM
        term_until = time.monotonic() + TERM_GRACE_S
        done = collector.wait()
        while not done.done() and time.monotonic() < deadline:
            for pid in self.command_processes():
                isolation._kill(pid, sig)
            if time.monotonic() > term_until:
                sig = signal.SIGKILL
            try:
                await asyncio.wait_for(asyncio.shield(done), 0.05)
            except asyncio.TimeoutError:
                pass
        if not done.done():
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
        nonce = new_nonce()
        flush = OutputCollector(nonce.encode(), collector.limit, self.loop)
        self.collector = flush  # fed by _on_output; completes nothing while interrupting
        try:
            self._write(frame(nonce, NOOP))  # an empty command: just its end marker
            await asyncio.wait_for(asyncio.shield(flush.wait()), SHELL_GRACE_S)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            self.collector = collector
        collector.absorb(flush)
