"""The in-sandbox agent: one process per sandbox, all slots multiplexed on its stdio.

Stdlib-only, Python 3.8. Started by a driver with :data:`..agent.BOOTSTRAP`; reads
frames (see :mod:`hermes_modal_tool.protocol`) on stdin and writes frames on
stdout. Nothing else may write to the real stdout, so the agent moves the
protocol streams to private descriptors and points fds 0/1 at /dev/null/stderr.

A bash call starts (and its timeout clock with it) once its slot is free, its slot's
shell is ready (shells start in worker threads, a few at a time) and the sandbox's
admission lets it in (:mod:`.admission`); the host is told about calls that wait long.
"""

import asyncio
import concurrent.futures
import functools
import heapq
import itertools
import os
import resource
import signal
import sys
import time

from .. import protocol
from . import admission, files, filetools, isolation, rootfs, rootplan, snapshots
from .diskwatch import DISK_WATCH_S, DiskWatch
from .slot import SlotRuntime

#: Shells of a sandbox that may start at once (each takes ~10 ms of CPU, more on a busy
#: machine); ``Popen`` runs in as many threads (it blocks; the event loop must not).
SPAWN_THREADS = 4
#: Seconds a call may wait to start (behind its slot's running call, for admission or
#: for its shell) before the host is told it is queued and stops its deadline until the
#: call starts; half the call's timeout when that is shorter. Either is well inside the
#: host's deadline (the timeout plus a grace period), so no deadline passes meanwhile.
NOTICE_S = 5.0
#: Worker threads for file tools and workspace wipes (off the event loop).
FILE_THREADS = 4
STOPPED_BEFORE = "the sandbox was stopped (the backend is shutting down) before the command started"


class Agent(DiskWatch):
    def __init__(self, loop, out_transport):
        self.loop = loop
        self.out = out_transport
        self.slots = {}
        self.outbox = []
        self.tasks = set()
        self.config = None
        self.cgroups = None
        self.rlimits = []
        self.closing = False
        self.done = loop.create_future()
        self._admission = None
        self._spawner = None
        self._spawn_limiter = None
        self._reaper = None
        self._file_workers = None
        self._watcher = None
        self.slot_disk_mb = None
        self.filesystem = "workspace-only"
        self.unstarted = {}  # id(msg) -> a call that has not started yet
        self.notices = []  # heap of (when to notice, seq, id(msg))
        self.notice_seq = itertools.count()
        self.notice_timer = None

    # -- io ------------------------------------------------------------------
    def send(self, message):
        """Queue a frame; frames queued in one loop pass go out in one write."""
        if not self.outbox:
            self.loop.call_soon(self.flush)
        self.outbox.append(protocol.encode(message))

    def flush(self):
        if self.outbox and not self.out.is_closing():
            self.out.write(b"".join(self.outbox))
        self.outbox = []

    def on_message(self, msg):
        op = msg.get("op")
        mid = msg.get("id")
        if op == "call":
            slot = self.slots.get(msg.get("slot"))
            if slot is None:
                self.send({"id": mid, "ok": True, "result": protocol.call_result(
                    error="no slot %r in this sandbox" % (msg.get("slot"),))})
            else:
                self.unstarted[id(msg)] = msg
                slot.queue.append(msg)
                slot.pump()
                if id(msg) in self.unstarted:
                    self.watch_unstarted(msg)
        elif op == "init":
            self.reply(mid, self.handle_init, msg)
        elif op == "reset":
            self.own(self.handle_reset(msg))
        elif op == "cancel":
            self.send({"id": mid, "ok": True, "result": {"cancelled": self.cancel(msg.get("target"))}})
        elif op == "status":
            self.reply(mid, self.handle_status, msg)
        elif op == "shutdown":
            self.own(self.shutdown(mid))
        elif op in snapshots.OPS:
            snapshots.dispatch(self, msg)
        else:
            self.send({"id": mid, "ok": False, "error": "unknown op %r; known: %s"
                       % (op, ", ".join(protocol.OPS))})

    def own(self, coro):
        """Run a coroutine as a task the agent keeps (and cancels on shutdown)."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def cancel(self, target):
        for slot in self.slots.values():
            if slot.current == target:
                self.stop_current(slot, "cancelled before it started")
                return True
            for msg in slot.queue:
                if msg.get("id") == target:
                    slot.queue.remove(msg)
                    self.unstarted.pop(id(msg), None)
                    self.send({"id": target, "ok": True,
                               "result": protocol.call_result(error="cancelled before it started")})
                    return True
        return False

    def reply(self, mid, fn, msg):
        try:
            self.send({"id": mid, "ok": True, "result": fn(msg)})
        except Exception as exc:  # report, never die
            self.send({"id": mid, "ok": False, "error": "%s: %s" % (type(exc).__name__, exc)})

    # -- ops -------------------------------------------------------------------
    def handle_init(self, msg):
        cfg = msg["config"]
        self.config = cfg
        self.workspace_base = cfg["workspace_base"]
        self.state_dir = cfg["state_dir"]
        # Control files are rewritten on every command: keep them on tmpfs when we can.
        self.ctl_root = cfg.get("ctl_root") or os.path.join(self.state_dir, "ctl")
        self.host_root = cfg.get("host_root") or self.workspace_base
        self.isolation = cfg.get("isolation", "bwrap")
        self.bwrap = cfg.get("bwrap")
        self.network = bool(cfg.get("network", True))
        self.hide = list(cfg.get("hide", []))
        # In a container (Modal) the slots see the container's environment (image
        # variables, Modal secrets) plus the profile's; locally only the profile's.
        self.env = {}
        if cfg.get("inherit_env"):
            self.env.update((k, v) for k, v in os.environ.items() if not k.startswith("PYTHON"))
        self.env.update(cfg.get("env", {}))
        self.limit = int(cfg.get("output_limit", 50000))
        uid_base = cfg.get("uid_base")
        self.uid_base = uid_base if (uid_base is not None and os.geteuid() == 0) else None
        isolation_note = ""
        if self.isolation == "bwrap" and self.bwrap == "auto":
            # Bubblewrap on top where it works in this container; else each slot keeps
            # its own uid, 0700 workspace and process group (see SECURITY.md).
            self.bwrap, isolation_note = isolation.find_working_bwrap(
                self.env.get("PATH") or os.environ.get("PATH", ""), self.uid_base)
            if self.bwrap is None:
                self.isolation = "none"
        self.workdir = cfg.get("workdir") or None
        self.slot_disk_mb = cfg.get("slot_disk") or None
        self.filesystem, filesystem_note = self._choose_filesystem(cfg)
        limits = dict(cfg.get("limits", {}))
        # A slot's /tmp (and /run, /var/tmp, /dev/shm) may hold at most half its memory
        # limit each: a full /tmp fails with ENOSPC instead of growing without bound.
        mem = limits.get("slot_memory_mb") or limits.get("memory_mb")
        self.tmpfs_mb = max(16, int(mem) // 2) if mem else None
        limits.setdefault("sandbox_pids", (limits.get("pids") or 0) * cfg["slots"] + 64
                          if limits.get("pids") else None)
        os.makedirs(self.state_dir, exist_ok=True)
        os.chmod(self.state_dir, 0o711)
        os.makedirs(self.ctl_root, exist_ok=True)
        os.chmod(self.ctl_root, 0o711)
        os.makedirs(self.host_root, exist_ok=True)
        os.chmod(self.host_root, 0o711)
        self.cgroups = None
        limit_mode = "none"
        reason = ""
        if cfg.get("cgroups", True):
            self.cgroups = isolation.Cgroups(
                cfg.get("cgroup_name") or "%s-%d" % (cfg.get("sandbox_id", "sandbox"), os.getpid()),
                limits)
            limit_mode = self.cgroups.mode
            reason = self.cgroups.reason
            if limit_mode == "rlimit":
                self.cgroups = None
        self.rlimits = [] if self.cgroups else isolation.rlimits_for(limits, self.uid_base is not None)
        if not self.cgroups:
            limit_mode = "rlimit"
        for i in range(int(cfg["slots"])):
            self.slots[i] = SlotRuntime(self, i)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
        return {
            "protocol": protocol.PROTOCOL_VERSION,
            "python": "%d.%d.%d" % sys.version_info[:3],
            "pid": os.getpid(),
            "isolation": self.isolation,
            "isolation_note": isolation_note,
            "limits": limit_mode,
            "limits_note": reason,
            "slot_uids": self.uid_base is not None,
            "slots": len(self.slots),
            "filesystem": self.filesystem,
            "filesystem_note": filesystem_note,
            "slot_disk": (None if not self.slot_disk_mb else
                          {"mib": self.slot_disk_mb, "enforced": "watched",
                           "note": "measured every %gs while a command runs and when it ends; "
                                   "the command is stopped past the limit" % DISK_WATCH_S}
                          if self.filesystem == "overlay" else
                          {"mib": self.slot_disk_mb, "enforced": "none",
                           "note": "no layered root: the limit is not applied"}),
        }

    def _choose_filesystem(self, cfg):
        """``("overlay", "")`` when each slot gets a layered root of its own, else
        ``("workspace-only", why)``. ``filesystem: overlay`` in the config makes it required."""
        wanted = cfg.get("filesystem") or "auto"
        if wanted == "workspace-only":
            return "workspace-only", "the profile asks for filesystem: workspace-only"
        if self.isolation != "bwrap" or self.uid_base is None:
            why = ("slots run without bubblewrap" if self.isolation != "bwrap"
                   else "the agent is not root, so slots cannot have a uid of their own")
        else:
            os.makedirs(self.state_dir, exist_ok=True)
            why = rootfs.probe(self.state_dir)
        if why:
            if wanted == "overlay":
                raise RuntimeError("filesystem: overlay is not possible here: %s" % why)
            return "workspace-only", why
        self.trash_dir = os.path.join(self.state_dir, "trash")
        for sub in ("fs", "mnt", "trash"):
            os.makedirs(os.path.join(self.state_dir, sub), mode=0o711, exist_ok=True)
        hidden = list(self.hide) + [self.state_dir, self.ctl_root]
        base = self.workspace_base.rstrip("/")
        if not (base == self.host_root or base.startswith(self.host_root + "/")
                or self.host_root.startswith(base + "/")):
            hidden.append(self.host_root)  # workspace-only layout's dirs (not the slots' base)
        self.upper_plan = rootplan.UpperPlan(
            hidden,
            cfg.get("masked") or [], bool(cfg.get("hide_host_top", False)))
        return "overlay", ""

    def handle_status(self, msg):
        return {"slots": {str(i): {"shell": s.shell.alive, "busy": s.busy, "queued": len(s.queue),
                                   "waiting": s.pending is not None}
                          for i, s in self.slots.items()},
                "admission": self.admission.statistics()}

    async def handle_reset(self, msg):
        mid = msg.get("id")
        slot = self.slots.get(msg.get("slot"))
        if slot is None:
            self.send({"id": mid, "ok": False, "error": "no slot %r" % (msg.get("slot"),)})
            return
        while slot.queue:
            dropped = slot.queue.popleft()
            self.unstarted.pop(id(dropped), None)
            self.send({"id": dropped.get("id"), "ok": True,
                       "result": protocol.call_result(error="the slot was reset before this call ran")})
        if slot.busy:
            self.stop_current(slot, "the slot was reset before this call ran")
            await slot.idle.wait()
        slot.set_busy(mid)
        had_shell = slot.shell.used
        try:
            await slot.reset()
        except Exception as exc:
            self.send({"id": mid, "ok": False, "error": "reset failed: %s" % exc})
        else:
            self.send({"id": mid, "ok": True, "result": {}})
            if had_shell:
                # A slot that was used will be used again: the next holder's first
                # command should not wait for a shell to start. Only with room to spare:
                # under load the shell starts on first use instead.
                self.prestart(slot)
        finally:
            slot.set_idle()

    def start_call(self, slot, msg):
        """Start one call in an idle slot; its result is sent when it ends."""
        mid = msg.get("id")
        started = time.monotonic()

        def done(result):
            if not result.get("duration_s"):
                result["duration_s"] = time.monotonic() - started
            self.unstarted.pop(id(msg), None)
            self.admission.release(slot)
            self.send({"id": mid, "ok": True, "result": result})
            slot.set_idle()

        try:
            slot.set_busy(mid)
        except Exception as exc:  # noqa: BLE001 - the call must be answered whatever failed
            slot.busy = True
            done(protocol.call_result(
                error="the slot could not be prepared: %s: %s" % (type(exc).__name__, exc),
                returncode=None))
            return
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
                done(protocol.call_result(error=problem, returncode=None))
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

        self.loop.run_in_executor(self.file_workers, self._file_tool_result, slot, tool,
                                  args).add_done_callback(finished)

    def _file_tool_result(self, slot, tool, args):
        try:
            return self.run_tool(slot, tool, args)
        except Exception as exc:  # noqa: BLE001 - reported as the call's result
            return _tool_failure(exc, args)

    @property
    def file_workers(self):
        """The worker threads for file tools and workspace wipes."""
        if self._file_workers is None:
            self._file_workers = concurrent.futures.ThreadPoolExecutor(
                FILE_THREADS, thread_name_prefix="hermes-modal-tool-files")
        return self._file_workers

    def run_tool(self, slot, tool, args):
        """Run a file tool (blocking: call from :attr:`file_workers`, never the loop).

        ``tool`` and ``args`` were checked by :func:`protocol.check_args`.
        """
        slot.prepare_dirs()
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
        stdin_path = "/dev/null"
        if stdin is not None:
            stdin_path = slot.write_ctl("stdin", stdin.encode("utf-8", "surrogatepass"))
        if background:
            def begin():
                self.own(self._background(slot, command, env, done))
        else:
            cmd_path = slot.write_ctl("cmd", command.encode("utf-8", "surrogatepass") + b"\n")
            watched = slot.root is not None and self.slot_disk_mb
            if watched:
                done = self._disk_checked(slot, done)

            def begin():
                slot.shell.start(cmd_path, stdin_path, env, float(timeout), self.limit, done,
                                 one_line="\n" not in command.strip("\n"))
                if watched:
                    self.own(self._watch_disk(slot, slot.shell.collector))
        self.launch(slot, msg, begin, done)

    # -- admission: commands start when counted and their shell is ready ------------
    @property
    def admission(self):
        """The sandbox's :class:`admission.Admission` (its limit follows the ``cpu`` limit)."""
        if self._admission is None:
            cpu = ((self.config or {}).get("limits") or {}).get("cpu")
            self._admission = admission.Admission(
                self.loop, admission.default_limit(cpu))
        return self._admission

    @property
    def spawner(self):
        """The worker threads that start shells."""
        if self._spawner is None:
            self._spawner = concurrent.futures.ThreadPoolExecutor(
                SPAWN_THREADS, thread_name_prefix="hermes-modal-tool-spawn")
        return self._spawner

    def layer_work(self, root, old):
        """In the background (one worker thread, in order; the agent's loop never waits):
        unmount and delete the dropped layer ``old`` (iteratively, never into a mount point),
        point ``current`` at the layer in use and prepare the slot's next standby layer."""
        if self._reaper is None:
            self._reaper = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="hermes-modal-tool-layers")

        def work():
            try:
                root.point_current()
                trash = root.retire(old) if old is not None else None
                if not self.closing:
                    root.prepare_standby()
                if trash is not None:
                    files.remove_tree(trash)
            except Exception as exc:  # noqa: BLE001 - the next ensure() builds a layer itself
                sys.stderr.write("hermes-modal-tool agent: layer work failed: %s\n" % (exc,))

        self._reaper.submit(work)

    @property
    def spawn_limiter(self):
        """How many shells may start at once (first come, first served)."""
        if self._spawn_limiter is None:
            self._spawn_limiter = asyncio.Semaphore(SPAWN_THREADS)
        return self._spawn_limiter

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

    def prestart(self, slot):
        """Start the slot's shell now if no other shell waits to start (else on first use)."""
        if self.closing or self.spawn_limiter.locked() or self.admission.waiting:
            return

        def started(f):
            if not f.cancelled():
                f.exception()  # a failure shows on the slot's next call

        slot.shell.ensure_ready().add_done_callback(started)

    async def _background(self, slot, command, env, done):
        try:
            result = await self.start_background(slot, command, env)
        except Exception as exc:
            result = protocol.call_result(error="%s: %s" % (type(exc).__name__, exc), returncode=1)
        done(result)

    async def start_background(self, slot, command, env):
        """Start ``command`` detached (own session) with output to a log in the workspace."""
        slot.bg_counter += 1
        job = slot.bg_counter
        script = slot.write_ctl("bg_%d.sh" % job, command.encode("utf-8", "surrogatepass") + b"\n")
        ws = slot.ws_path if slot.root is not None else slot.workspace.path
        log = "%s/.background/job_%d.log" % (ws, job)
        prefix = "".join("%s=%s " % (k, _q(v)) for k, v in env.items())
        # setsid is the backgrounded process itself, so $! is the job's pid and session id,
        # and it exists before this call returns (a later timeout will not count it).
        launcher = ("mkdir -p %s/.background || exit 1\n%ssetsid bash --noprofile --norc %s "
                    "</dev/null >%s 2>&1 &\necho $!" % (_q(ws), prefix, _q(script), _q(log)))
        cmd = slot.write_ctl("cmd", launcher.encode("utf-8", "surrogatepass") + b"\n")
        res = await slot.shell.run(cmd, "/dev/null", {}, 10.0, 4096)
        try:
            pid = int(res["output"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            pid = None
        if pid is None or res["returncode"] != 0:
            res["error"] = "could not start the background job: %s" % (res["error"] or res["output"])
            return res
        slot.background_sids.append(pid)
        res["output"] = ("started background job %d (pid %d); its output goes to %s"
                         % (job, pid, log))
        res["data"] = {"background": {"job": job, "pid": pid, "log": log}}
        return res

    async def shutdown(self, mid=None):
        if self.closing:
            return
        self.closing = True
        for slot in self.slots.values():
            if slot.pending is not None:
                self._finish_pending(slot, STOPPED_BEFORE)
        for task in list(self.tasks):
            if task is not asyncio.current_task():
                task.cancel()
        for slot in self.slots.values():
            slot.shell.kill()
        await asyncio.gather(*(slot.shell.stop() for slot in self.slots.values()),
                             return_exceptions=True)
        self.admission.close()
        if self.notice_timer is not None:
            self.notice_timer.cancel()
        if self._spawner is not None:
            self._spawner.shutdown(wait=False)
        if self.cgroups:
            # A cgroup can be removed once its last process is gone; dying ones take a moment.
            for _ in range(40):
                for slot in self.slots.values():
                    self.cgroups.kill_slot(slot.index)
                    self.cgroups.remove_slot(slot.index)
                if self.cgroups.remove_all():
                    break
                await asyncio.sleep(0.05)
        if self._reaper is not None:  # let a layer being built finish before unmounting
            await self.loop.run_in_executor(None, functools.partial(self._reaper.shutdown, True))
        for slot in self.slots.values():
            if slot.root is not None:
                try:
                    slot.root.teardown()
                except OSError as exc:
                    sys.stderr.write("hermes-modal-tool agent: %s\n" % exc)
        for pool in (self._reaper, self._watcher, self._file_workers):
            if pool is not None:
                pool.shutdown(wait=False)
        if self.config and self.config.get("remove_state", True):
            for path in (self.ctl_root, self.host_root if self.config.get("host_root") else None,
                         self.state_dir):
                if path:
                    files.remove_tree(path)  # iterative: a slot may have made a very deep tree
        if mid is not None:
            self.send({"id": mid, "ok": True, "result": {}})
        if not self.done.done():
            self.done.set_result(None)


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
    from .shell import marker
    return text[:keep] + marker(len(text) - 2 * keep) + text[len(text) - keep:], True


class _InProtocol(asyncio.Protocol):
    def __init__(self, agent):
        self.agent = agent
        self.decoder = protocol.FrameDecoder()

    def data_received(self, data):
        try:
            messages = self.decoder.feed(data)
        except protocol.ProtocolError as exc:
            sys.stderr.write("hermes-modal-tool agent: %s\n" % exc)
            self.agent.own(self.agent.shutdown())
            return
        for msg in messages:
            self.agent.on_message(msg)

    def eof_received(self):
        self.agent.own(self.agent.shutdown())

    def connection_lost(self, exc):
        self.agent.own(self.agent.shutdown())


async def _amain(in_fd, out_fd):
    loop = asyncio.get_event_loop()
    out_transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(out_fd, "wb", 0))
    agent = Agent(loop, out_transport)
    await loop.connect_read_pipe(lambda: _InProtocol(agent), os.fdopen(in_fd, "rb", 0))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, lambda: agent.own(agent.shutdown()))
    await agent.done
    # let the last frames drain
    for _ in range(100):
        if out_transport.get_write_buffer_size() == 0:
            break
        await asyncio.sleep(0.01)


def main():
    """Entry point: move the protocol off fds 0/1, then serve until stdin closes."""
    in_fd = os.dup(0)
    out_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    os.set_inheritable(in_fd, False)
    os.set_inheritable(out_fd, False)
    os.umask(0o022)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_amain(in_fd, out_fd))
    finally:
        loop.close()
