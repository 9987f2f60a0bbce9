"""``hermes-modal-tool modal``: manage the Modal sandboxes this package created."""

from __future__ import annotations

import asyncio
import sys
from importlib.util import find_spec

import click
from rich.table import Table

from ..errors import HermesModalToolError
from ._common import make_console


@click.group("modal")
def modal_group() -> None:
    """Manage Modal sandboxes this package created (needs the modal extra)."""


@modal_group.command("gc")
@click.option("--app", "app_name", help="Only sandboxes of this Modal app (default: every app).")
@click.option("--dry-run", is_flag=True, help="List the orphans, terminate nothing.")
@click.option("--include-other-hosts", is_flag=True,
              help="Also terminate sandboxes whose owner ran on another host (cannot be checked).")
def modal_gc(app_name: str | None, dry_run: bool, include_other_hosts: bool) -> None:
    """Terminate sandboxes tagged by hermes-modal-tool whose owning process is gone.

    Each sandbox carries its creator's host, pid and pid start time as tags. On this
    host a sandbox is an orphan when that process no longer runs; sandboxes of other
    hosts are only listed unless --include-other-hosts. Credentials come from
    MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml, as for the SDK.
    Exit code 0, or 1 when a sandbox could not be terminated or Modal refused.
    """
    if find_spec("modal") is None:
        click.echo("the modal extra is not installed: pip install 'hermes-modal-tool[modal]'", err=True)
        sys.exit(2)
    from ..drivers.modal import collect_orphans

    console = make_console()
    try:
        orphans = asyncio.run(collect_orphans(app_name=app_name, terminate=not dry_run,
                                              include_unknown=include_other_hosts))
    except HermesModalToolError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    table = Table(title=f"{len(orphans)} orphaned sandbox(es)", title_justify="left")
    for col in ("sandbox", "app", "profile", "owner", "owner alive", "action"):
        table.add_column(col)
    failed = 0
    for o in orphans:
        alive = {None: "unknown (other host)", False: "no", True: "yes"}[o.owner_alive]
        action = ("terminated" if o.terminated else f"failed: {o.error}" if o.error
                  else "listed (dry run)" if dry_run else "kept (other host)")
        failed += bool(o.error)
        table.add_row(o.sandbox_id, o.app, o.profile, o.owner, alive, action)
    console.print(table)
    sys.exit(1 if failed else 0)
