"""The in-sandbox agent: one process per sandbox, all slots multiplexed on its stdio.

Stdlib-only, Python 3.8. Started by a driver with :data:`..agent.BOOTSTRAP`; reads
frames (see :mod:`hermes_modal_tool.protocol`) on stdin and writes frames on
stdout. Nothing else may write to the real stdout, so the agent moves the
protocol streams to private descriptors and points fds 0/1 at /dev/null/stderr.

Its parts: :mod:`.setup` (``init``), :mod:`.calls` (starting and finishing calls),
:mod:`.slot` (a slot), :mod:`.shell` (its bash), :mod:`.admission`, :mod:`.diskwatch`.
"""

import asyncio
import concurrent.futures
import functools
import itertools
import os
import signal
import sys

from .. import protocol
from ..deadlines import Deadlines
from .calls import BATCH_KEY, FILE_THREADS, HOLD_S, STOPPED_BEFORE, Calls
from .files import streams as file_streams
from .files.filesums import dispatch as dispatch_checksum
from .fs import mounts, rootfs, trees
from .inbound import InProtocol
from .limits import admission, quiet
from .limits.diskwatch import DiskWatch
from .limits.usage import dispatch as dispatch_usage
from .limits.usage import new_tenant
from .net import tunnels
from .setup import Setup
from .shells import ptyprocs, spawner, streaming
from .shells.shell import SPAWN_THREADS
from .slot import HELD_IN_RESET
from .state import ops as state_ops

#: Idle slots whose shells are started before their first call, in the order the host
#: hands fresh slots out (lowest index first), so that a first command finds a ready
#: shell; only while no command waits for admission or for a shell. As many as the host
#: chooses among (``pool.PICK_WINDOW``): after them it reuses slots whose shells the
#: agent started again after their reset.
SPARE_SHELLS = 8


class Agent(Setup, Calls, DiskWatch):
    """The agent of one sandbox: its slots, their calls, and the worker threads."""

    def __init__(self, loop, out_transport):
        self.loop = loop
        self.out = out_transport
        self.slots = {}
        self.outbox = []
        self.held = []  # compact batches with results not sent yet (Batch.results)
        self.flush_handle = None  # the scheduled flush (at once, or a batch's hold)
        self.flush_soon = False  # ... and it is the one at once
        self.tasks = set()
        self.deadlines = Deadlines(loop)  # the running commands' timeouts
        self.config = None
        self.cgroups = None
        self.rlimits = []
        self.closing = False
        self.done = loop.create_future()
        self._admission = None
        self.heartbeat = None
        self.gpu = None  # gpu.AgentGpu for a gpu profile
        self.net, self.network = None, "host"  # network: egress's namespaces (net/slotnet.py)
        self.network_note = ""
        self._spawn_limiter = None
        self._executors = {}  # name -> ThreadPoolExecutor, made on first use
        self.spares = set()  # indexes of idle slots whose shell was started ahead of use
        self.next_fresh = 0  # slots below this index had a shell started or a call
        self.spare_starting = False  # a spare's shell is starting (one at a time)
        self.slot_disk_mb = None
        self.volumes = []  # the profile's (source, target, read_only) (agent/fs/volumes.py)
        self.filesystem = "workspace-only"
        self.template_dir = None  # the slots' template layers' tmpfs (see setup, rootfs)
        self.shared_template = None  # the slots' shared template layer (rootplan.SharedTemplate)
        self.layer_spares = None  # kept layer directories (see setup, layerspares)
        self.layer_disks = None  # the layers' file systems (see setup, slotdisk)
        self.unstarted = {}  # id(msg) -> a call that has not started yet
        self.notices = []  # heap of (when to notice, seq, id(msg))
        self.notice_seq = itertools.count()
        self.notice_timer = None
        self.spawner = None  # the process that starts layered-root shells (agent/shells/spawner.py)
        self.thread_starter = None  # ... or the agent's own threads do (agent/shells/threadstart.py)
        self.thread_start_note = None  # how layered-root shells start, once one did
        self.shells_starting = 0  # shells between their start and ready (or failure)
        self.cpu_quiet = quiet.CpuQuiet(self._starts_wait)  # background work waits for it

    # -- io ------------------------------------------------------------------
    def send(self, message, batch=None):
        """Queue a frame; frames queued in one loop pass go out in one write. A call's
        result with its ``batch`` waits (at most :data:`HOLD_S`) while results of that
        batch are still to come; the results of a compact batch (a ``calls`` frame) go
        in one ``results`` frame."""
        if batch is not None and batch.results is not None and message.get("ok") and "result" in message:
            batch.results.append([message["id"], protocol.compact_result(message["result"])])
            if len(batch.results) == 1:
                self.held.append(batch)
        else:
            self.outbox.append(protocol.encode(message))
        if batch is not None:
            batch.left -= 1
            if batch.left > 0:
                if self.flush_handle is None:
                    self.flush_handle = self.loop.call_later(HOLD_S, self.flush)
                return
        if not self.flush_soon:
            if self.flush_handle is not None:
                self.flush_handle.cancel()
            self.flush_handle = self.loop.call_soon(self.flush)
            self.flush_soon = True

    def flush(self):
        if self.flush_handle is not None:
            self.flush_handle.cancel()
        self.flush_handle = None
        self.flush_soon = False
        for batch in self.held:
            self.outbox.append(protocol.encode({"id": 0, "results": batch.results}))
            batch.results = []
        self.held = []
        if self.outbox and not self.out.is_closing():
            self.out.write(b"".join(self.outbox))
        self.outbox = []

    def on_message(self, msg):
        op = msg.get("op")
        mid = msg.get("id")
        slot = self.slots.get(msg.get("slot")) if op in HELD_IN_RESET else None
        if slot is not None and slot.held_for_reset(msg):
            return  # served when the slot's reset is over (SlotRuntime.held_for_reset)
        if op == "call":
            slot = self.slots.get(msg.get("slot"))
            if slot is None:
                self.send({"id": mid, "ok": True, "result": protocol.call_result(
                    error="no slot %r in this sandbox" % (msg.get("slot"),))}, msg.get(BATCH_KEY))
            else:
                self.unstarted[id(msg)] = msg
                slot.queue.append(msg)
                slot.pump()
                if id(msg) in self.unstarted:
                    self.watch_unstarted(msg)
        elif op == "init":
            self.reply(mid, self.handle_init, msg)
            self.loop.call_soon(self.keep_spares)
        elif op == "reset":
            self.own(self.handle_reset(msg))
        elif op == "cancel":
            self.send({"id": mid, "ok": True, "result": {"cancelled": self.cancel(msg.get("target"))}})
        elif op == "status":
            self.reply(mid, self.handle_status, msg)
        elif op == "shutdown":
            self.own(self.shutdown(mid))
        elif op == "ping":
            pass  # the owner is alive (noted by _InProtocol for the heartbeat)
        elif op == "process":
            ptyprocs.dispatch(self, msg)  # a slot's processes (agent/shells/ptyprocs.py)
        elif op == "checksum":
            dispatch_checksum(self, msg)  # a file's SHA-256, in a worker thread (agent/files/filesums.py)
        elif op in ("upload", "download"):
            file_streams.dispatch(self, msg)  # streamed transfer, a thread each (agent/files/streams.py)
        elif op == "tunnel":
            tunnels.dispatch(self, msg)  # a TCP connection into a slot (agent/net/tunnels.py)
        elif op == "usage":
            dispatch_usage(self, msg)  # the slot's tenant's CPU, memory, disk (agent/limits/usage.py)
        elif op == "ack":
            streaming.on_ack(self, msg)  # the host got streamed output (agent/shells/streaming.py)
        elif op in state_ops.OPS:
            state_ops.dispatch(self, msg)  # snapshots, forks, transfers (agent/state/ops.py)
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
                               "result": protocol.call_result(error="cancelled before it started")},
                              msg.get(BATCH_KEY))
                    return True
        return False

    def reply(self, mid, fn, msg):
        try:
            self.send({"id": mid, "ok": True, "result": fn(msg)})
        except Exception as exc:  # report, never die
            self.send({"id": mid, "ok": False, "error": "%s: %s" % (type(exc).__name__, exc),
                       "kind": type(exc).__name__})

    # -- ops -------------------------------------------------------------------
    def handle_status(self, msg):
        return {"slots": {str(i): {"shell": s.shell.alive, "busy": s.busy, "queued": len(s.queue),
                                   "waiting": s.pending is not None}
                          for i, s in self.slots.items()},
                "admission": self.admission.statistics(), "shell_start": self.thread_start_note,
                "network": (self.net.status() if self.net is not None
                            else {"mode": self.network, "note": self.network_note})}

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
                       "result": protocol.call_result(error="the slot was reset before this call ran")},
                      dropped.get(BATCH_KEY))
        if slot.busy:
            self.stop_current(slot, "the slot was reset before this call ran")
            await slot.idle.wait()
        slot.set_busy(mid)
        slot.resetting = []
        ptyprocs.forget(self, slot.index)  # the reset kills them
        file_streams.drop_slot(self, slot.index)  # its transfers stop writing the old layer
        tunnels.drop_slot(self, slot.index)  # connections into the old tenant's ports close
        had_shell = slot.shell.used
        answered = []

        def answer():  # once the old tenant's processes are killed, or at the end (slot.reset)
            if not answered:
                answered.append(True)
                self.send({"id": mid, "ok": True, "result": self.net.reset_result(slot.index)
                           if self.net is not None else {}})

        try:
            await slot.reset(on_killed=answer)
            new_tenant(self, slot)  # the old tenant's processes are gone
        except Exception as exc:
            if answered:  # the slot stays as it is; its next call tries again
                sys.stderr.write("hermes-modal-tool agent: slot %d: reset failed after its "
                                 "answer: %s\n" % (slot.index, exc))
            else:
                self.send({"id": mid, "ok": False, "error": "reset failed: %s" % exc})
        else:
            answer()
            if had_shell:
                # A slot that was used will be used again: the next holder's first
                # command should not wait for a shell to start. Only with room to spare:
                # under load the shell starts on first use instead.
                self.prestart(slot)
        finally:
            held, slot.resetting = slot.resetting, None
            slot.set_idle()
            for msg in held:
                self.on_message(msg)

    # -- admission: commands start when counted and their shell is ready ------------
    @property
    def admission(self):
        """The sandbox's :class:`admission.Admission` (its limit follows the ``cpu`` limit)."""
        if self._admission is None:
            cpu = ((self.config or {}).get("limits") or {}).get("cpu")
            self._admission = admission.Admission(
                self.loop, admission.default_limit(cpu))
        return self._admission

    def executor(self, name, threads=None):
        """The agent's worker threads called ``name``, made on first use: "spawn" (shells
        start: :data:`.shell.SPAWN_THREADS`), "files" (file tools, workspace wipes:
        :data:`.calls.FILE_THREADS`), "layers" (slot layers, in order: 1), "standby"
        (standby layers, once the CPU is free: 1), "disk"
        (``slot_disk`` measurements: 1); ``threads`` for any other name (default 1)."""
        pool = self._executors.get(name)
        if pool is None:
            n = threads or {"spawn": SPAWN_THREADS, "files": FILE_THREADS}.get(name, 1)
            pool = self._executors[name] = concurrent.futures.ThreadPoolExecutor(
                n, thread_name_prefix="hermes-modal-tool-" + name)
        return pool

    def layer_work(self, root, old):
        """In the background (the agent's loop never waits), in one worker thread
        ("layers"), in order: point ``current`` at the layer in use and unmount and delete
        the dropped layer ``old`` (iteratively, never into a mount point). Then, in a
        thread of its own ("standby") and once the CPU is free (:mod:`.quiet`), prepare the
        slot's next standby layer."""
        if self.closing and old is None:
            return

        def work():
            try:
                root.point_current()
                trash = root.retire(old) if old is not None else None
                if trash is not None and self.layer_spares is not None:
                    self.layer_spares.keep(trash)  # or deleted (agent/fs/layerspares.py)
                elif trash is not None:
                    trees.remove_tree(trash)
            except Exception as exc:  # noqa: BLE001 - the next ensure() builds a layer itself
                sys.stderr.write("hermes-modal-tool agent: layer work failed: %s\n" % (exc,))

        queued = self.cpu_quiet.clock()

        def standby():
            try:
                self.cpu_quiet.wait(lambda: self.closing, since=queued)
                if not self.closing:
                    root.prepare_standby()
            except Exception as exc:  # noqa: BLE001 - the next ensure() builds a layer itself
                sys.stderr.write("hermes-modal-tool agent: standby layer failed: %s\n" % (exc,))

        self.executor("layers").submit(work)
        self.executor("standby").submit(standby)

    def _starts_wait(self):
        """Whether a shell of this agent is starting or a call waits for admission (read
        from a worker thread: a count and a dict's size the loop keeps, not locked)."""
        gate = self._admission
        return self.shells_starting > 0 or (gate is not None and len(gate.waiting) > 0)

    @property
    def spawn_limiter(self):
        """How many shells may start at once (first come, first served)."""
        if self._spawn_limiter is None:
            self._spawn_limiter = asyncio.Semaphore(SPAWN_THREADS)
        return self._spawn_limiter

    def prestart(self, slot, then=None):
        """Start the slot's shell now if no other shell waits to start (else on first use);
        return whether it was started. ``then(failed)`` runs once it is ready or failed."""
        if self.closing or self.spawn_limiter.locked() or self.admission.waiting:
            return False

        def started(f):
            failed = f.cancelled() or f.exception() is not None or f.result() is not None
            if then is not None:
                then(failed)

        slot.prepare_dirs()  # its control directory (once; cheap)
        slot.shell.ensure_ready().add_done_callback(started)
        return True

    def keep_spares(self):
        """Start a shell for the next fresh slot (see :data:`SPARE_SHELLS`), one at a time:
        the host hands a new sandbox's slots out from index 0 up, so those are the next
        first commands. A spare's shell runs in its slot's own root, as its uid, with the
        slot's environment, exactly like a shell started by the first call."""
        if self.spare_starting or self.closing:
            return
        slots = self.slots
        while len(self.spares) < SPARE_SHELLS and self.next_fresh < len(slots):
            slot = slots[self.next_fresh]
            if slot.busy or slot.dirty or slot.shell.used or slot.shell.starting or slot.shell.alive:
                self.next_fresh += 1
                continue

            def then(failed, index=slot.index):
                self.spare_starting = False
                if failed:
                    self.spares.discard(index)
                if not self.closing:
                    self.keep_spares()

            if not self.prestart(slot, then):
                return  # busy now: the next first call tries again
            self.spare_starting = True
            self.spares.add(slot.index)
            self.next_fresh += 1
            return

    def first_use(self, slot):
        """``slot`` gets its first call: it is no spare any more; prepare the next one."""
        self.next_fresh = max(self.next_fresh, slot.index + 1)
        self.spares.discard(slot.index)
        self.keep_spares()

    async def shutdown(self, mid=None):
        if self.closing:
            return
        self.closing = True
        file_streams.drop_all(self)
        tunnels.drop_all(self)
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
        self.deadlines.close()
        if self.notice_timer is not None:
            self.notice_timer.cancel()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.gpu is not None:  # the MPS daemon, once the slots' processes are gone
            await self.loop.run_in_executor(None, self.gpu.close)
        if "spawn" in self._executors:
            self._executors["spawn"].shutdown(wait=False)
        if self.cgroups:
            # A cgroup can be removed once its last process is gone; dying ones take a moment.
            for _ in range(40):
                for slot in self.slots.values():
                    self.cgroups.kill_slot(slot.index)
                    self.cgroups.remove_slot(slot.index)
                if self.cgroups.remove_all():
                    break
                await asyncio.sleep(0.05)
        for name in ("layers", "standby", "trash"):  # a layer being built, a tree being deleted
            if name in self._executors:
                await self.loop.run_in_executor(
                    None, functools.partial(self._executors[name].shutdown, True))
        for slot in self.slots.values():
            if slot.root is not None:
                try:
                    slot.root.teardown()
                except OSError as exc:
                    sys.stderr.write("hermes-modal-tool agent: %s\n" % exc)
        if self.net is not None:  # the slots' namespaces and the router (net/slotnet.py)
            await self.loop.run_in_executor(None, self.net.close)
        if self.layer_disks is not None:  # the layers' file systems (agent/fs/slotdisk.py)
            await self.loop.run_in_executor(None, self.layer_disks.close)
        if self.template_dir:
            try:
                rootfs.umount(self.template_dir)
            except OSError as exc:
                sys.stderr.write("hermes-modal-tool agent: %s\n" % exc)
        for pool in self._executors.values():
            pool.shutdown(wait=False)
        for slot in self.slots.values():
            try:
                if getattr(slot, "tmpfs", None) is not None:
                    slot.tmpfs.release()  # before its mount point's directory is removed
            except OSError as exc:
                sys.stderr.write("hermes-modal-tool agent: %s\n" % exc)
        if self.config and self.config.get("remove_state", True):
            paths = [path for path in (self.ctl_root, self.host_root if self.config.get("host_root")
                                       else None, self.state_dir) if path]
            # Off the loop (a slot may have made a very deep or wide tree; iterative).
            await self.loop.run_in_executor(None, _remove_trees, paths)
        if mid is not None:
            self.send({"id": mid, "ok": True, "result": {}})
        if not self.done.done():
            self.done.set_result(None)


def _remove_trees(paths):
    for path in paths:
        trees.remove_tree(path)


async def _amain(in_fd, out_fd, spawner_handle):
    loop = asyncio.get_event_loop()
    out_transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(out_fd, "wb", 0))
    agent = Agent(loop, out_transport)
    agent.spawner = spawner_handle
    if spawner_handle is not None:
        mounts.use_userns_maker(spawner_handle.userns)
    in_transport, _ = await loop.connect_read_pipe(lambda: InProtocol(agent), os.fdopen(in_fd, "rb", 0))
    # Read what the pipe holds in one go (asyncio reads 256 KiB at most): a transfer's
    # chunk of 512 KiB then comes in one read and is decoded straight from it, not
    # assembled from two reads in a buffer of its own (one copy of it fewer).
    in_transport.max_size = file_streams.PIPE_BYTES
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
    file_streams.widen_pipes(in_fd, out_fd)  # fewer wakeups per MiB of a transfer
    os.umask(0o022)
    sys.setswitchinterval(0.0005)  # the loop waits less for worker threads (spawns, layers)
    spawner_handle = spawner.start()  # now, while the agent is small and has one thread
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_amain(in_fd, out_fd, spawner_handle))
    finally:
        loop.close()
