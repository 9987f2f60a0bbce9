"""A status view: one row per profile's pool, from :meth:`ToolBackend.get_status`.

Example:
    >>> print(status_table(backend.get_status()))   # doctest: +SKIP
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

COLUMNS = ("profile", "driver", "sandboxes", "slots in use", "queue", "calls/s", "calls",
           "failures", "timeouts", "isolation", "last error")
#: The table's header of each column (what the value counts), where the key is not enough.
HEADERS = {
    "sandboxes": "sandboxes\nhealthy/all",
    "slots in use": "slots\nused/all",
    "queue": "waiting\nacquires",
    "calls/s": "calls/s\n(10 s)",
}


def status_rows(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dict per pool with the view's columns (plain values, for notebooks and logs).

    ``sandboxes`` is ``healthy/total (+starting)``, ``slots in use`` is
    ``acquired/total``, ``queue`` is the number of ``acquire`` calls waiting for a slot,
    ``calls/s`` the pool's calls finished in the last 10 s divided by 10 (a current rate,
    not an average since the start), ``calls``, ``failures`` and ``timeouts`` counts
    since the pool started.
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


class StatusTable(Table):
    """A rich ``Table`` that ``print()`` also shows as a table (plain text, no colour)."""

    def __str__(self) -> str:
        width = shutil.get_terminal_size((120, 24)).columns
        out = io.StringIO()
        Console(file=out, width=width, color_system=None, highlight=False).print(self)
        return out.getvalue().rstrip("\n")


def status_table(status: Mapping[str, Any], title: str = "pools") -> StatusTable:
    """A table of :func:`status_rows`, one row per pool (``*`` marks the default profile).

    ``print(status_table(backend.get_status()))`` shows it as text; a rich ``Console``
    (or ``rich.print``) renders it with colour. Two-line headers say what each number
    counts: ``sandboxes healthy/all``, ``slots used/all``, ``calls/s (10 s)`` (the calls
    of the last 10 s, per second); ``calls``, ``failures`` and ``timeouts`` count since
    the pool started. The ``last error`` column is shown when a pool has one.

    Args:
        status: :meth:`ToolBackend.get_status` output.
        title: the table's title.
    """
    table = StatusTable(title=title, title_justify="left", caption="* default profile",
                        caption_justify="left")
    rows = status_rows(status)
    columns = [c for c in COLUMNS if c != "last error" or any(r[c] for r in rows)]
    for col in columns:
        table.add_column(HEADERS.get(col, col),
                         justify="right" if col in ("queue", "calls/s", "calls", "failures",
                                                    "timeouts") else "left")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    return table
