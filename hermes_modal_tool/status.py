"""A status view: one row per profile's pool, from :meth:`ToolBackend.get_status`.

Example:
    >>> from rich.console import Console
    >>> Console().print(status_table(backend.get_status()))   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table

COLUMNS = ("profile", "driver", "sandboxes", "slots in use", "queue", "calls/s", "calls",
           "failures", "timeouts", "isolation", "last error")


def status_rows(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dict per pool with the view's columns (plain values, for notebooks and logs).

    ``sandboxes`` is ``healthy/total (+starting)``, ``slots in use`` is
    ``acquired/total``, ``queue`` is the number of ``acquire`` calls waiting for a slot.
    """
    rows = []
    for name, p in status.get("pools", {}).items():
        starting = f" (+{p['starting_sandboxes']} starting)" if p.get("starting_sandboxes") else ""
        rows.append({
            "profile": name + (" *" if name == status.get("default_profile") else ""),
            "driver": p.get("driver", "-"),
            "sandboxes": f"{p['healthy_sandboxes']}/{p['sandboxes']}{starting}",
            "slots in use": f"{p['acquired_slots']}/{p['total_slots']}",
            "queue": p["waiting_acquires"],
            "calls/s": p["calls_per_second"],
            "calls": p["calls"],
            "failures": p["failures"],
            "timeouts": p["timeouts"],
            "isolation": f"{p.get('isolation', '-')}, {p.get('limits', '-')}",
            "last error": (p.get("last_error") or "")[:80],
        })
    return rows


def status_table(status: Mapping[str, Any], title: str = "pools") -> Table:
    """A rich table of :func:`status_rows` (``*`` marks the default profile)."""
    table = Table(title=title, title_justify="left", caption="* default profile",
                  caption_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="right" if col in ("queue", "calls/s", "calls", "failures",
                                                         "timeouts") else "left")
    for row in status_rows(status):
        table.add_row(*(str(row[c]) for c in COLUMNS))
    return table
