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
from ..errors import HermesModalToolError, SetupError
from ..protocol import MAX_TIMEOUT_S
from ..status import status_table
from ..usage import total_usage
from ._batch_file import Call, Trajectory, parse_batch
from ._common import InputError, Stopped, make_console, make_profiles, run_stoppable
from ._expect import check_expectations, strict_problems
from ._live_progress import LiveLines, LiveProgress
from ._transfer_steps import run_call

OUTPUT_CAP = 2000


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
        self.live = LiveLines(console, self.plain) if enabled else None
        if enabled and console.is_terminal:
            self.bar = LiveProgress(TextColumn("calls"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[rate]} calls/s"), TimeElapsedColumn(),
                                    console=console, live=self.live)
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
    expected_failures: int = 0


class Forks:
    """Snapshots of the trajectories others fork from (``fork`` in the batch file)."""

    def __init__(self, backend: ToolBackend, trajectories: list[Trajectory]) -> None:
        self.backend = backend
        self.waiting: dict[str, int] = {}
        for t in trajectories:
            if t.fork is not None:
                self.waiting[t.fork] = self.waiting.get(t.fork, 0) + 1
        loop = asyncio.get_running_loop()
        self.snaps: dict[str, asyncio.Future] = {tid: loop.create_future() for tid in self.waiting}

    async def taken(self, tid: str) -> None:
        """One fork of ``tid`` holds a slot now; the last one lets the snapshot go."""
        self.waiting[tid] -= 1
        if self.waiting[tid] == 0:
            await self.backend.release_snapshot(self.snaps[tid].result())

    def fail(self, tid: str, why: str) -> None:
        fut = self.snaps.get(tid)
        if fut is not None and not fut.done():
            fut.set_exception(HermesModalToolError(f"trajectory {tid!r}, which it forks from, failed: {why}"))

    async def close(self) -> None:
        for fut in self.snaps.values():
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled() and fut.exception() is None:
                await self.backend.release_snapshot(fut.result())


def replayed(traj: Trajectory, by_id: Mapping[str, Trajectory]) -> list[Call]:
    """What a trajectory redoes in its own slot without forks: its source's setup and
    calls first (recursively), then its own setup."""
    chain: list[Call] = []
    if traj.fork is not None:
        src = by_id[traj.fork]
        chain = replayed(src, by_id) + src.calls
    for command in traj.setup or []:
        chain.append(Call("bash", {"command": command, "timeout": 3600.0}, {"success": True}))
    return chain


async def run_trajectory(backend: ToolBackend, traj: Trajectory, timeout: float | None,
                         limit: asyncio.Semaphore, stats: Stats, advance: Callable[[int], None],
                         forks: Forks | None = None, prelude: list[Call] | None = None,
                         live: LiveLines | None = None) -> dict[str, Any]:
    """Acquire a slot (from a shared setup or another trajectory's snapshot when it names
    one), run the trajectory's calls in order, release (with reset); return its record.

    ``forks`` None: no forks or shared setups; ``prelude`` (the setup, and a fork's
    source's calls) runs in the slot first, timed as its setup; ``live`` shows the
    output of its commands as they run."""
    record: dict[str, Any] = {"id": traj.id, "profile": traj.profile or backend.default_profile,
                              "slot_id": None, "ok": False, "error": None, "steps": []}
    if traj.meta is not None:
        record["meta"] = traj.meta
    started = time.monotonic()
    snapshot = None
    if forks is not None and traj.fork is not None:
        try:
            snapshot = await forks.snaps[traj.fork]  # outside the limit: its source needs a slot
        except HermesModalToolError as exc:
            record["error"] = str(exc)
    async with limit:
        slot = None
        if record["error"] is None:
            try:
                if snapshot is not None:
                    slot = await backend.acquire(traj.id, snapshot=snapshot)
                elif forks is not None and traj.setup:
                    slot = await backend.acquire(traj.id, traj.profile, setup=traj.setup)
                else:
                    slot = await backend.acquire(traj.id, traj.profile)
            except SetupError as exc:
                record["error"] = f"setup failed: {exc}"
            except HermesModalToolError as exc:
                record["error"] = f"could not acquire a slot: {exc}"
            finally:
                if snapshot is not None:
                    await forks.taken(traj.fork)  # type: ignore[union-attr,arg-type]
        if slot is None:
            stats.not_run += len(traj.calls)
            advance(len(traj.calls))
            if forks is not None:
                forks.fail(traj.id, record["error"])
            return record
        record["slot_id"] = slot.slot_id
        try:
            for call in prelude or []:
                r = await run_call(backend, slot, call.tool, call.args, timeout)
                if not r.success:
                    record["error"] = (f"setup failed: exit {r.returncode}: {r.error or ''}; output:\n"
                                       + cap_output(r.output))
                    break
            record["setup_s"] = round(time.monotonic() - started, 4)
            t_calls = time.monotonic()
            on_output = live.watch(traj.id) if live is not None else None
            for call in traj.calls if record["error"] is None else []:
                t0 = time.perf_counter()
                r = await run_call(backend, slot, call.tool, call.args, timeout, on_output)
                stats.latencies.append(time.perf_counter() - t0)
                problems = check_expectations(call.expect, r)
                stats.failed_calls += not r.success
                stats.expected_failures += not r.success and not problems and any(
                    k in call.expect for k in ("success", "returncode", "timed_out"))
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
            record["rollout_s"] = round(time.monotonic() - t_calls, 4)
            if forks is not None and traj.id in forks.snaps:
                if record["error"] is None:
                    forks.snaps[traj.id].set_result(await backend.snapshot(slot))
                else:
                    forks.fail(traj.id, record["error"])
        except HermesModalToolError as exc:
            record["error"] = str(exc)
            if forks is not None:
                forks.fail(traj.id, str(exc))
        finally:
            if live is not None:
                live.done(traj.id)
            try:
                used = await backend.release(slot, reset_workspace=True, measure_disk=True)
                if used is not None:
                    record["usage"] = used.as_dict()
            except HermesModalToolError as exc:
                record["error"] = f"release failed: {exc}"
    record["ok"] = record["error"] is None and all(s["expectation_met"] for s in record["steps"])
    record["duration_s"] = round(time.monotonic() - started, 4)
    return record


async def run_batch(trajectories: list[Trajectory], profiles: dict[str, SandboxConfig], default: str,
                    timeout: float | None, writer: OrderedWriter, progress: ProgressReport,
                    use_forks: bool = True, host_processes: int | None = None) -> dict[str, Any]:
    """Run every trajectory concurrently (bounded by each pool's slots); return summary figures.

    ``use_forks`` False: each trajectory redoes its setup (and a fork's source's calls)
    in its own slot, for a comparison with the same file run with forks.
    ``host_processes``: the backend's sandboxes spread over that many host processes
    (None: ``HERMES_MODAL_TOOL_HOST_PROCESSES``, else 1)."""
    backend = ToolBackend(profiles=profiles, default_profile=default, host_processes=host_processes)
    stats = Stats()
    t_start = time.monotonic()
    ok = 0
    sandboxes = 0
    usages: list[dict[str, Any]] = []
    by_id = {t.id: t for t in trajectories}
    forks: Forks | None = None
    try:
        used = sorted({t.profile or default for t in trajectories})
        await backend.start(used)
        t_run = time.monotonic()
        forks = Forks(backend, trajectories) if use_forks else None
        # At most as many trajectories wait for a slot as the pool can ever hold, so a
        # long queue never runs into acquire_timeout_s.
        limits = {name: asyncio.Semaphore(p.slots_per_sandbox * p.max_sandboxes) for name, p in profiles.items()}

        async def one(i: int, traj: Trajectory) -> None:
            nonlocal ok
            record = await run_trajectory(backend, traj, timeout, limits[traj.profile or default],
                                          stats, progress.advance, forks,
                                          None if use_forks else replayed(traj, by_id), progress.live)
            ok += record["ok"]
            if "usage" in record:
                usages.append(record["usage"])
            writer.put(i, record)

        await asyncio.gather(*(one(i, t) for i, t in enumerate(trajectories)))
        t_end = time.monotonic()
        final_status = backend.get_status()
        sandboxes = sum(p.get("sandboxes_started", 0) for p in final_status["pools"].values())
    finally:
        if forks is not None:
            await forks.close()
        await backend.stop()
    return {"trajectories": len(trajectories), "ok": ok, "calls": len(stats.latencies),
            "not_run": stats.not_run, "failed_calls": stats.failed_calls, "mismatches": stats.mismatches,
            "expected_failures": stats.expected_failures,
            "startup_s": t_run - t_start, "run_s": t_end - t_run, "wall_s": t_end - t_start,
            "p50": percentile(stats.latencies, 50), "p99": percentile(stats.latencies, 99),
            "sandboxes": sandboxes, "status": final_status, "forks": use_forks,
            "setups": final_status.get("setups", {}), "usage": total_usage(usages)}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def summary_table(s: Mapping[str, Any]) -> Table:
    table = Table(title="batch summary", show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("trajectories", f"{s['trajectories']} ({s['ok']} met every expectation)"),
        ("calls", str(s["calls"]) + (f" ({s['not_run']} not run)" if s["not_run"] else "")),
        ("failed calls", f"{s['failed_calls']} ({s.get('expected_failures', 0)} of them expected)"),
        ("expectation mismatches", str(s["mismatches"])),
        ("sandboxes started", str(s["sandboxes"])),
        ("wall time", f"{s['wall_s']:.2f} s (start {s['startup_s']:.2f} s + run {s['run_s']:.2f} s)"),
        ("calls per second (calls / run time)", f"{s['calls'] / s['run_s']:.1f}" if s["run_s"] > 0 else "-"),
        ("call latency p50", _ms(s["p50"])),
        ("call latency p99", _ms(s["p99"])),
        ("forks and shared setups", "used" if s.get("forks", True) else "off (--no-fork: each redoes its setup)"),
    ]
    used = s.get("usage")
    if used and used["trajectories"]:
        cpu = ("-" if used["unknown"].get("cpu_user_s") == used["trajectories"]
               else f"{used['cpu_user_s'] + used['cpu_system_s']:.2f} s")
        rows.append(("usage (sum over trajectories)",
                     f"held {used['wall_s']:.2f} s, CPU {cpu}, disk {used['disk_bytes'] / 1e6:.1f} MB, "
                     f"largest peak memory {used['memory_peak_bytes'] / 1e6:.1f} MB"
                     + (f", GPU {used['gpu_s']:.1f} s" if used["gpu_s"] else "")))
    ledgers = [p["usage"] for p in (s.get("status") or {}).get("pools", {}).values() if "usage" in p]
    if ledgers:
        rows.append(("slot time: warm / held / not used by any trajectory",
                     " / ".join(f"{sum(x[k] for x in ledgers):.1f} s" for k in
                                ("slot_seconds", "held_seconds", "unattributed_warm_s"))))
    for key, setup in (s.get("setups") or {}).items():
        rows.append((f"setup {key[:12]}", f"ran {setup['runs']}x, {setup.get('seconds', '-')} s"
                     + (f", {setup['failures']} failed" if setup.get("failures") else "")))
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
@click.option("--strict", is_flag=True,
              help="Refuse the file unless every bash call's output expectation gives its "
                   "'returncode' and every call that runs tests gives 'tests_ran'.")
@click.option("--no-fork", is_flag=True,
              help="No forks or shared setups: each trajectory redoes its setup (and its fork "
                   "source's calls) in its own slot (for comparison).")
@click.option("--host-processes", type=click.IntRange(1, 256), default=None,
              help="Spread each profile's sandboxes over this many host processes, each on its "
                   "own core (ToolBackend(host_processes=K)) [$HERMES_MODAL_TOOL_HOST_PROCESSES, else 1].")
def batch(file: str, output: str | None, profiles_file: str | None, profile: str | None,
          slots_per_sandbox: int | None, max_sandboxes: int | None, timeout: float | None,
          no_progress: bool, no_fork: bool, strict: bool, host_processes: int | None) -> None:
    """Run the trajectories of FILE (JSONL), each in its own slot, all at once.

    Each line: {"id": str, "profile": str?, "meta": any?, "setup": [str]?, "fork":
    str?, "calls": [{"tool": str, "args": {...}, "expect": {"returncode": int,
    "success": bool, "timed_out": bool, "output_contains": str, "output_matches": regex,
    "tests_ran": int}?}]}; a call may also be {"tool": "upload"|"download", "args":
    {"local": path, "remote": path}} (a file or directory; local paths are relative to
    the current directory). A call without "expect" expects success; a given "expect"
    checks its keys, and one about the output alone also expects success. "setup":
    commands run once per distinct setup (shared, snapshotted) that the trajectory
    starts after; "fork": the id of a trajectory whose state after its calls this
    one starts from (files, working directory, exported variables). Exits 0 when every expectation is met,
    1 otherwise, 2 on bad input.
    """
    if timeout is not None and not math.isfinite(timeout):  # FloatRange lets NaN through
        raise InputError(f"--timeout must be a finite number of seconds, got {timeout!r}")
    trajectories = parse_batch(file)
    if strict:
        problems = strict_problems((f"{file}, line {t.line} (id {t.id!r}), calls[{i}]", call)
                                   for t in trajectories for i, call in enumerate(t.calls))
        if problems:
            raise InputError("--strict: " + "\n".join(problems[:20])
                             + (f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""))
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
                                             OrderedWriter(stream), progress, use_forks=not no_fork,
                                             host_processes=host_processes))
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
