"""Host processes: one ``ToolBackend`` spread over K processes (``host_processes=K``).

``router.py`` is the caller's side (the methods that reach sandboxes, routed by who holds
the slot or snapshot), ``_router_data.py`` its snapshots, transfers, previews and merged
status, ``host.py`` its handle on one process, ``worker.py`` the process itself and
``wire.py`` what they say to each other.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError

#: Environment variable: the host processes of a backend made without ``host_processes=``
#: (``ToolBackend``, and so the CLI, the MCP server and the adapters); unset: 1.
HOST_PROCESSES_ENV = "HERMES_MODAL_TOOL_HOST_PROCESSES"


def resolve_host_processes(value: Any) -> int:
    """``value`` as a whole number of host processes >= 1; None: :data:`HOST_PROCESSES_ENV`
    (unset or empty: 1).

    Raises:
        ConfigError: not a whole number >= 1 (named with where it came from).
    """
    where = "host_processes"
    if value is None:
        raw = os.environ.get(HOST_PROCESSES_ENV, "").strip()
        if not raw:
            return 1
        where = f"{HOST_PROCESSES_ENV}={os.environ[HOST_PROCESSES_ENV]!r}"
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{where}: expected a whole number >= 1") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be a whole number >= 1, got {value!r}")
    return value
