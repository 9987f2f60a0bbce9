"""The command line: run a batch of trajectories, one command, or check a profiles file.

Example:
    hermes-modal-tool batch rollouts.jsonl -o results.jsonl
    hermes-modal-tool exec -- python3 -c 'print(6 * 7)'
    hermes-modal-tool profiles check modal_profiles.yaml

Exit codes: ``batch`` 0 when every expectation is met, 1 when one is not (or the
engine failed), 2 for bad input (nothing started); ``exec`` the command's own exit
code, 124 on timeout, 125 when the engine could not run it; ``profiles check`` 0
valid, 1 invalid.
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import IO, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import __version__
from .backend import ToolBackend
from .config import SandboxConfig, load_profiles
from .errors import ConfigError, HermesModalToolError
from .protocol import MAX_TIMEOUT_S, TIMEOUT_EXIT_CODE, TOOL_ARGS, TOOLS, check_args
from .slots import ExecutionResult
from .status import status_table

OUTPUT_CAP = 2000
#: Exit code of ``exec`` when the engine could not run the command (as ``docker run``).
ENGINE_FAILURE_EXIT_CODE = 125

# Each tool's arguments (protocol.TOOL_ARGS) are checked before any sandbox starts.
EXPECT_KEYS = {"returncode": "code", "success": "bool", "timed_out": "bool", "output_contains": "str"}
_TYPE_WORDS = {"str": "a string", "number": "a positive number", "bool": "true or false",
               "int": "a non-negative integer", "code": "an integer", "env": "an object of string values",
               "encoding": "'text' or 'base64'"}


def _type_ok(kind: str, value: Any) -> bool:
    """Type check for ``expect`` values (tool arguments use protocol.check_args)."""
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "code":
        return isinstance(value, int) and not isinstance(value, bool)
    raise AssertionError(kind)


# -- input ------------------------------------------------------------------------------
class InputError(click.ClickException):
    """Bad input (a batch file, a profiles file, an option): exit 2, nothing started."""

    exit_code = 2


@dataclass
class Call:
    tool: str
    args: dict[str, Any]
    expect: dict[str, Any]


@dataclass
class Trajectory:
    id: str
    line: int
    calls: list[Call]
    profile: str | None = None
    meta: Any = None


def _check_call(call: Any, i: int) -> Call:
    where = f"calls[{i}]"
    if not isinstance(call, dict):
        raise ValueError(f"{where}: expected an object, got {type(call).__name__}")
    unknown = set(call) - {"tool", "args", "expect"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, sorted(unknown)))}; "
                         "a call has 'tool', 'args' and optional 'expect'")
    tool = call.get("tool")
    if tool not in TOOL_ARGS:
        raise ValueError(f"{where}: tool {tool!r} is not one of: {', '.join(TOOLS)}")
    args = call.get("args", {})
    if not isinstance(args, dict):
        raise ValueError(f"{where}: 'args' must be an object, got {type(args).__name__}")
    problem = check_args(tool, args)  # the same check the agent makes
    if problem:
        raise ValueError(f"{where}: {problem}")
    expect = call.get("expect")
    if expect is None:
        expect = {"success": True}
    if not isinstance(expect, dict):
        raise ValueError(f"{where}: 'expect' must be an object, got {type(expect).__name__}")
    for key, value in expect.items():
        kind = EXPECT_KEYS.get(key)
        if kind is None:
            raise ValueError(f"{where}: expect has no key {key!r}; it takes: {', '.join(EXPECT_KEYS)}")
        if not _type_ok(kind, value):
            raise ValueError(f"{where}: expect {key!r} must be {_TYPE_WORDS[kind]}, got {value!r:.80}")
    return Call(tool, dict(args), dict(expect))


def parse_batch(path: str) -> list[Trajectory]:
    """Read and validate a batch file; raise InputError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")  # JSONL lines end with \n only (not U+2028 etc.)
        if lines and lines[-1] == "":
            lines.pop()
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    trajectories: list[Trajectory] = []
    seen: dict[str, int] = {}
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        data: Any = None
        try:
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"invalid JSON: {exc}") from None
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            unknown = set(data) - {"id", "profile", "calls", "meta"}
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(map(repr, sorted(unknown)))}; a trajectory "
                                 "has 'id', 'calls' and optional 'profile', 'meta'")
            tid = data.get("id")
            if not isinstance(tid, str) or not tid:
                raise ValueError("missing 'id' (a non-empty string)" if tid is None
                                 else f"'id' must be a non-empty string, got {tid!r:.80}")
            if tid in seen:
                raise ValueError(f"id {tid!r} repeats line {seen[tid]}")
            calls = data.get("calls")
            if not isinstance(calls, list):
                raise ValueError("missing 'calls' (a list)" if calls is None
                                 else f"'calls' must be a list, got {type(calls).__name__}")
            profile = data.get("profile")
            if profile is not None and (not isinstance(profile, str) or not profile):
                raise ValueError(f"'profile' must be a non-empty string, got {profile!r:.80}")
            parsed = [_check_call(c, i) for i, c in enumerate(calls)]
        except ValueError as exc:
            where = f" (id {data['id']!r})" if isinstance(data, dict) and isinstance(data.get("id"), str) else ""
            raise InputError(f"{path}, line {n}{where}: {exc}") from None
        seen[tid] = n
        trajectories.append(Trajectory(tid, n, parsed, profile, data.get("meta")))
    if not trajectories:
        raise InputError(f"{path}: no trajectories (expected one JSON object per line)")
    return trajectories


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


# -- results -------------------------------------------------------------------------
def check_expectations(expect: Mapping[str, Any], r: ExecutionResult) -> list[str]:
    """The expectations ``r`` does not meet, each as 'key: expected X, got Y'."""
    got = {"returncode": r.returncode, "success": r.success,
           "timed_out": bool(r.metadata.get("timed_out"))}
    problems = [f"{key}: expected {json.dumps(expect[key])}, got {json.dumps(got[key])}"
                for key in ("returncode", "success", "timed_out") if key in expect and got[key] != expect[key]]
    needle = expect.get("output_contains")
    if needle is not None and needle not in r.output:
        problems.append(f"output_contains: {needle!r} not in output")
    return problems


def cap_output(text: str, limit: int = OUTPUT_CAP) -> str:
    """Keep the head and the tail of ``text`` (where test summaries and errors are)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters omitted] ...\n{text[-half:]}"


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (``p`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class OrderedWriter:
    """Writes result lines in input order as soon as each one's predecessors are done."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.pending: dict[int, dict[str, Any]] = {}
        self.next = 0

    def put(self, index: int, record: dict[str, Any]) -> None:
        self.pending[index] = record
        while self.next in self.pending:
            self.stream.write(json.dumps(self.pending.pop(self.next), ensure_ascii=False) + "\n")
            self.next += 1
        self.stream.flush()


class ProgressReport:
    """A rich progress bar on a terminal; a few plain lines otherwise (CI logs)."""

    def __init__(self, console: Console, total: int, enabled: bool) -> None:
        self.console, self.total, self.done = console, total, 0
        self.started = time.monotonic()
        self.bar: Progress | None = None
        self.plain = enabled and not console.is_terminal
        self.last_line = (0.0, -1)
        if enabled and console.is_terminal:
            self.bar = Progress(TextColumn("calls"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]} calls/s"), TimeElapsedColumn(),
                                console=console)
            self.task = self.bar.add_task("calls", total=total, rate="-")

    def __enter__(self) -> ProgressReport:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def advance(self, n: int = 1) -> None:
        self.done += n
        elapsed = time.monotonic() - self.started
        if self.bar is not None:
            self.bar.update(self.task, advance=n, rate=f"{self.done / max(elapsed, 1e-9):.0f}")
        elif self.plain:
            # One line per quarter at most, and not more than one every 5 s (but always the end).
            quarter = 4 * self.done // max(self.total, 1)
            last_t, last_q = self.last_line
            if self.done == self.total or (quarter > last_q and elapsed - last_t >= 5.0):
                self.last_line = (elapsed, quarter)
                self.console.print(f"progress: {self.done}/{self.total} calls "
                                   f"({100 * self.done // max(self.total, 1)}%) after {elapsed:.1f}s",
                                   highlight=False)


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    failed_calls: int = 0
    mismatches: int = 0
    not_run: int = 0


async def run_trajectory(backend: ToolBackend, traj: Trajectory, timeout: float | None,
                         limit: asyncio.Semaphore, stats: Stats, advance: Callable[[int], None]) -> dict[str, Any]:
    """Acquire a slot, run the trajectory's calls in order, release (with reset); return its record."""
    record: dict[str, Any] = {"id": traj.id, "profile": traj.profile or backend.default_profile,
                              "slot_id": None, "ok": False, "error": None, "steps": []}
    if traj.meta is not None:
        record["meta"] = traj.meta
    started = time.monotonic()
    async with limit:
        try:
            slot = await backend.acquire(traj.id, traj.profile)
        except HermesModalToolError as exc:
            record["error"] = f"could not acquire a slot: {exc}"
            stats.not_run += len(traj.calls)
            advance(len(traj.calls))
            return record
        record["slot_id"] = slot.slot_id
        try:
            for call in traj.calls:
                t0 = time.perf_counter()
                [r] = await backend.execute_batch([(slot, call.tool, call.args)], timeout_s=timeout)
                stats.latencies.append(time.perf_counter() - t0)
                problems = check_expectations(call.expect, r)
                stats.failed_calls += not r.success
                stats.mismatches += bool(problems)
                step = {"tool": call.tool, "success": r.success, "returncode": r.returncode,
                        "timed_out": bool(r.metadata.get("timed_out")),
                        "duration_s": round(float(r.metadata.get("duration_s") or 0.0), 6),
                        "output": cap_output(r.output), "error": r.error,
                        "expectation_met": not problems}
                if problems:
                    step["mismatches"] = problems
                record["steps"].append(step)
                advance(1)
        finally:
            try:
                await backend.release(slot, reset_workspace=True)
            except HermesModalToolError as exc:
                record["error"] = f"release failed: {exc}"
    record["ok"] = record["error"] is None and all(s["expectation_met"] for s in record["steps"])
    record["duration_s"] = round(time.monotonic() - started, 4)
    return record


async def run_batch(trajectories: list[Trajectory], profiles: dict[str, SandboxConfig], default: str,
                    timeout: float | None, writer: OrderedWriter, progress: ProgressReport) -> dict[str, Any]:
    """Run every trajectory concurrently (bounded by each pool's slots); return summary figures."""
    backend = ToolBackend(profiles=profiles, default_profile=default)
    stats = Stats()
    t_start = time.monotonic()
    ok = 0
    sandboxes = 0
    try:
        used = sorted({t.profile or default for t in trajectories})
        await backend.start(used)
        t_run = time.monotonic()
        # At most as many trajectories wait for a slot as the pool can ever hold, so a
        # long queue never runs into acquire_timeout_s.
        limits = {name: asyncio.Semaphore(p.slots_per_sandbox * p.max_sandboxes) for name, p in profiles.items()}

        async def one(i: int, traj: Trajectory) -> None:
            nonlocal ok
            record = await run_trajectory(backend, traj, timeout, limits[traj.profile or default],
                                          stats, progress.advance)
            ok += record["ok"]
            writer.put(i, record)

        await asyncio.gather(*(one(i, t) for i, t in enumerate(trajectories)))
        t_end = time.monotonic()
        final_status = backend.get_status()
        sandboxes = sum(p.get("sandboxes_started", 0) for p in final_status["pools"].values())
    finally:
        await backend.stop()
    return {"trajectories": len(trajectories), "ok": ok, "calls": len(stats.latencies),
            "not_run": stats.not_run, "failed_calls": stats.failed_calls, "mismatches": stats.mismatches,
            "startup_s": t_run - t_start, "run_s": t_end - t_run, "wall_s": t_end - t_start,
            "p50": percentile(stats.latencies, 50), "p99": percentile(stats.latencies, 99),
            "sandboxes": sandboxes, "status": final_status}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def summary_table(s: Mapping[str, Any]) -> Table:
    table = Table(title="batch summary", show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("trajectories", f"{s['trajectories']} ({s['ok']} met every expectation)"),
        ("calls", str(s["calls"]) + (f" ({s['not_run']} not run)" if s["not_run"] else "")),
        ("failed calls (incl. expected failures)", str(s["failed_calls"])),
        ("expectation mismatches", str(s["mismatches"])),
        ("sandboxes started", str(s["sandboxes"])),
        ("wall time", f"{s['wall_s']:.2f} s (start {s['startup_s']:.2f} s + run {s['run_s']:.2f} s)"),
        ("calls per second", f"{s['calls'] / s['run_s']:.1f}" if s["run_s"] > 0 else "-"),
        ("call latency p50", _ms(s["p50"])),
        ("call latency p99", _ms(s["p99"])),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _console(stderr: bool = False) -> Console:
    """A console; not on a terminal (CI logs, files) it is 120 columns wide instead of 80."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 120)
    return console


# -- commands --------------------------------------------------------------------------
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hermes-modal-tool")
def main() -> None:
    """Isolated shell workspaces (slots) for agent trajectories, pooled in sandboxes."""


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write one JSON result line per trajectory here (default: stdout).")
@click.option("--profiles-file", type=click.Path(dir_okay=False),
              help="A modal_profiles.yaml (default: one local profile).")
@click.option("--profile", help="Profile for trajectories that name none (default: the file's default).")
@click.option("--slots-per-sandbox", type=click.IntRange(1, 4096), help="Override for every profile [16].")
@click.option("--max-sandboxes", type=click.IntRange(1), help="Override for every profile [8].")
@click.option("--timeout", type=click.FloatRange(0, MAX_TIMEOUT_S, min_open=True),
              help="Per-call timeout in seconds (a bash call's own 'timeout' wins).")
@click.option("--no-progress", is_flag=True, help="No progress bar or progress lines.")
def batch(file: str, output: str | None, profiles_file: str | None, profile: str | None,
          slots_per_sandbox: int | None, max_sandboxes: int | None, timeout: float | None,
          no_progress: bool) -> None:
    """Run the trajectories of FILE (JSONL), each in its own slot, all at once.

    Each line: {"id": str, "profile": str?, "meta": any?, "calls": [{"tool": str,
    "args": {...}, "expect": {"returncode": int, "success": bool, "timed_out":
    bool, "output_contains": str}?}]}. A call without "expect" expects success;
    a given "expect" checks only its keys. Exits 0 when every expectation is met,
    1 otherwise, 2 on bad input.
    """
    if timeout is not None and not math.isfinite(timeout):  # FloatRange lets NaN through
        raise InputError(f"--timeout must be a finite number of seconds, got {timeout!r}")
    trajectories = parse_batch(file)
    profiles, default = make_profiles(
        profiles_file, profile, defaults={"slots_per_sandbox": 16, "min_sandboxes": 1, "max_sandboxes": 8},
        overrides={"slots_per_sandbox": slots_per_sandbox, "max_sandboxes": max_sandboxes})
    for t in trajectories:
        if t.profile is not None and t.profile not in profiles:
            raise InputError(f"{file}, line {t.line} (id {t.id!r}): unknown profile {t.profile!r}; "
                             f"profiles: {', '.join(profiles)}")
    try:
        stream = open(output, "w", encoding="utf-8", errors="backslashreplace") if output else sys.stdout
    except OSError as exc:
        raise InputError(f"{output}: cannot write: {exc.strerror}") from None
    console = _console(stderr=output is None)
    total = sum(len(t.calls) for t in trajectories)
    try:
        with ProgressReport(console, total, not no_progress) as progress:
            summary = asyncio.run(run_batch(trajectories, profiles, default, timeout,
                                            OrderedWriter(stream), progress))
    except HermesModalToolError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("interrupted; every sandbox was stopped")
        sys.exit(130)
    finally:
        if stream is not sys.stdout:
            stream.close()
    console.print(summary_table(summary))
    console.print(status_table(summary["status"], title="pools at the end of the batch"))
    failed = summary["trajectories"] - summary["ok"]
    if failed:
        console.print(f"[red]{failed} trajector{'y' if failed == 1 else 'ies'} did not meet "
                      "every expectation[/] (see 'ok', 'error', 'mismatches' in the results)")
    sys.exit(0 if failed == 0 else 1)


@main.command("exec", context_settings={"allow_interspersed_args": False})
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
    args: dict[str, Any] = {"command": line}
    if timeout is not None:
        if not math.isfinite(timeout):  # FloatRange lets NaN through
            raise click.BadParameter(f"must be a finite number of seconds, got {timeout!r}",
                                     param_hint="'--timeout'")
        args["timeout"] = timeout
    if use_stdin:
        args["stdin"] = click.get_text_stream("stdin").read()

    async def run() -> ExecutionResult:
        backend = ToolBackend(profiles=profiles, default_profile=name)
        try:
            slot = await backend.acquire("cli-exec")
            return await backend.execute(slot, "bash", args)
        finally:
            await backend.stop()

    try:
        r = asyncio.run(run())
    except HermesModalToolError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(ENGINE_FAILURE_EXIT_CODE)
    except KeyboardInterrupt:
        sys.exit(130)
    click.echo(r.output, nl=False)
    rc = r.returncode
    if r.error and (r.metadata.get("timed_out") or rc is None or rc >= 128):
        click.echo(f"error: {r.error}", err=True)  # a timeout, a kill, an engine failure
    if r.metadata.get("timed_out"):
        sys.exit(TIMEOUT_EXIT_CODE)
    sys.exit(ENGINE_FAILURE_EXIT_CODE if rc is None else rc)


@main.group()
def profiles() -> None:
    """Inspect sandbox profiles files."""


@profiles.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def profiles_check(file: str) -> None:
    """Validate a profiles YAML FILE and show its profiles (exit 1 when invalid).

    Values from ATROPOS_MODAL_* / TERMINAL_MODAL_* environment variables apply,
    as they do when the engine loads the file.
    """
    console = _console()
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
                      f"{p.min_sandboxes}-{p.max_sandboxes}", "yes" if p.network else "no",
                      ", ".join(p.secrets) or "-")
    console.print(table)
    modal_users = [n for n, p in loaded.items() if p.driver == "modal"]
    if modal_users and find_spec("modal") is None:
        console.print(f"note: profile(s) {', '.join(modal_users)} use the modal driver; install "
                      "it with: pip install 'hermes-modal-tool[modal]'", markup=False)


@main.group("modal")
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
    from .drivers.modal import collect_orphans

    console = _console()
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
main.add_command(__import__("hermes_modal_tool.mcp_server", fromlist=["mcp_command"]).mcp_command)
