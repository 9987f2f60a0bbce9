"""What the backend's method groups use of :class:`~hermes_modal_tool.backend.ToolBackend`.

The groups (``filetransfer.py``, ``processes.py``, ``shared_setup.py``, ``snapshots.py``,
``sandbox_images.py``) are handed the backend; this protocol names the part of it they
use, so that none of them imports ``backend.py`` back (which imports them all). Types
of the groups' own results are ``Any`` here for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .config import SandboxConfig
    from .pool import SandboxPool
    from .slots import ExecutionResult, OutputEvent, Slot
    from .usage import Usage


class BackendView(Protocol):
    """The backend as its method groups see it (``ToolBackend`` satisfies it)."""

    profiles: dict[str, SandboxConfig]
    _pools: dict[str, SandboxPool]
    _id_tag: str

    def profile(self, name: str | None = None) -> SandboxConfig: ...

    async def _pool(self, name: str) -> SandboxPool: ...

    async def acquire(self, trajectory_id: str | None = None, profile: str | None = None,
                      snapshot: Any = None, setup: str | list[str] | None = None) -> Slot: ...

    async def release(self, slot: Slot, reset_workspace: bool = False, *,
                      measure_disk: bool = False) -> Usage | None: ...

    async def execute(self, slot: Slot, tool: str, args: Mapping[str, Any], timeout_s: float | None = None,
                      on_output: Callable[[OutputEvent], Any] | None = None) -> ExecutionResult: ...

    async def snapshot(self, slot: Slot) -> Any: ...

    async def upload(self, slot: Slot, local: Any, remote_path: str, offset: int = 0,
                     resume: bool = False) -> Any: ...

    async def download(self, slot: Slot, remote_path: str, local: Any, offset: int = 0,
                       resume: bool = False) -> Any: ...

    async def start_process(self, slot: Slot, command: str, *, pty: bool = True, rows: int = 24,
                            cols: int = 80, env: Mapping[str, str] | None = None) -> Any: ...

    async def _process_request(self, slot: Slot, action: str, within: float,
                               **fields: Any) -> dict[str, Any]: ...
