"""``hermes-modal-tool images``: the local driver's image cache (list, pull, prune)."""

from __future__ import annotations

import datetime
import sys

import click
from rich.table import Table

from ..errors import ImageError
from ..images import ImageCache
from ..images.local import progress_log
from ._common import make_console

_DIR = click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                    help="The cache directory (default: $HERMES_MODAL_TOOL_IMAGE_CACHE, else "
                         "the user's cache dir).")


@click.group()
def images() -> None:
    """The local driver's unpacked images (cached by digest, shared by every backend)."""


@images.command("list")
@_DIR
def images_list(cache_dir: str | None) -> None:
    """Show the cached images: digest, size, when unpacked, names."""
    cache = ImageCache(cache_dir)
    entries = cache.list()
    table = Table(title=f"{cache.dir}: {len(entries)} image(s), "
                        f"{sum(int(e.get('size_bytes') or 0) for e in entries) / 1e6:.1f} MB",
                  title_justify="left")
    for col in ("digest", "MB", "unpacked", "by", "image"):
        table.add_column(col)
    for e in entries:
        when = datetime.datetime.fromtimestamp(e.get("unpacked_at") or 0).strftime("%Y-%m-%d %H:%M")
        names = ", ".join(sorted({e.get("image", "")} | set(e.get("references") or [])))
        table.add_row(e["digest"][:19], f"{int(e.get('size_bytes') or 0) / 1e6:.1f}", when,
                      e.get("unpacker", "?"), names)
    make_console().print(table)


@images.command("pull")
@click.argument("image")
@_DIR
def images_pull(image: str, cache_dir: str | None) -> None:
    """Pull (a registry reference) and unpack IMAGE into the cache now (exit 1 on failure)."""
    try:
        got = ImageCache(cache_dir).get(image, progress=lambda line, step=None: progress_log.info(
            "%s", line, extra={"image": image, "image_step": step}))
    except ImageError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    click.echo(f"{image}: {got.digest or 'dir'} at {got.rootfs}")


@images.command("prune")
@_DIR
def images_prune(cache_dir: str | None) -> None:
    """Remove every cached image no running sandbox uses."""
    cache = ImageCache(cache_dir)
    removed = cache.prune()
    for e in removed:
        click.echo(f"removed {e['digest']} ({e.get('image')}, "
                   f"{int(e.get('size_bytes') or 0) / 1e6:.1f} MB)")
    click.echo(f"{len(removed)} image(s) removed, {len(cache.list())} kept (in use)")
