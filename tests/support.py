"""Helpers for the behaviour tests: look at the machine's processes, poll, run bash."""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hermes_modal_tool import ExecutionResult, SandboxConfig, Slot, ToolBackend

#: Every agent's command line contains this (the bootstrap's last line).
AGENT_MARK = b"hermes_modal_tool.agent.main"
#: Slots run as uid_base + slot, with uid_base >= 200000 (when the host runs as root).
SLOT_UID_MIN = 200000
#: Set in every slot of a config made by the make_backend fixture (see Leftovers).
TOKEN_VAR = "HMT_TEST_TOKEN"
#: How much slower than this 2-core machine the tests' default timeouts allow
#: (``HMT_TEST_TIME_SCALE``: an emulated VM of the host matrix sets 10).
TIME_SCALE = float(os.environ.get("HMT_TEST_TIME_SCALE") or 1.0)
#: Small defaults: tests run on a 2-core machine and must stay fast.
SMALL: dict[str, Any] = {
    "slots_per_sandbox": 2,
    "min_sandboxes": 1,
    "max_sandboxes": 2,
    "memory": 1024,
    "acquire_timeout_s": 5.0 * TIME_SCALE,
    "execution_timeout_s": 10.0 * TIME_SCALE,
}
T = TypeVar("T")
SHM_DIR = re.compile(rb"/dev/shm/hermes-modal-tool-[A-Za-z0-9_-]+")  # whole name: -ray-PID-TAG too


# -- looking at the machine ------------------------------------------------------------

@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    comm: str
    cmdline: bytes

    @property
    def is_bwrap(self) -> bool:
        return self.comm == "bwrap"

    @property
    def is_agent(self) -> bool:
        return AGENT_MARK in self.cmdline

    @property
    def is_host_process(self) -> bool:
        """A host process of a split backend (``host_processes=K``)."""
        return b"hermes_modal_tool.hostprocs.worker" in self.cmdline

    @property
    def is_slot_process(self) -> bool:
        return self.uid >= SLOT_UID_MIN


def processes() -> dict[int, Proc]:
    """Every live (non-zombie) process on the machine, by pid."""
    out: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/status") as fh:
                status = fh.read()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        out[pid] = Proc(pid, int(fields["PPid"]), int(fields["Uid"].split()[0]),
                        fields["Name"].strip(), cmdline)
    return out


def environ_of(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def agent_processes() -> dict[int, Proc]:
    """Agent processes started by this test process: its children, or its host processes'
    (``host_processes=K``)."""
    me = os.getpid()
    procs = processes()
    parents = {me} | {pid for pid, p in procs.items() if p.is_host_process and p.ppid == me}
    return {pid: p for pid, p in procs.items() if p.is_agent and p.ppid in parents}


class Leftovers:
    """What the engine leaves behind, told apart from other programs on the machine.

    Ours: agents that are children of this process; processes whose environment
    holds the token (every slot process of a config tagged with it) or whose
    command line names one of our state roots (each slot's bwrap); our state roots,
    and the ``/dev/shm`` control directories our slots' bwrap command lines name.
    """

    def __init__(self, token: str) -> None:
        self.token = f"{TOKEN_VAR}={token}".encode()
        self.roots: set[str] = set()

    def note_roots(self, backend: ToolBackend) -> None:
        """Remember a running backend's state directories (call before stopping it)."""
        status = backend.get_status()
        drivers = [status.get("drivers", {})] + [h["drivers"] for h in status.get("host_processes", ())]
        for info in (i for d in drivers for i in d.values()):
            if info.get("state_root"):
                self.roots.add(info["state_root"])
        for p in self.processes():
            self.roots.update(m.decode() for m in SHM_DIR.findall(p.cmdline))

    def processes(self) -> list[Proc]:
        me = os.getpid()
        roots = [r.encode() for r in self.roots]
        ours = []
        for pid, p in processes().items():
            if pid == me:
                continue
            if ((p.is_agent or p.is_host_process) and p.ppid == me) or any(r in p.cmdline for r in roots) or (
                    (p.is_bwrap or p.is_slot_process) and self.token in environ_of(pid)):
                ours.append(p)
        return ours

    def dirs(self) -> set[str]:
        return {r for r in self.roots if os.path.exists(r)}

    async def remaining(self, grace: float = 2.0) -> tuple[list[Proc], set[str]]:
        """What is still there after up to ``grace`` seconds (for the kernel to reap)."""
        deadline = time.monotonic() + grace
        while True:
            procs, dirs = self.processes(), self.dirs()
            if (not procs and not dirs) or time.monotonic() > deadline:
                return procs, dirs
            await asyncio.sleep(0.05)

    def tag(self, config: SandboxConfig) -> SandboxConfig:
        """A copy of ``config`` whose slots carry the token (so leaks can be found)."""
        token = self.token.decode().split("=", 1)[1]
        return config.model_copy(update={"env_vars": {**config.env_vars, TOKEN_VAR: token}})


def describe(procs: list[Proc]) -> str:
    return "; ".join(f"pid {p.pid} uid {p.uid} {p.comm}: {p.cmdline[:160]!r}" for p in procs)


async def eventually(fetch: Callable[[], Awaitable[T]], check: Callable[[T], Any],
                     timeout: float = 5.0, interval: float = 0.05) -> T:
    """Call ``await fetch()`` until ``check(value)`` holds or ``timeout`` passes; return the last value."""
    deadline = time.monotonic() + timeout
    value = await fetch()
    while not check(value) and time.monotonic() < deadline:
        await asyncio.sleep(interval)
        value = await fetch()
    return value


def settle(check: Callable[[], Any], timeout: float = 5.0) -> Awaitable[Any]:
    """Wait until the synchronous ``check()`` is truthy (or ``timeout``); return its last value."""

    async def fetch() -> Any:
        return check()

    return eventually(fetch, bool, timeout)


def require_agents_sdk() -> None:
    """Skip the calling test module, with a reason, where the OpenAI Agents SDK
    (``agents``) is not installed; under CI (env ``CI=true``) a missing SDK is an error
    instead, so a CI run never passes by skipping these tests. ``scripts/test.sh`` runs
    them in ``.venv-agents`` and leaves them out of the ``.venv`` run."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("agents") is not None:
        return
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("CI=true and the OpenAI Agents SDK ('agents') is not installed here: "
                           "run these tests in .venv-agents (bash scripts/setup.sh agents)")
    pytest.skip("the OpenAI Agents SDK ('agents') is not installed here: these tests run in "
                ".venv-agents (bash scripts/setup.sh agents; scripts/test.sh runs them)",
                allow_module_level=True)


def layered(backend: ToolBackend) -> bool:
    """True when the backend's slots have a layered root of their own (filesystem: overlay)."""
    pools = backend.get_status()["pools"]
    return all(p.get("filesystem") == "overlay" for p in pools.values())


async def bash(backend: ToolBackend, slot: Slot, command: str, **args: Any) -> ExecutionResult:
    """Run one bash command in ``slot``; return its ExecutionResult."""
    [result] = await backend.execute_batch([(slot, "bash", {"command": command, **args})])
    return result


async def slot_host_uid(backend: ToolBackend, slot: Slot) -> int:
    """The host uid ``slot``'s processes run as, read on the host (:func:`slot_host_process`)."""
    return (await slot_host_process(backend, slot))[0]


async def slot_host_process(backend: ToolBackend, slot: Slot) -> tuple[int, int]:
    """``(uid, pid namespace inode)`` of ``slot``'s processes, read on the host: the real uid
    in ``/proc/<pid>/status`` and the ``/proc/<pid>/ns/pid`` of a process the slot starts
    (``sleep``, named by a token in its ``argv[0]``), never what the slot says of itself (its
    ``/proc/self/uid_map`` maps to its parent user namespace, which need not be the host's:
    the agent may itself run in a user namespace)."""
    token = f"hmt-uid-{uuid.uuid4().hex[:12]}".encode()
    run = asyncio.ensure_future(bash(backend, slot, f"(exec -a {token.decode()} sleep 3)"))
    try:
        for _ in range(400):
            found = [p for p in processes().values() if p.cmdline.startswith(token + b"\0")]
            if found:
                return found[0].uid, os.stat(f"/proc/{found[0].pid}/ns/pid").st_ino
            if run.done():
                break
            await asyncio.sleep(0.01)
    finally:
        result = await run
    raise AssertionError(f"no process of the slot found on the host: {result}")


@contextmanager
def portal_backend(prefix: str, sizes: dict[str, Any], **fields: Any) -> Iterator[ToolBackend]:
    """A started backend on the portal loop (for sync callers: adapters, the CLI);
    stopped and checked for leftovers on exit. ``prefix`` starts its profile name."""
    from hermes_modal_tool.portal import run_sync

    leftovers = Leftovers(uuid.uuid4().hex)
    config = SandboxConfig(**{"name": prefix + uuid.uuid4().hex[:8], **sizes, **fields})
    backend = ToolBackend(leftovers.tag(config))
    run_sync(backend.start())
    try:
        yield backend
    finally:
        leftovers.note_roots(backend)
        run_sync(asyncio.wait_for(backend.stop(), 30))
        procs, dirs = run_sync(leftovers.remaining())
        assert not procs, f"processes left behind after stop(): {describe(procs)}"
        assert not dirs, f"state directories left behind after stop(): {sorted(dirs)}"


def notebook_text(nb: Any) -> str:
    """Every code cell's text output (stream text, else ``text/plain``), joined by newlines."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def committed_notebook(path: Any) -> Any:
    """Read a committed notebook and check it is valid, fully executed and error-free."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), f"{path}: not every cell was run"
    assert not any(out.get("output_type") == "error" for c in code for out in c.outputs), path
    return nb


def executed_notebook(path: Any, timeout: float = 120) -> Any:
    """Run a notebook top to bottom in its own folder with the .venv's ipykernel (raises on
    the first cell that fails); return it with its fresh outputs."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(Path(path).parent)}}).execute()
    return nb


def _stable_output(cell: Any) -> str:
    """A code cell's text output with what changes from run to run blanked: decimals
    (timings, idle seconds), a local server's port and slot numbers (which free slot a
    session leases depends on timing; tests that need two distinct slots say so)."""
    import re

    text = "".join(out.get("text", "") or out.get("data", {}).get("text/plain", "")
                   for out in cell.get("outputs", []))
    text = re.sub(r"127\.0\.0\.1:\d+", "<addr>", text)
    return re.sub(r"\d+\.\d+", "<n>", re.sub(r"slot_\d+", "slot_<n>", text))


def assert_outputs_current(committed: Any, fresh: Any) -> None:
    """Every code cell of a freshly executed notebook prints what the committed one shows
    (:func:`_stable_output`), so an output the code no longer gives fails, not only a
    missing claim."""
    assert len(committed.cells) == len(fresh.cells)
    for i, (old, new) in enumerate(zip(committed.cells, fresh.cells, strict=True)):
        if new.cell_type == "code":
            assert _stable_output(new) == _stable_output(old), (
                f"cell {i}: the committed output is stale; re-execute the notebook")
