"""Slot snapshots and forks inside one sandbox (the agent's side).

Stdlib-only, Python 3.8.

A *snapshot* freezes a slot's writable layer and its shell's state (working directory,
exported variables, functions and aliases); a *fork* gives another slot of the sandbox a
fresh, empty writable layer stacked on the frozen one::

    fork's upper      private, writable (empty when the fork starts)
    frozen layer(s)   a snapshot's upper (and the layers it was itself stacked on), read-only
    sandbox lower     the sandbox's root, idmapped, read-only

How a snapshot freezes a layer: an overlay's upper must not change while it is mounted,
and a running shell's root is that mount (bwrap bound it in the shell's own mount
namespace). Of the two ways to get a frozen copy (copy the upper, O(state), with the
slot's processes paused; or stop the slot's processes and stack a new layer on the upper
as it is), this module does the second: a snapshot costs a shell restart whatever the
size of the state, and so does every later fork. The price: **a snapshot stops the
slot's processes**, background jobs included (they are not part of a snapshot, and could
not be: a process is not a file). The slot then goes on from the same state: a new shell
in the same directory with the same exported variables, functions and aliases, on a new
layer over the frozen one.

Reference counts: a frozen layer is held by the host (``holds``: one per snapshot handle,
released with ``release_snapshot``) and used (``users``) by every layer stacked on it (the
parent slot's own, forks', frozen children). It is deleted when both reach zero, so a
snapshot outlives the reset of the slot it came from and goes when its last holder does.

Ownership: a frozen layer's files belong on disk to the uid of the slot that wrote it;
a fork in another slot mounts it idmapped (that uid -> its own), so to every slot the
state looks like its own files, owned by its root.
"""

import re

from ..fs import slotdisk
from ..limits import diskwatch

#: Largest shell state a snapshot keeps (exported variables, functions, aliases), bytes.
STATE_LIMIT = 4 * 1024 * 1024
#: What the slot's shell prints to describe its state (replayable bash); the agent's own
#: functions (``__hmt_*``, the shell's command loop, read-only) are not part of it.
CAPTURE = ("builtin export -p\n"
           "for __hmt_x in $(builtin compgen -A function); do case $__hmt_x in __hmt_*) ;; "
           "*) builtin declare -f -- \"$__hmt_x\";; esac; done; builtin unset -v __hmt_x\n"
           "builtin alias -p\n"
           "builtin printf 'builtin cd -- %q\\n' \"$PWD\"\n")
_EXPORT_NAME = re.compile(r"^declare -[-a-zA-Z]* ([A-Za-z_][A-Za-z0-9_]*)", re.M)


class SnapshotError(Exception):
    """A snapshot message that cannot be served (the reason is the reply's error)."""


class Frozen:
    """One frozen layer: a snapshot's files and shell state."""

    def __init__(self, sid, path, owner, parent, size, state):
        self.id = sid
        self.path = path  # the layer's directory (``upper``, ``layers/N/upper``)
        self.owner = owner  # uid owning its files on disk
        self.parent = parent  # the Frozen it was stacked on, or None
        self.size = size  # bytes of its own files (not its parent's)
        self.state = state  # replay script of the shell's state (text)
        self.ws = None  # the workspace path of the slot it was taken from
        self.holds = 0
        self.users = 0

    def chain(self):
        """``[(directory, owner)]`` from this layer down (for :meth:`SlotRoot.build_on`)."""
        out = []
        layer = self
        while layer is not None:
            out.append((layer.path, layer.owner))
            layer = layer.parent
        return out

    def describe(self):
        return {"snapshot": self.id, "size_bytes": self.size, "holds": self.holds,
                "users": self.users, "depth": len(self.chain()),
                "parent": self.parent.id if self.parent is not None else None}


class SnapshotStore:
    """The sandbox's frozen layers by id, with their reference counts."""

    def __init__(self, agent):
        self.agent = agent
        self.frozen = {}
        self.seq = 0

    def total_bytes(self):
        return sum(f.size for f in self.frozen.values())

    def get(self, sid):
        frozen = self.frozen.get(sid)
        if frozen is None:
            raise SnapshotError("no snapshot %r in this sandbox (released, or made in another "
                                "sandbox); known: %s" % (sid, ", ".join(sorted(self.frozen)) or "none"))
        return frozen

    def add(self, path, owner, parent, size, state):
        self.seq += 1
        frozen = Frozen("snap-%d" % self.seq, path, owner, parent, size, state)
        self.frozen[frozen.id] = frozen
        return frozen

    def unuse(self, frozen):
        frozen.users -= 1
        self._maybe_free(frozen)

    def release(self, frozen):
        if frozen.holds <= 0:
            raise SnapshotError("snapshot %s is not held (released twice?)" % frozen.id)
        frozen.holds -= 1
        return self._maybe_free(frozen)

    def layer_gone(self, layer):
        """A slot stopped using ``layer`` (reset, or replaced by a fork)."""
        frozen = getattr(layer, "stack", None)
        if isinstance(frozen, Frozen):
            layer.stack = None
            self.unuse(frozen)

    def _maybe_free(self, frozen):
        if frozen.holds > 0 or frozen.users > 0 or self.frozen.get(frozen.id) is not frozen:
            return False
        del self.frozen[frozen.id]
        self.agent.own(self._delete(frozen.path))
        if frozen.parent is not None:
            self.unuse(frozen.parent)
        return True

    async def _delete(self, path):
        loop = self.agent.loop
        await loop.run_in_executor(self.agent.executor("files"), slotdisk.drop,
                                   self.agent.layer_disks, path)


def store(agent):
    """The agent's :class:`SnapshotStore` (made on first use)."""
    st = getattr(agent, "snapshot_store", None)
    if st is None:
        st = agent.snapshot_store = SnapshotStore(agent)
    return st


def _slot(agent, msg):
    slot = agent.slots.get(msg.get("slot"))
    if slot is None:
        raise SnapshotError("no slot %r in this sandbox" % (msg.get("slot"),))
    if slot.root is None:
        raise SnapshotError(
            "snapshots need each slot to have a layered root (filesystem: overlay); this "
            "sandbox's slots are workspace-only")
    return slot


async def _claim(slot, mid, prepare=True):
    """Wait until the slot runs nothing, then hold it (calls queue behind). Without
    ``prepare`` the slot's root is not mounted first (a fork replaces it anyway)."""
    while slot.busy:
        await slot.idle.wait()
    if prepare:
        slot.set_busy(mid)
    else:
        slot.prepare_ctl()
        slot.busy = True
        slot.current = mid
        slot.idle.clear()


async def capture_state(slot):
    """The slot shell's state as a replayable bash script (text); "" for a fresh shell."""
    shell = slot.shell
    if not shell.used:
        return getattr(slot, "replay_text", None) or ""
    failure = await shell.ensure_ready()
    if failure is not None:
        raise SnapshotError("the slot's shell is not running: %s" % (failure.get("error"),))
    res = await shell.run(CAPTURE.encode(), "/dev/null", {}, 30.0, STATE_LIMIT)
    if res.get("truncated") or res.get("returncode") != 0:
        raise SnapshotError("could not read the shell's state (exit %s%s): %s" % (
            res.get("returncode"), ", more than %d bytes" % STATE_LIMIT if res.get("truncated") else "",
            (res.get("error") or res.get("output") or "")[:500]))
    text = res.get("output") or ""
    exported = set(_EXPORT_NAME.findall(text))
    gone = sorted(k for k in slot.env if k not in exported and re.match(r"^[A-Za-z_]\w*$", k))
    unset = "".join("builtin unset -v %s\n" % k for k in gone)
    return "{\n%s%s\n} 2>/dev/null\n" % (unset, text)


async def _stop_processes(agent, slot):
    """Stop the slot's shell and processes (waiting for a shell start in progress). Then
    the caller takes ``slot.layer_lock``: no shell starts on the layers it changes."""
    await slot.shell.stop()
    if agent.cgroups:
        agent.cgroups.kill_slot(slot.index)


def _drop_stray_shell(slot):
    """Under ``slot.layer_lock``: a shell that started after :func:`_stop_processes` runs on
    the layer being replaced; kill it (it is never used: ``Shell.ready`` checks its layer).
    A start waiting for the lock is left alone: it starts on the new layer."""
    if slot.shell.proc is not None:
        slot.shell.kill()


async def _stack(agent, slot, frozen, state):
    """Put ``slot`` on a new layer over ``frozen`` with shell state ``state``. The slot
    is claimed, its processes are gone and the caller holds ``slot.layer_lock``."""
    frozen.users += 1
    try:
        layer = await agent.loop.run_in_executor(agent.executor("spawn"), slot.root.build_on, frozen.chain(),
                                                 frozen.ws)
    except BaseException:
        store(agent).unuse(frozen)
        raise
    layer.stack = frozen
    old = slot.root.install(layer)
    slot.ready = True
    if old is not None and old.stack is None and not slot.dirty and slot.root.keep_standby(old):
        old = None  # a fresh layer nobody used: the next tenant's
    if old is not None:
        store(agent).layer_gone(old)
    agent.layer_work(slot.root, old)
    slot.dirty = True  # a reset drops this layer
    if frozen.ws and frozen.ws != slot.ws_path and state:
        # The snapshot's workspace shows at this slot's own: follow it there.
        state += ('case $PWD in %s|%s/*) builtin cd -- "%s${PWD#%s}" 2>/dev/null;; esac\n'
                  % (frozen.ws, frozen.ws, slot.ws_path, frozen.ws))
    slot.replay_text = state or None
    slot.replay = slot.write_ctl("state", state.encode("utf-8", "surrogatepass")) if state else None


async def snapshot(agent, msg):
    """``{"slot": N, "cap_bytes": int?}`` -> ``{"snapshot", "size_bytes", "depth", "total_bytes"}``."""
    slot = _slot(agent, msg)
    st = store(agent)
    await _claim(slot, msg.get("id"))
    try:
        state = await capture_state(slot)
        size = await agent.loop.run_in_executor(agent.executor("files"), diskwatch.layer_bytes, slot.root)
        cap = msg.get("cap_bytes")
        if cap is not None and st.total_bytes() + size > cap:
            raise SnapshotError(
                "snapshot of slot %d refused: it holds %.1f MiB and the sandbox's snapshots "
                "already %.1f MiB; the cap (snapshot_disk) is %.1f MiB. Release snapshots "
                "(release_snapshot) or raise snapshot_disk." % (
                    slot.index, size / 2**20, st.total_bytes() / 2**20, cap / 2**20))
        await _stop_processes(agent, slot)
        async with slot.layer_lock:
            _drop_stray_shell(slot)
            layer = await agent.loop.run_in_executor(agent.executor("spawn"), slot.root.freeze)
            parent = layer.stack if isinstance(layer.stack, Frozen) else None
            frozen = st.add(layer.dir, slot.uid, parent, size, state)  # the layer's use of parent moves here
            frozen.holds = 1
            frozen.ws = slot.ws_path
            await _stack(agent, slot, frozen, state)
    finally:
        slot.set_idle()
    agent.prestart(slot)
    return {"snapshot": frozen.id, "size_bytes": size, "depth": len(frozen.chain()),
            "total_bytes": st.total_bytes()}


async def fork(agent, msg):
    """``{"slot": N, "snapshot": id}``: slot N (free, just reset) starts from the snapshot."""
    slot = _slot(agent, msg)
    frozen = store(agent).get(msg.get("snapshot"))
    await _claim(slot, msg.get("id"), prepare=False)
    try:
        await _stop_processes(agent, slot)
        slot.background_sids = []
        async with slot.layer_lock:
            _drop_stray_shell(slot)
            await _stack(agent, slot, frozen, frozen.state)
    finally:
        slot.set_idle()
    # No shell is started here: a group of forks would start all of theirs at once, on
    # the cores the forks need; each starts on its first call, as in a fresh slot.
    return {"snapshot": frozen.id, "slot": slot.index}
