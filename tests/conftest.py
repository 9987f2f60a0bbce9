"""Shared fixtures: real local sandboxes (bubblewrap), small sizes, always stopped.

``make_backend(**config_fields)`` builds a ``ToolBackend(SandboxConfig(...))`` with
small defaults, starts it, and stops it when the test ends; then it checks that
nothing was left behind: no agent, ``bwrap`` or slot process and no state
directory (``/tmp/hermes-modal-tool-*``, ``/dev/shm/hermes-modal-tool-*``) of
those backends. Leftovers are told apart from other programs' sandboxes (see
``support.Leftovers``), so the check holds while another suite runs too.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from support import SMALL, Leftovers, describe

from hermes_modal_tool import SandboxConfig, Slot, ToolBackend

# No registry on the test machine: profiles naming a registry image (the README's and the
# seed's python:3.11, pytorch ...) keep the host's root filesystem, as before images. The
# image tests (test_images.py) use local images, and set "pull" where they test pulling.
os.environ.setdefault("HERMES_MODAL_TOOL_REGISTRY_IMAGES", "host")
# No GPU on the test machine either: profiles naming a ``gpu`` (the README's and the
# seed's pytorch-gpu) run without one, as documented; test_gpu_slots.py unsets this and
# gives its slots stand-in GPUs.
os.environ.setdefault("HERMES_MODAL_TOOL_GPU", "ignore")

# The OpenAI Agents SDK tests need `openai-agents`, which cannot share an environment with
# `hermes-agent` (openai 3 vs its openai 2 pin): scripts/test.sh runs them in .venv-agents;
# elsewhere they are collected and skipped with the reason (an error under CI=true; see
# support.require_agents_sdk).


class BackendFactory:
    """Makes started backends with small defaults; stops them all at the end."""

    def __init__(self, leftovers: Leftovers) -> None:
        self.leftovers = leftovers
        self.made: list[ToolBackend] = []
        self.profile_name = "t" + uuid.uuid4().hex[:8]

    async def __call__(self, *, config: SandboxConfig | None = None,
                       profiles: dict[str, SandboxConfig] | None = None,
                       default_profile: str | None = None, start: bool = True,
                       host_processes: int = 1, **fields: Any) -> ToolBackend:
        """A backend: ``config=``, or ``profiles=`` (+ ``default_profile=``), or
        ``SandboxConfig(**SMALL | fields)``; started unless ``start=False``; its
        sandboxes spread over ``host_processes``."""
        tag = self.leftovers.tag
        if profiles is not None:
            backend = ToolBackend(profiles={n: tag(c) for n, c in profiles.items()},
                                  default_profile=default_profile, host_processes=host_processes)
        else:
            # A profile name of its own: sandbox ids (and so cgroup names) do not
            # collide with sandboxes another program runs on this machine.
            fields.setdefault("name", self.profile_name)
            backend = ToolBackend(tag(config or SandboxConfig(**{**SMALL, **fields})),
                                  host_processes=host_processes)
        return await self.adopt(backend, start=start)

    async def adopt(self, backend: ToolBackend, start: bool = False) -> ToolBackend:
        """Stop (and check) a backend the test built itself at the end of the test."""
        self.made.append(backend)
        if start:
            await backend.start()
        return backend

    def note(self, backend: ToolBackend) -> None:
        """Remember what a backend created; call before a test stops it itself."""
        self.leftovers.note_roots(backend)

    async def close(self) -> None:
        for backend in self.made:
            self.leftovers.note_roots(backend)
        for backend in self.made:
            await asyncio.wait_for(backend.stop(), 30)


@pytest.fixture
async def make_backend() -> AsyncIterator[BackendFactory]:
    leftovers = Leftovers(uuid.uuid4().hex)
    factory = BackendFactory(leftovers)
    try:
        yield factory
    finally:
        await factory.close()
    procs, dirs = await leftovers.remaining()
    assert not procs, f"processes left behind after stop(): {describe(procs)}"
    assert not dirs, f"state directories left behind after stop(): {sorted(dirs)}"


@pytest.fixture
async def backend(make_backend: BackendFactory) -> ToolBackend:
    """A started backend with the small defaults (2 slots per sandbox, up to 2 sandboxes)."""
    return await make_backend()


@pytest.fixture
async def slot(backend: ToolBackend) -> Slot:
    """A slot held by trajectory ``"traj-test"`` in ``backend``."""
    return await backend.acquire("traj-test")


@pytest.fixture(scope="session")
def modal_server_session() -> Iterator[Any]:
    """The package's local Modal control plane, serving on its own thread for the session."""
    from hermes_modal_tool.testing.modal_server import serve_in_thread

    with serve_in_thread() as server:
        yield server


@pytest.fixture
def modal_server(modal_server_session: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The local Modal control plane, with this test's environment pointing the real
    ``modal`` SDK at it (``MODAL_SERVER_URL``, dummy tokens). Run its coroutines with
    :func:`on_server`."""
    for key, value in modal_server_session.env().items():
        monkeypatch.setenv(key, value)
    return modal_server_session


async def on_server(server: Any, coro: Any) -> Any:
    """Await ``coro`` on the local Modal server's own event loop."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, server.loop))


def running_sandboxes(server: Any, profile: str) -> list[Any]:
    """The server's running sandboxes created for ``profile`` (by its tag)."""
    return [r for r in list(server.sandboxes.values())
            if r.tags.get("hmt-profile") == profile and r.status == "running"]


@pytest.fixture(params=["local", "modal"])
def driver(request: pytest.FixtureRequest) -> str:
    """Each shared behaviour test runs once per driver; ``modal`` runs against the
    local Modal control plane. A module may add ``local-hosts`` (test_shared_behaviour.py):
    the local driver with the sandboxes spread over two host processes
    (``host_processes=2``), made by ``driver_backend``."""
    if request.param == "modal":
        request.getfixturevalue("modal_server")
    return request.param


@pytest.fixture
async def driver_backend(make_backend: BackendFactory, driver: str, request: pytest.FixtureRequest):
    """``make_backend`` for the parametrized ``driver``; for Modal it also checks that
    ``stop()`` left no sandbox running on the server."""
    made: list[ToolBackend] = []

    async def factory(**fields: Any) -> ToolBackend:
        name = "local" if driver == "local-hosts" else driver
        if driver == "local-hosts":
            fields["host_processes"] = 2
        if "profiles" in fields:
            fields["profiles"] = {n: c.model_copy(update={"driver": name})
                                  for n, c in fields["profiles"].items()}
        else:
            fields["driver"] = name
        backend = await make_backend(**fields)
        made.append(backend)
        return backend

    yield factory
    if driver == "modal":
        server = request.getfixturevalue("modal_server")
        for backend in made:
            make_backend.note(backend)
            await asyncio.wait_for(backend.stop(), 60)
            for name in backend.profiles:
                assert not running_sandboxes(server, name), f"sandboxes of {name} left running"


# -- running in parallel (pytest-xdist; scripts/test.sh runs the suite with -n) ------------
#: Test files that take the longest, slowest first (measured: --durations, junitxml). Under
#: xdist (``--dist loadfile --no-loadscope-reorder``: each file on one worker, so a
#: module-scoped fixture such as the built wheel or an image is made once) they are handed
#: out first, so that the run does not end with one worker still on a minute-long file
#: while the other is idle; the other files keep the collection order.
SLOW_FIRST = (
    "tests/test_ray_driver.py",                 # a two-node Ray cluster: ~40 s to start, 2-3 min
    "tests/test_cli_fork.py",                   # the GRPO example: ~45 s idle, 4 min loaded
    "tests/security/test_attack_stalls.py",
    "tests/security/test_attack_round_two.py",
    "tests/security/test_attack_resources.py",
    "tests/security/test_attack_on_image.py",   # module-scoped images
    "tests/adapters/test_mcp.py",               # CLI subprocesses, a module-scoped server
    "tests/test_wheel.py",                      # build, a fresh venv, round trips
    "tests/test_run_all.py",                    # the benchmarks' smoke run
    "tests/test_docs.py",                       # mkdocs build --strict
    "tests/security/test_attack_forks.py",
    "tests/faults/test_faults.py",
)


#: Tests that time a neighbour's latency or a short grace (tens of ms, a 2 s idle lifetime,
#: a 5 s poll): each failed in a two-worker run on a loaded machine (load 15-30), so
#: scripts/test.sh runs them after the parallel pass, in one process (marker ``alone``).
ALONE = (
    "tests/adapters/test_hermes.py::test_eight_threads_at_once",
    "tests/adapters/test_mcp.py::test_http_tools_shell_and_errors",
    "tests/adapters/test_mcp.py::test_http_requires_the_bearer_token_before_any_tool_runs",
    "tests/faults/test_modal_faults.py::test_modal_sandboxes_of_a_killed_owner_end_themselves",
    "tests/security/test_attack_resources.py::test_a_process_filling_dev_shm_after_its_command_returned_is_held",
    "tests/security/test_attack_round_two.py::test_nothing_a_tenant_started_outlives_its_release",
    "tests/test_deadlines.py::test_due_callbacks_run_in_order_and_dropped_ones_never",
    "tests/test_gpu_slots.py::test_gpu_processes_per_slot_in_status_and_killed_on_release",
    "tests/test_streaming.py::test_a_flooding_slot_does_not_delay_its_neighbour",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: timing-bound; scripts/test.sh runs it in its "
                                       "own pass, not beside another worker (ALONE)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tests of ``ALONE``; in an xdist worker also puts the files of
    ``SLOW_FIRST`` first, in its order (every worker collects the same order, which the
    scheduler hands out); a run in one process keeps the collection order."""
    for item in items:
        if item.nodeid.startswith(ALONE):
            item.add_marker(pytest.mark.alone)
    if not hasattr(config, "workerinput"):
        return

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)
    items.sort(key=rank)  # stable: the collection order within each rank
