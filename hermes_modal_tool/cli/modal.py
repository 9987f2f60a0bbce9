"""``hermes-modal-tool modal``: manage the Modal sandboxes this package created."""

from __future__ import annotations

import asyncio
import os
import sys
from importlib.util import find_spec
from typing import Any

import click
from rich.table import Table

from ..errors import CredentialsError, HermesModalToolError, install_hint
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
    MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml (log in with 'modal token
    new'), as for the SDK.
    Exit code 0, or 1 when a sandbox could not be terminated or Modal refused.
    """
    if find_spec("modal") is None:
        click.echo(f"the modal extra is not installed: {install_hint('modal')}", err=True)
        sys.exit(2)
    console = make_console()
    try:
        orphans = asyncio.run(_gc(_credentials(), app_name, dry_run, include_other_hosts))
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


LOGIN_HINT = ("Log in with 'modal token new' (it saves a token in Modal's config file), or set "
              "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET (tokens: https://modal.com/settings/tokens)")


def _credentials() -> tuple[str, str]:
    """The token id and secret the SDK would use (environment, then the config file).

    Raises:
        CredentialsError: there are none; the message says what was read and how to log in.
    """
    from modal.config import _profile, config, user_config_path

    token_id, token_secret = config.get("token_id"), config.get("token_secret")
    if token_id and token_secret:
        return token_id, token_secret
    found = (f"no token in its Modal config profile {_profile!r}" if os.path.exists(user_config_path)
             else "no such file")
    raise CredentialsError(f"modal gc: no Modal credentials. Read the MODAL_TOKEN_ID and "
                           f"MODAL_TOKEN_SECRET environment variables (not set) and "
                           f"{user_config_path} ({found}). {LOGIN_HINT}")


async def _gc(credentials: tuple[str, str], app_name: str | None, dry_run: bool,
              include_other_hosts: bool) -> list[Any]:
    """Connect to Modal with ``credentials``, then :func:`collect_orphans`.

    Raises:
        CredentialsError: Modal rejected the credentials (the message says where they
            were read and how to log in).
        HermesModalToolError: Modal cannot be reached, or listing sandboxes failed.
    """
    import modal
    from modal.config import config

    from ..drivers.modal import collect_orphans, credential_source

    try:
        client = await modal.Client.from_credentials.aio(*credentials)
        await client.hello.aio()
    except modal.exception.AuthError as exc:
        raise CredentialsError(f"modal gc: Modal rejected the credentials read from "
                               f"{credential_source()} ({exc}). {LOGIN_HINT}") from None
    except Exception as exc:
        raise HermesModalToolError(f"modal gc: cannot reach Modal at {config.get('server_url')}: "
                                   f"{type(exc).__name__}: {exc}") from None
    try:
        return await collect_orphans(app_name=app_name, terminate=not dry_run,
                                     include_unknown=include_other_hosts, client=client)
    finally:
        await client.close.aio()
