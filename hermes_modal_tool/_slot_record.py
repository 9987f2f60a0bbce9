"""The pool's record of one slot (:class:`SlotRecord`), in a module of its own so that the
pool's method groups (``resets.py``, ``_pool_usage.py``) can name it without importing
``pool.py`` back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .slots import Slot

if TYPE_CHECKING:
    from .sandbox import Sandbox


@dataclass(eq=False)
class SlotRecord:
    """The pool's own view of a slot; a public :class:`Slot` is one lease of it."""

    sandbox: Sandbox
    index: int
    slot_id: str
    workspace_dir: str
    lease: int = 0
    holder: Slot | None = None
    inflight: int = 0
    ready: bool = True
    offered: float = 0.0  # when it was last offered (time.monotonic())
    promised: bool = False  # handed to a waiting acquire that has not leased it yet
    extra: dict[str, Any] = field(default_factory=dict)
