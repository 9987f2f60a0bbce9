"""What the commands share: the bad-input error, the profiles to run with, the console,
running a coroutine that SIGTERM and SIGHUP stop as cleanly as Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import click
from rich.console import Console

from .. import loops
from ..config import SandboxConfig, load_profiles
from ..errors import ConfigError, ConfigWarning


class InputError(click.ClickException):
    """Bad input (a batch file, a profiles file, an option): exit 2, nothing started."""

    exit_code = 2


def make_profiles(profiles_file: str | None, profile: str | None, *, defaults: Mapping[str, Any],
                  overrides: Mapping[str, Any]) -> tuple[dict[str, SandboxConfig], str]:
    """The profiles to run with: from ``profiles_file``, else one local default profile.

    Raises:
        InputError: the file is invalid, ``profile`` is unknown, or an override is invalid.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        if profiles_file is None:
            name = profile or "default"
            if name != "default":
                raise InputError(f"--profile {name!r} needs --profiles-file (without one there is "
                                 "only the built-in 'default' profile)")
            profiles = {name: SandboxConfig(**{"name": name, "driver": "local", **defaults, **overrides})}
            return profiles, name
        loaded, default = load_profiles(profiles_file)
        name = profile or default
        if name not in loaded:
            raise InputError(f"{profiles_file}: no profile {name!r}; profiles: {', '.join(loaded)}")
        profiles = {}
        for pname, cfg in loaded.items():
            try:
                profiles[pname] = SandboxConfig(**{**cfg.model_dump(), **overrides})
            except ValueError as exc:
                raise InputError(f"{profiles_file}: profile {pname!r} with "
                                 f"{', '.join(f'{k}={v}' for k, v in overrides.items())}: "
                                 f"{_first_error(exc)}") from None
        return profiles, name
    except ConfigError as exc:
        raise InputError(str(exc)) from None


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(e["msg"] for e in errors())
    return str(exc)


def show_config_warnings() -> None:
    """Print each :class:`ConfigWarning` as one line of ours on stderr, ``warning: MESSAGE``,
    instead of Python's ``file.py:40: ConfigWarning: ...`` and the source line; other
    warnings are shown as Python shows them. Idempotent."""
    import warnings

    shown = warnings.showwarning
    if getattr(shown, "_hermes_cli", False):
        return

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if issubclass(category, ConfigWarning):
            click.echo(f"warning: {message}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    show._hermes_cli = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def make_console(stderr: bool = False) -> Console:
    """A console; not on a terminal (CI logs, files) it is 120 columns wide instead of 80."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 120)
    return console


T = TypeVar("T")
#: Signals that stop a command the way Ctrl-C does (a service manager's stop, a closed terminal).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """Raised by :func:`run_stoppable` when SIGTERM or SIGHUP stopped the command.

    ``exit_code`` is 128 + the signal's number, as a shell reports a process killed by it.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(signal.Signals(signum).name)


def run_stoppable(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, where SIGTERM and SIGHUP cancel ``coro`` as Ctrl-C does.

    So its ``finally`` blocks (``backend.stop()``: every sandbox stopped, their state
    directories removed) run before the process exits. A second signal while those
    run is ignored.

    Raises:
        Stopped: SIGTERM or SIGHUP arrived (after ``coro`` finished unwinding).
        KeyboardInterrupt: Ctrl-C (SIGINT), as with ``asyncio.run``.
    """

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        received: list[int] = []

        def stop(signum: int) -> None:
            if not received:
                received.append(signum)
                task.cancel()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop, sig)
        try:
            return await coro
        except asyncio.CancelledError:
            if received:
                raise Stopped(received[0]) from None
            raise
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    return loops.run(main())  # uvloop when installed (loops.UVLOOP_ENV)
