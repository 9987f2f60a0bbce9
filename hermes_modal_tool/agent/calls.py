"""Calls inside the agent: one at a time per slot, started once admitted and the slot's
shell is ready; bash commands, background jobs and file tools.

Stdlib-only, Python 3.8. Mixed into :class:`.main.Agent`.

A bash call starts (and its timeout clock with it) once its slot is free, its slot's
shell is ready (shells start in worker threads, a few at a time) and the sandbox's
admission lets it in (:mod:`.admission`); the host is told about calls that wait long.
"""

import asyncio
import functools
import heapq
import os
import signal
import time

from .. import protocol
from .files import files, filetools
from .limits import diskwatch, isolation
from .shells import owned, ptyprocs
from .shells.streaming import OutputStream

#: Seconds a call may wait to start (behind its slot's running call, for admission or
#: for its shell) before the host is told it is queued and stops its deadline until the
#: call starts; half the call's timeout when that is shorter. Either is well inside the
#: host's deadline (the timeout plus a grace period), so no deadline passes meanwhile.
NOTICE_S = 5.0
#: Worker threads for file tools and workspace wipes (off the event loop).
FILE_THREADS = 4
STOPPED_BEFORE = "the sandbox was stopped (the backend is shutting down) before the command started"
#: Seconds a call's result may wait for the other calls that came in the same read of
#: stdin (a batch the host flushed at once) so that they go back in one write; the
#: batch's last result goes at once, so a batch's latency is unchanged, and a result
#: waits at most this long behind a slower neighbour. One write per batch instead of
#: one per call saves the agent and the host a wakeup and a pipe write per call.
HOLD_S = 0.002
#: Key of a call message's :class:`Batch` (set by the reader, not the host).
BATCH_KEY = "__batch"
#: Key of a call message that came in a ``calls`` frame (set by the reader).
COMPACT_KEY = "__compact"


class Batch:
    """The calls of one read of stdin whose results have not been sent yet. ``results``
    (calls that came in a ``calls`` frame): ``[id, result]`` of those ready and not sent
    yet, sent together in one ``results`` frame (``Agent.send``); None otherwise."""

    __slots__ = ("left", "results")

    def __init__(self, left, compact=False):
        self.left = left
        self.results = [] if compact else None


class Calls:
    """Mixed into the agent: starting, queueing and finishing calls."""

    def start_call(self, slot, msg):
        """Start one call in an idle slot; its result is sent when it ends."""
        mid = msg.get("id")
        started = time.monotonic()

        def done(result):
            if not result.get("duration_s"):
                result["duration_s"] = time.monotonic() - started
            self.unstarted.pop(id(msg), None)
            self.admission.release(slot)
            self.send({"id": mid, "ok": True, "result": result}, msg.get(BATCH_KEY))
            slot.set_idle()

        try:
            slot.set_busy(mid)
        except Exception as exc:  # noqa: BLE001 - the call must be answered whatever failed
            slot.busy = True
            done(protocol.call_result(
                error="the slot could not be prepared: %s: %s" % (type(exc).__name__, exc),
                returncode=None))
            return
        if slot.index >= self.next_fresh or slot.index in self.spares:
            self.first_use(slot)
        slot.dirty = True  # a reset must drop the writable layer (file tools write it too)
        args = None
        try:
            tool = msg.get("tool")
            args = msg.get("args")
            if args is None:
                args = {}
            timeout = float(msg.get("timeout") or 30.0)
            problem = protocol.check_args(tool, args)
            if problem is not None:  # nothing ran: no exit code
                done(protocol.call_result(error=problem, returncode=None, data={"reason": "bad_request"}))
            elif tool == "bash":
                self.start_bash(slot, msg, args, timeout, done)
            else:
                self.start_file_tool(slot, tool, args, done)
        except Exception as exc:  # noqa: BLE001 - reported as the call's result
            done(_tool_failure(exc, args))

    def start_file_tool(self, slot, tool, args, done):
        """Run a file tool in one of :data:`FILE_THREADS` worker threads, never on the event
        loop that serves every slot (what a slot can make large, a read of 64 MiB, an
        archive of 100,000 files, runs there, bounded by its caps); ``done`` runs on the
        loop. A slot runs one call at a time, so its calls stay in order."""
        def finished(fut):
            if fut.cancelled():
                done(protocol.call_result(error=STOPPED_BEFORE))
            else:
                done(fut.result())

        self.loop.run_in_executor(self.executor("files"), self._file_tool_result,
                                  slot, tool, args).add_done_callback(finished)

    def _file_tool_result(self, slot, tool, args):
        try:
            return self.run_tool(slot, tool, args)
        except Exception as exc:  # noqa: BLE001 - reported as the call's result
            return _tool_failure(exc, args)

    def run_tool(self, slot, tool, args):
        """Run a file tool (blocking: call from the "files" threads, never the loop).

        ``tool`` and ``args`` were checked by :func:`protocol.check_args`.
        """
        slot.prepare_dirs()
        slot.ensure_root()  # in this worker thread: mounts and a fork, once per layer
        if slot.root is not None:
            files.preload()  # imports read the agent's own files: not as the slot
        with slot.fs_creds():
            output, data = filetools.TOOLS[tool](slot.workspace, args, self.limit)
        truncated = False
        if tool == "list_files" or (tool == "read_file" and data.get("encoding") == "text"):
            output, truncated = _cap(output, self.limit)
            truncated = truncated or bool(data.pop("truncated", False))
        elif tool == "read_file":
            truncated = data.get("truncated", False)
        return protocol.call_result(output=output, returncode=0, truncated=truncated, data=data)

    def start_bash(self, slot, msg, args, timeout, done):
        """Start a bash call once admitted; ``args`` were checked by :func:`protocol.check_args`."""
        command = args["command"]
        env = args.get("env") or {}
        stdin = args.get("stdin")
        if args.get("timeout") is not None:
            timeout = args["timeout"]
        background = args.get("background") or False
        raw = args.get("encoding") == "bytes"
        stdin_path = "/dev/null"
        if stdin is not None:
            stdin_path = slot.write_ctl("stdin", stdin.encode("utf-8", "surrogatepass"))
        # The process's helper (a python3 the slot's shell starts) has half the call's
        # timeout to connect, at least ptyprocs.CONNECT_S: under emulation or heavy load
        # a Python start-up can take longer than a fixed wait, never longer than the call.
        connect_s = max(ptyprocs.CONNECT_S, float(timeout) / 2)
        if args.get("pty") is not None:  # a process beside the shell (agent/shells/ptyprocs.py)
            def begin():
                self.own(self._process(slot, command, env, args, done, connect_s))
        elif background:
            def begin():
                self.own(self._background(slot, command, env, done, connect_s))
        else:
            text = command.encode("utf-8", "surrogatepass") + b"\n"
            watched = diskwatch.watched(self, slot)
            if watched:
                done = self._disk_checked(slot, done)
            elif self.layer_disks is not None and slot.root is not None:
                done = self._disk_full_checked(slot, done)  # the kernel's limit (slotdisk.py)
            if getattr(self, "shm_watch", None) is not None:  # no bwrap (agent/limits/shmwatch.py)
                done = self.shm_watch.checked(slot, done)
            live = OutputStream(self, slot.shell, msg.get("id"), raw) if msg.get("stream") else None
            if live is not None:
                done = _closing(live, done)

            def begin():
                slot.shell.start(text, stdin_path, env, float(timeout), self.limit, done,
                                 one_line="\n" not in command.strip("\n"), raw=raw)
                if live is not None and slot.shell.collector is not None:
                    slot.shell.collector.sink = live.sink
                if watched:
                    self.own(self._watch_disk(slot, slot.shell.collector))
        self.launch(slot, msg, begin, done)

    def launch(self, slot, msg, begin, done):
        """Run ``begin()`` (which starts the command and its timeout clock) once the slot's
        shell is ready and the call is admitted: at once when both hold, the usual case;
        else ``slot.pending`` holds the call until then."""
        if self.closing:
            done(protocol.call_result(error=STOPPED_BEFORE))
        elif not slot.shell.ready:
            pending = slot.pending = _Pending(msg, begin, done)
            pending.task = self.own(self._when_shell_ready(slot, pending))
        elif self.admission.try_admit(slot, slot.shell.usage):
            self._begin(msg, begin, done)
        else:
            slot.pending = _Pending(msg, begin, done)
            self.admission.enqueue(slot, slot.shell.usage, functools.partial(self._admitted, slot))

    def _admitted(self, slot):
        pending = slot.pending
        if pending is None:  # cancelled meanwhile
            self.admission.release(slot)
        elif slot.shell.ready:
            slot.pending = None
            self._begin(pending.msg, pending.begin, pending.done)
        else:  # the shell died while the call waited: start a new one first
            self.admission.release(slot)
            slot.pending = None
            self.launch(slot, pending.msg, pending.begin, pending.done)

    async def _when_shell_ready(self, slot, pending):
        try:
            failure = await asyncio.shield(slot.shell.ensure_ready())
        except asyncio.CancelledError:
            if slot.pending is pending:  # the agent is shutting down
                self._finish_pending(slot, STOPPED_BEFORE)
            return
        except Exception as exc:  # noqa: BLE001 - reported as the call's result
            failure = protocol.call_result(error="the slot's shell could not be started: %s" % (exc,),
                                           returncode=1)
        if slot.pending is not pending:
            return  # cancelled or reset while the shell started
        slot.pending = None
        if failure is not None:
            pending.done(failure)
        else:
            self.launch(slot, pending.msg, pending.begin, pending.done)

    def _begin(self, msg, begin, done):
        self.unstarted.pop(id(msg), None)
        if msg.get("_queued"):
            self.send({"id": 0, "event": "started", "target": msg.get("id")})
        try:
            begin()
        except Exception as exc:  # noqa: BLE001 - reported as the call's result
            done(protocol.call_result(error="%s: %s" % (type(exc).__name__, exc), returncode=1))

    def _finish_pending(self, slot, why):
        pending, slot.pending = slot.pending, None
        self.admission.discard(slot)
        if pending.task is not None and pending.task is not asyncio.current_task():
            pending.task.cancel()
        pending.done(protocol.call_result(error=why))

    def stop_current(self, slot, why):
        """Stop the slot's current call: kill its command, or drop it if it has not started."""
        if slot.pending is not None:
            self._finish_pending(slot, why)
        else:
            slot.shell.cancel()

    def watch_unstarted(self, msg):
        """Call ``msg`` did not start at once: have the host told if it waits long."""
        timeout = msg.get("timeout") or 30.0
        args = msg.get("args")
        own = args.get("timeout") if isinstance(args, dict) else None
        if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
            timeout = own
        when = time.monotonic() + min(NOTICE_S, float(timeout) / 2)
        heapq.heappush(self.notices, (when, next(self.notice_seq), id(msg)))
        if self.notice_timer is None or self.notice_timer.when() > when:
            self._schedule_notices()

    def _schedule_notices(self):
        if self.notice_timer is not None:
            self.notice_timer.cancel()
            self.notice_timer = None
        while self.notices and self.notices[0][2] not in self.unstarted:
            heapq.heappop(self.notices)  # started meanwhile
        if self.notices:
            self.notice_timer = self.loop.call_at(self.notices[0][0], self.notice_waiting)

    def notice_waiting(self):
        """Tell the host about each call that has waited long to start (see :data:`NOTICE_S`):
        an event ``queued`` (the host stops its deadline), later ``started`` (the host
        gives it the whole deadline from then on). The call's timeout is not affected."""
        self.notice_timer = None
        now = time.monotonic()
        while self.notices and self.notices[0][0] <= now:
            msg = self.unstarted.pop(heapq.heappop(self.notices)[2], None)
            if msg is not None:
                msg["_queued"] = True
                self.send({"id": 0, "event": "queued", "target": msg.get("id")})
        self._schedule_notices()

    async def _process(self, slot, command, env, args, done, connect_s):
        try:
            result = await ptyprocs.start(self, slot, command, env, args.get("rows") or 24,
                                          args.get("cols") or 80, bool(args["pty"]), connect_s=connect_s)
        except Exception as exc:
            result = protocol.call_result(error="%s: %s" % (type(exc).__name__, exc), returncode=1)
        done(result)

    async def _background(self, slot, command, env, done, connect_s):
        try:
            result = await self.start_background(slot, command, env, connect_s)
        except Exception as exc:
            result = protocol.call_result(error="%s: %s" % (type(exc).__name__, exc), returncode=1)
        done(result)

    async def start_background(self, slot, command, env, connect_s=ptyprocs.CONNECT_S):
        """Start ``command`` detached (own session) with output to a log in the workspace:
        a process of the slot (:mod:`.ptyprocs`, on pipes, its output also in the log),
        or, in a slot without ``python3``, a job of its own."""
        slot.bg_counter += 1
        job = slot.bg_counter
        ws = slot.ws_path if slot.root is not None else slot.workspace.path
        log = "%s/.background/job_%d.log" % (ws, job)
        res = await ptyprocs.start(self, slot, command, env, 24, 80, False, log=log, connect_s=connect_s)
        if res is not None:
            info = res["data"].get("process")
            if info is not None:
                res["output"] = ("started background job %d (pid %d, process %d); its output goes to %s"
                                 % (job, info["pid"], info["id"], log))
                res["data"]["background"] = {"job": job, "pid": info["pid"], "log": log}
            return res
        script = slot.write_ctl("bg_%d.sh" % job, command.encode("utf-8", "surrogatepass") + b"\n")
        prefix = "".join("%s=%s " % (k, _q(v)) for k, v in env.items())
        # setsid is the backgrounded process itself (a child of the shell leading a session
        # of its own), and it waits, stopped, until the agent has found it in /proc: its pid
        # comes from the kernel, never from what the slot's shell prints.
        launcher = ("mkdir -p %s/.background || return 1\n%ssetsid \"${BASH:-bash}\" --noprofile --norc -c "
                    "'kill -STOP $$; . \"$0\"' %s </dev/null >%s 2>&1 &\n"
                    % (_q(ws), prefix, _q(script), _q(log)))
        shell = slot.shell
        failure = await shell.ensure_ready()
        if failure is not None:
            return failure
        bash, clock = shell.shell_pid(), isolation.process_clock()
        res = await shell.run(launcher.encode("utf-8", "surrogatepass"), "/dev/null", {}, 10.0, 4096)
        pid = await _stopped_job(slot, bash, clock) if bash and res["returncode"] == 0 else None
        if pid is None or res["returncode"] != 0:
            res["error"] = "could not start the background job: %s" % (
                res["error"] or res["output"].strip() or "the slot's shell started no process of its "
                "own in a session of its own")
            res["returncode"] = res["returncode"] or 1
            return res
        slot.background_sids.append(pid)
        for key in ("stdout", "stderr"):
            res.pop(key, None)
        res["output"] = ("started background job %d (pid %d); its output goes to %s"
                         % (job, pid, log))
        res["data"] = {"background": {"job": job, "pid": pid, "log": log}}
        return res


async def _stopped_job(slot, bash, clock, limit=10.0):
    """The slot-view pid of the one job the shell (host pid ``bash``) started since
    ``clock``, once it leads a session and has stopped itself; it is continued. None if
    there is not exactly one such child within ``limit`` seconds."""
    deadline = time.monotonic() + limit
    pause = 0.001
    while True:
        kids = owned.new_children(slot, bash, clock)
        if len(kids) == 1 and owned.session_of(kids[0]) == kids[0] and owned.state_of(kids[0]) == b"T":
            pid = owned.slot_view(slot, kids[0])
            os.kill(kids[0], signal.SIGCONT)
            return pid
        if len(kids) != 1 or time.monotonic() > deadline:
            return None
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


def _closing(live, done):
    """``done`` after the live output's last event is sent."""
    def finish(result):
        live.close()
        done(result)
    return finish


def _tool_failure(exc, args):
    """A failed ``call`` result for an exception of a tool: a clear message, not a raw one."""
    if isinstance(exc, files.FileToolError):
        return protocol.call_result(error=str(exc), returncode=1)
    if isinstance(exc, OSError):
        # Name the path the caller gave (shortened), not a raw Python error.
        given = args.get("path") if isinstance(args, dict) else None
        name = given if isinstance(given, str) else (exc.filename if isinstance(exc.filename, str) else "")
        if len(name) > 60:
            name = name[:40] + "..." + name[-16:]
        return protocol.call_result(
            error="%s: %s" % (repr(name), exc.strerror or exc) if name else str(exc.strerror or exc),
            returncode=1)
    return protocol.call_result(error="%s: %s" % (type(exc).__name__, exc), returncode=1)


class _Pending:
    """A call that waits for admission or for its slot's shell to start."""

    __slots__ = ("msg", "begin", "done", "task")

    def __init__(self, msg, begin, done):
        self.msg = msg
        self.begin = begin
        self.done = done
        self.task = None


def _q(value):
    return "'" + str(value).replace("'", "'\"'\"'") + "'"


def _cap(text, limit):
    if len(text) <= limit:
        return text, False
    keep = limit // 2
    from .shells.output import marker
    return text[:keep] + marker(len(text) - 2 * keep) + text[len(text) - keep:], True
