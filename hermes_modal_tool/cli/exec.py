"""``hermes-modal-tool exec``: one command in a fresh slot, its exit code passed through.

The command's output streams live: its stdout to this process's stdout and its stderr
to stderr, byte for byte (the call asks for ``encoding="bytes"``); written from the
event loop, so a slow reader of this process's output slows the command down (its
output waits in the sandbox), as a terminal would.
"""

from __future__ import annotations

import math
import shlex
import sys
from typing import Any

import click

from ..backend import ToolBackend
from ..errors import HermesModalToolError
from ..protocol import MAX_TIMEOUT_S, TIMEOUT_EXIT_CODE
from ..slots import ExecutionResult, OutputEvent
from ._common import Stopped, make_profiles, run_stoppable

#: Exit code of ``exec`` when the engine could not run the command (as ``docker run``).
ENGINE_FAILURE_EXIT_CODE = 125


@click.command("exec", context_settings={"allow_interspersed_args": False})
@click.option("--profiles-file", type=click.Path(dir_okay=False),
              help="A modal_profiles.yaml (default: one local profile).")
@click.option("--profile", help="Profile to run in (default: the file's default).")
@click.option("--timeout", type=click.FloatRange(0, MAX_TIMEOUT_S, min_open=True),
              help="Seconds before the command is killed (exit code 124) [profile's execution_timeout_s].")
@click.option("--stdin", "use_stdin", is_flag=True, help="Pass this process's stdin to the command.")
@click.argument("command", nargs=-1, required=True)
def exec_(profiles_file: str | None, profile: str | None, timeout: float | None, use_stdin: bool,
          command: tuple[str, ...]) -> None:
    """Run COMMAND in a fresh slot, print its output, exit with its exit code.

    One argument is a shell command line ('echo hi | wc -c'); several are a
    program and its arguments (sh -c 'exit 7'). Exit code 124 on timeout, 125
    when the command could not be run.
    """
    line = command[0] if len(command) == 1 else shlex.join(command)
    profiles, name = make_profiles(profiles_file, profile,
                                   defaults={"slots_per_sandbox": 1, "min_sandboxes": 1, "max_sandboxes": 1},
                                   overrides={})
    profiles[name] = profiles[name].model_copy(update={"min_sandboxes": min(profiles[name].min_sandboxes, 1)})
    args: dict[str, Any] = {"command": line, "encoding": "bytes"}
    if timeout is not None:
        if not math.isfinite(timeout):  # FloatRange lets NaN through
            raise click.BadParameter(f"must be a finite number of seconds, got {timeout!r}",
                                     param_hint="'--timeout'")
        args["timeout"] = timeout
    if use_stdin:
        args["stdin"] = click.get_text_stream("stdin").read()

    shown = {"stdout": 0, "stderr": 0}

    def show(event: OutputEvent) -> None:
        out = sys.stdout if event.stream == "stdout" else sys.stderr
        data = event.data if isinstance(event.data, bytes) else event.data.encode()
        out.buffer.write(data)
        out.flush()
        shown[event.stream] += len(data)

    async def run() -> ExecutionResult:
        backend = ToolBackend(profiles=profiles, default_profile=name)
        try:
            slot = await backend.acquire("cli-exec")
            return await backend.execute(slot, "bash", args, on_output=show)
        finally:
            await backend.stop()

    try:
        r = run_stoppable(run())
    except HermesModalToolError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(ENGINE_FAILURE_EXIT_CODE)
    except KeyboardInterrupt:
        sys.exit(130)
    except Stopped as exc:
        click.echo(f"error: stopped by {exc}; the sandbox was stopped", err=True)
        sys.exit(exc.exit_code)
    if not any(shown.values()):  # nothing ran (the shell did not start): what it printed
        click.echo(r.output, nl=False)
    for stream, total in (("stdout", r.metadata.get("stdout_bytes")), ("stderr", r.metadata.get("stderr_bytes"))):
        if isinstance(total, int) and total > shown[stream]:
            click.echo(f"note: output capped: {shown[stream]} of the {total} bytes the command "
                       f"wrote to {stream} are shown", err=True)
    rc = r.returncode
    if r.error and (r.metadata.get("timed_out") or rc is None or rc >= 128):
        click.echo(f"error: {r.error}", err=True)  # a timeout, a kill, an engine failure
    if r.metadata.get("timed_out"):
        sys.exit(TIMEOUT_EXIT_CODE)
    sys.exit(ENGINE_FAILURE_EXIT_CODE if rc is None else rc)
