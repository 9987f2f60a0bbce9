"""``hermes-modal-tool profiles``: inspect profiles files."""

from __future__ import annotations

import sys
from importlib.util import find_spec

import click
from rich.table import Table

from ..config import load_profiles
from ..errors import ConfigError, install_hint
from ._common import make_console


@click.group()
def profiles() -> None:
    """Inspect sandbox profiles files."""


@profiles.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def profiles_check(file: str) -> None:
    """Validate a profiles YAML FILE and show its profiles (exit 1 when invalid).

    Values from ATROPOS_MODAL_* / TERMINAL_MODAL_* environment variables apply,
    as they do when the engine loads the file.
    """
    console = make_console()
    try:
        loaded, default = load_profiles(file)
    except ConfigError as exc:
        click.echo(f"invalid: {exc}", err=True)
        sys.exit(1)
    table = Table(title=f"{file}: {len(loaded)} profile(s)", caption="* default profile",
                  title_justify="left", caption_justify="left")
    for col in ("profile", "driver", "image", "gpu", "cpu", "MiB", "slots", "pool", "net", "secrets"):
        table.add_column(col)
    for name, p in loaded.items():
        table.add_row(name + (" *" if name == default else ""), p.driver, p.image, p.gpu or "-",
                      f"{p.cpu:g}", str(p.memory), str(p.slots_per_sandbox),
                      f"{p.min_sandboxes}-{p.max_sandboxes}", p.network,
                      ", ".join(p.secrets) or "-")
    console.print(table)
    modal_users = [n for n, p in loaded.items() if p.driver == "modal"]
    if modal_users and find_spec("modal") is None:
        console.print(f"note: profile(s) {', '.join(modal_users)} use the modal driver; install "
                      f"it with: {install_hint('modal')}", markup=False)
