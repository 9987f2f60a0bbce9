"""``hermes-modal-tool batch``: run a file of trajectories, each in its own slot, all at once."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..backend import ToolBackend
from ..config import SandboxConfig
from ..errors import HermesModalToolError
from ..protocol import MAX_TIMEOUT_S
from ..slots import ExecutionResult
from ..status import status_table
from ._batch_file import Trajectory, parse_batch
from ._common import InputError, Stopped, make_console, make_profiles, run_stoppable

OUTPUT_CAP = 2000


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
        ("calls per second (calls / run time)", f"{s['calls'] / s['run_s']:.1f}" if s["run_s"] > 0 else "-"),
        ("call latency p50", _ms(s["p50"])),
        ("call latency p99", _ms(s["p99"])),
    ]
    for row in rows:
        table.add_row(*row)
    return table


@click.command()
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
    console = make_console(stderr=output is None)
    total = sum(len(t.calls) for t in trajectories)
    try:
        with ProgressReport(console, total, not no_progress) as progress:
            summary = run_stoppable(run_batch(trajectories, profiles, default, timeout,
                                             OrderedWriter(stream), progress))
    except HermesModalToolError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("interrupted; every sandbox was stopped")
        sys.exit(130)
    except Stopped as exc:
        console.print(f"stopped by {exc}; every sandbox was stopped")
        sys.exit(exc.exit_code)
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
