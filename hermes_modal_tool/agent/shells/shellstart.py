"""Starting a slot's shell (mixed into :class:`.shell.Shell`).

Stdlib-only, Python 3.8.

Starting: a slot with a layered root has its ``bwrap`` started from a new thread of the
agent that takes on the slot's settings first (:mod:`.threadstart`: no process is
copied), or, where that cannot work, cloned by the agent's spawner (:mod:`.spawner`: a
small process in a mount namespace without the other slots' roots, which joins cgroups
and drops the uid between clone and exec); other slots, and all of them when the
spawner is gone, start with ``Popen`` (the same steps in ``preexec_fn``).
Either blocks for milliseconds, so it runs in a worker thread, never on the agent's
event loop; the slot's root layer is built there too. The shell is *ready* when
it has printed a marker after its init lines; a command's timeout clock starts when the
command is written to a ready shell, so the time a shell takes to start never counts
against a command. A start is bounded (:func:`.shellprocs.start_timeout`, 60 s, from its
turn among the starting shells): past it the call fails with an error naming the slot
and the step that was stuck, and what it started is killed, so a call never waits for a
shell forever. While the root is built and bwrap starts, the start holds the slot's
``layer_lock``, which forks, snapshots and resets hold while they change the slot's
layers.
"""

import asyncio
import fcntl
import os
import subprocess
import threading

from ... import protocol
from ..fs import mounts, rootplan, volumes
from ..limits import isolation
from . import threadstart
from .output import OutputCollector
from .shellprocs import FRAME, new_nonce, start_timeout
from .spawner import FIRST_PASS_FD

# On SIGUSR1 (a timeout) return from what runs: the sourced command, or a function it
# runs. In the loop itself there is nothing to return from (the error is silenced), so a
# signal that comes just after the command ended cannot skip the end marker.
TRAP = "trap 'return 124 2>/dev/null' USR1\n"
INIT_LINES = "set +o history 2>/dev/null; shopt -s expand_aliases\n"
#: The command runner, written to the control file ``cmd`` when the shell starts and
#: sourced from there (``@CTL@``: the control directory as the shell sees it), on its
#: first line: so bash names ``@CTL@/cmd``, with the command's own line numbers, in its
#: messages about a command it ``eval``\ s, as about one it sources. It is sourced
#: before the ready marker: the first command may rewrite ``cmd`` once it is seen.
RUNNER = ("__hmt_f() { case ${__hmt_h:8:1} in "
          "p) \\builtin eval \"${__hmt_h:17:$((16#${__hmt_h:9:8}))}\";; "
          "q) \\builtin eval \"${__hmt_h:17:$((16#${__hmt_h:9:8}))}\" <@CTL@/stdin;; "
          "l) \\builtin eval \"$__hmt_c\";; m) \\builtin eval \"$__hmt_c\" <@CTL@/stdin;; "
          "n) . @CTL@/cmd;; s) . @CTL@/cmd <@CTL@/stdin;; e) . @CTL@/e;; *) :;; esac; }\n")
LOAD_RUNNER = ". @CTL@/cmd\nreadonly -f __hmt_f\n"
#: The command loop. It runs with ``/dev/null`` as its stdin, so a command reads nothing
#: of the protocol and needs no redirection of its own: bash saves the pipe it came on to
#: fd ``CMD_FD`` = 10 (the first free from 10; the loop closes 10 first in case the shell
#: inherited it, with ``command exec``, as ``builtin exec`` would undo its own
#: redirection), close-on-exec, so no program a command runs inherits it. A command comes
#: on that pipe as a frame of ``FRAME`` bytes (header: nonce, mode, length in hex; in
#: modes ``p`` and ``q`` the text, padded), in modes ``l`` and ``m`` followed by its text
#: (:func:`.shellprocs.frame`): ASCII only, so that its length in bytes is its length in
#: characters in whatever locale the shell has (``read -N`` counts characters; switching
#: locales for it would make bash warn where the locale is not installed). ``read``
#: interrupted by a trapped signal returns > 128 having taken nothing (the agent writes a
#: frame and its text at once): read again; 1 is the end of the pipe.
CMD_FD = 10
LOOP = ("command exec %d<&-; { while :; do \\builtin read -r -N %d -u %d __hmt_h || "
        "case $? in 1) \\builtin exit;; *) \\builtin continue;; esac; case ${__hmt_h:8:1} in [lm]) "
        "until \\builtin read -r -N $((16#${__hmt_h:9:8})) -u %d __hmt_c; do "
        "case $? in 1) \\builtin exit;; esac; done;; esac; __hmt_f; "
        "\\builtin printf '\\036%%s %%d\\036\\n' \"${__hmt_h:0:8}\" \"$?\"; done; } </dev/null\n"
        % (CMD_FD, FRAME, CMD_FD, CMD_FD))
#: Shells of a sandbox that may start at once (each takes ~10 ms of CPU, more on a busy
#: machine); ``Popen`` runs in as many threads (it blocks; the event loop must not).
SPAWN_THREADS = 4
#: Largest command (bytes, its frame included) sent down the pipe rather than through the
#: ``cmd`` file; at most the pipe's own size, so that the write, into the pipe the shell
#: has emptied, never waits.
INLINE_MAX = 32768
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


class ShellStart:
    """Mixed into :class:`.shell.Shell`: its start (``ensure_ready`` and the steps below)."""

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
        agent.shells_starting += 1
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
            agent.shells_starting -= 1
            if self.starting is asyncio.current_task():
                self.starting = None

    async def _start_bounded(self, limit):
        """Spawn the shell and wait until it is ready, all within ``limit`` seconds (its turn
        among the starting shells does not count); past it the call fails, never hangs.

        One timer bounds both steps: while the shell is being spawned it cancels this
        task (the spawn is given up: what it still starts is stopped when its thread
        returns), once the shell is attached it kills it (:meth:`_wait_ready` says why)."""
        slot = self.slot
        self.start_phase = "waiting for a fork, snapshot or reset of the slot to change its layers"
        self.spawn_tid = None  # set by _popen in its thread: only this start's children are killed
        task = asyncio.current_task()
        expired = []

        def expire():
            expired.append(True)
            if self.ready_collector is None:  # not attached yet: still spawning
                task.cancel()
            else:
                self.kill()

        timer = self.loop.call_later(limit, expire)
        try:
            try:
                spawned = await self._spawn()
            except asyncio.CancelledError:
                if not expired or self.ready_collector is not None:
                    raise
                uncancel = getattr(task, "uncancel", None)  # Python 3.11+: not cancelled after all
                if uncancel is not None:
                    uncancel()
                self.free_stuck_spawn()
                return protocol_result(
                    "slot %d: its shell did not start within %gs (it was stuck %s); the next "
                    "command tries a new one" % (slot.index, limit, self.start_phase), 1)
            except Exception as exc:  # noqa: BLE001 - reported as the call's result
                return protocol_result("the slot's shell could not be started: %s" % (exc,), 1)
            if spawned is None:
                return protocol_result("the slot's shell was stopped before it started", 1)
            self._attach(*spawned)
            return await self._wait_ready(expired, limit)
        finally:
            timer.cancel()

    async def _spawn(self):
        """``_popen`` in a "spawn" thread while the slot's layers stay put (a fork or
        snapshot holds ``slot.layer_lock`` while it changes them); None when the start was
        called off meanwhile."""
        slot = self.slot
        async with slot.layer_lock:
            if self.kill_on_start or slot.agent.closing:
                return None
            self.start_phase = "waiting for a free spawn thread"
            fut = self.loop.run_in_executor(slot.agent.executor("spawn"), slot.in_netns, self._popen)
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
            # What the child does before exec (isolation.slot_entry_fn), either way.
            entry = (agent.cgroups.slot_procs_files(slot.index) if agent.cgroups else [],
                     agent.rlimits + slot.rlimits, slot.uid, slot.gid)
            if slot.root is not None:
                self.start_phase = "building the slot's root filesystem"
                slot.ensure_root()  # in this thread: mounts and a fork, once per layer
                layer = slot.root.active
                info_r, info_w = os.pipe()
                pass_fds = (info_w,)
                argv = isolation.bwrap_root_argv(
                    agent.bwrap, slot.root.merged, slot.ctl_host, agent.network,
                    "slot-%d" % slot.index, info_w, slot.start_dir, agent.tmpfs_mb,
                    agent.contain_root, agent.gpu.argv if agent.gpu else ()) + binds \
                    + volumes.argv(agent.volumes) + bash
                cwd = "/"
                proc = self._thread_root(argv, (in_r, out_w, err_w), pass_fds, entry)
                if proc is not None:
                    return proc, in_w, out_r, info_r, err_r, layer
                # Not with network: egress (the spawner's child would start in its namespace).
                if agent.spawner is not None and not agent.spawner.broken and agent.net is None:
                    self.start_phase = "in bwrap's start (the spawner: clone, cgroups, uid drop, exec)"
                    proc = self._spawn_root(argv, (in_r, out_w, err_w), info_w, entry)
                    if proc is not None:
                        return proc, in_w, out_r, info_r, err_r, layer
                    # A spawner killed between its clone and its reply leaves a child that
                    # holds these pipes: Popen's shell gets new ones (the same numbers), so
                    # that child's bash reads nothing of it (it gets EOF and exits).
                    for r, w in ((in_r, in_w), (out_r, out_w), (err_r, err_w), (info_r, info_w)):
                        _renew_pipe(r, w)
            elif agent.isolation == "bwrap":
                info_r, info_w = os.pipe()
                pass_fds = (info_w,)
                argv = isolation.bwrap_argv(
                    agent.bwrap, slot.ws_host, slot.ws_path, slot.ctl_host, agent.network,
                    agent.hide, "slot-%d" % slot.index, info_w, agent.tmpfs_mb,
                    slot.tmpfs.place if slot.tmpfs else None,
                    agent.gpu.workspace_only_argv() if agent.gpu else (),
                    volumes.argv(agent.volumes)) + bash
                cwd = "/"
            else:
                argv = bash
                cwd = slot.ws_host
            preexec = isolation.make_preexec(*entry)
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

    def _thread_root(self, argv, stdio, pass_fds, entry):
        """Start a layered-root slot's bwrap from a new thread of the agent (see
        :mod:`.threadstart`); ``entry`` as for :meth:`_spawn_root`. None where that cannot
        work (rlimits to set, or no cgroup v1, say) or this start failed there: it and every
        later start go through the spawner then."""
        agent = self.slot.agent
        starter = threadstart.for_agent(agent)
        if starter is None or entry[1]:
            return None
        _, _, uid, gid = entry
        self.start_phase = "in bwrap's start (a thread of the agent: cgroups, uid drop, vfork)"
        root = self.slot.root.merged
        tree = None
        try:
            tree = mounts.clone_tree(root)
            return starter.start(
                "hmt-start-%d" % self.slot.index, argv, self.slot.env, stdio, pass_fds,
                agent.cgroups.slot_procs_files(self.slot.index, "tasks"), uid, gid, tree, root,
                on_thread=self._set_spawn_tid)
        except (OSError, RuntimeError) as exc:
            starter.broken = "%s" % (exc,)
            agent.thread_start_note = "through the spawner (a start from a thread failed: %s)" % (exc,)
            return None
        finally:
            if tree is not None:
                os.close(tree)

    def _set_spawn_tid(self, tid):
        self.spawn_tid = tid

    def _spawn_root(self, argv, stdio, info_w, entry):
        """Start a layered-root slot's bwrap through the agent's spawner (see
        :mod:`.spawner`): in a mount namespace holding this slot's root and the sandbox's
        own mounts only; ``entry``: ``(procs_files, rlimits, uid, gid)`` as for
        ``make_preexec``. None when the spawner is gone or this start failed there (a
        kernel without ``CLONE_PARENT`` or ``move_mount``, say): this start and every
        later one use ``Popen``, whose error, if it fails too, is the one reported."""
        spawner = self.slot.agent.spawner
        root = self.slot.root.merged
        argv = list(argv)
        argv[argv.index("--info-fd") + 1] = str(FIRST_PASS_FD)  # where the child has it
        procs_files, rlimits, uid, gid = entry
        setup = {"procs_files": procs_files, "rlimits": [(int(r), int(v)) for r, v in rlimits],
                 "uid": uid, "gid": gid}
        tree = None
        try:
            tree = mounts.clone_tree(root)
            return spawner.spawn(argv, self.slot.env, "/", stdio, (info_w,), setup, (tree, root))
        except OSError as exc:
            if not spawner.broken:
                spawner.broken = "a start failed there (%s); shells start with Popen" % (exc,)
            return None
        finally:
            if tree is not None:
                os.close(tree)

    def _attach(self, proc, in_w, out_r, info_r, err_r, layer):
        """Take over a started shell: read its output, write its init lines and the ready marker."""
        self.proc = proc
        self.layer = layer
        self.stdin_fd = in_w
        try:  # a pipe may be one page only (pipe-user-pages-soft)
            self.pipe_room = min(INLINE_MAX, fcntl.fcntl(in_w, _F_GETPIPE_SZ))
        except OSError:
            self.pipe_room = 0
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
        ctl = shell_quote(self.slot.ctl_path)
        self.slot.write_ctl("cmd", RUNNER.replace("@CTL@", ctl).encode())
        start = TRAP + INIT_LINES + LOAD_RUNNER.replace("@CTL@", ctl)
        if self.slot.replay:  # a snapshot's shell state (agent/state/snapshots.py)
            start += ". %s 2>/dev/null\n" % shell_quote(self.slot.replay)
        if self.resume_dir:
            start += "cd %s 2>/dev/null\n" % shell_quote(self.resume_dir)
            self.resume_dir = None
        start += "\\builtin printf '\\036%%s 0\\036\\n' %s\n" % nonce
        start += LOOP
        try:
            self._write(start.encode())
        except OSError:
            pass  # it died at once: its output and exit status say why
        if self.kill_on_start or self.slot.agent.closing:
            self.kill()

    async def _wait_ready(self, expired, limit):
        """Wait for the marker that ends the init lines; ``expired`` is not empty once the
        start's bound (``limit`` seconds, for the message) has passed and the shell was
        killed for it."""
        collector = self.ready_collector
        try:
            ended = await collector.wait()
        finally:
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


def _renew_pipe(r, w):
    """Make descriptors ``r`` and ``w`` the ends of a new pipe (the old one's ends here close)."""
    new_r, new_w = os.pipe()
    try:
        os.dup2(new_r, r, inheritable=False)
        os.dup2(new_w, w, inheritable=False)
    finally:
        os.close(new_r)
        os.close(new_w)


def protocol_result(error, returncode, output=""):
    """A failed ``call`` result (nothing of the command ran)."""
    return protocol.call_result(output=output, error=error, returncode=returncode)


def shell_quote(value):
    """Single-quote a string for bash."""
    return "'" + str(value).replace("'", "'\"'\"'") + "'"
