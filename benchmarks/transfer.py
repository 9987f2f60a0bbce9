"""Streamed transfer: MB/s of ``backend.upload`` and ``backend.download`` of one large file
against two peers measured in the same run: ``cp`` of the same file on the same disk, and
the *stream* itself (the same bytes in the same frames and window between the host and the
agent, with no file, thread or checksum on either end: ``_transfer_probe.stream_speed``),
and a neighbour slot's ``echo`` round trip (median, p99) meanwhile. For each, the CPU it
cost per MiB on the host (this process) and in the sandbox (its processes), the cores
busy, and the speed that CPU cost allows on all of the machine's cores: a transfer does
the stream's work and, besides, reads, hashes (SHA-256, on both ends) and writes the file.

One sandbox, two slots: the *neighbour* runs ``echo hi`` back to back while the other
slot's file moves; a baseline of the neighbour alone is measured in the same run. The
load average (1 min) before and after each part is recorded: on a shared machine a
transfer is bound by the CPU it gets.

Usage::

    .venv/bin/python benchmarks/transfer.py [--mb 1024] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine  # noqa: E402
from _proc import busy_cpu_s, descendants, process_cpu_s, quantile, thread_cpu_s  # noqa: E402

from hermes_modal_tool import SandboxConfig, ToolBackend  # noqa: E402
from hermes_modal_tool._transfer_probe import stream_speed  # noqa: E402


async def echo_loop(backend: ToolBackend, slot: Any, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        [r] = await backend.execute_batch([(slot, "bash", {"command": "echo hi"})])
        out.append(time.perf_counter() - t0)
        if r.output != "hi\n":
            raise RuntimeError(f"the neighbour's echo came back wrong: {r.output!r} {r.error!r}")
        await asyncio.sleep(0.002)


class CpuSplit:
    """CPU seconds of this process (the host: its loop and threads) and of its descendants
    (the sandbox: the agent, its threads and the slots' processes) over a step, and of the
    rest of the machine; ``per_mib(n)`` gives them in ms per MiB moved and the cores busy.

    It also samples every thread's CPU (every :data:`SAMPLE_S`, in a thread of its own)
    and keeps the busiest: each stage of a transfer is a thread (a loop, a reader, a
    writer, a hash), so on a machine with a core for each, the busiest one bounds the
    speed (``core_per_thread_MBps``); the threads of a stage that hops between the host's
    worker threads count apart, so this bound is an upper one. A process's main thread
    (``main``) is its event loop: it serves the neighbour's calls too."""

    SAMPLE_S = 0.02

    def __enter__(self) -> CpuSplit:
        self.t0, self.busy0 = time.perf_counter(), busy_cpu_s()
        self.host0, self.sandbox0 = self._split()
        self.sampler_tid = -1
        self.first = self._threads()  # (side, pid, tid) -> CPU s at the start
        self.last: dict[tuple[str, int, int], float] = {}
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        return self

    def _threads(self) -> dict[tuple[str, int, int], float]:
        out = {("host", os.getpid(), tid): s for tid, s in thread_cpu_s(os.getpid()).items()
               if tid != self.sampler_tid}
        for pid in descendants(os.getpid(), live_only=True):
            out.update({("sandbox", pid, tid): s for tid, s in thread_cpu_s(pid).items()})
        return out

    def _sample(self) -> None:
        self.sampler_tid = threading.get_native_id()
        c0 = time.thread_time()
        while not self.stop.wait(self.SAMPLE_S):
            self.last.update(self._threads())
        self.sampler_s = time.thread_time() - c0  # not the host's: left out of host_s

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.sampler.join()
        self.last.update(self._threads())
        self.wall_s = time.perf_counter() - self.t0
        host, sandbox = self._split()
        self.host_s, self.sandbox_s = host - self.host0 - self.sampler_s, sandbox - self.sandbox0
        self.other_s = max(0.0, busy_cpu_s() - self.busy0 - self.host_s - self.sandbox_s - self.sampler_s)
        self.threads = {k: v - self.first.get(k, 0.0) for k, v in self.last.items()}

    @staticmethod
    def _split() -> tuple[float, float]:
        t = os.times()
        return t.user + t.system, sum(process_cpu_s(pid) for pid in descendants(os.getpid(), live_only=True))

    def per_mib(self, nbytes: int) -> dict[str, Any]:
        mib = nbytes / 2**20
        busiest = sorted(((s * 1000 / mib, f"{side} {'main' if pid == tid else 'thread'}")
                          for (side, pid, tid), s in self.threads.items()), reverse=True)[:4]
        return {"host_ms_per_MiB": round(self.host_s * 1000 / mib, 2),
                "sandbox_ms_per_MiB": round(self.sandbox_s * 1000 / mib, 2),
                "cores_busy": round((self.host_s + self.sandbox_s) / self.wall_s, 2),
                "other_cores": round(self.other_s / self.wall_s, 2),
                "busiest_threads_ms_per_MiB": [[side, round(ms, 2)] for ms, side in busiest],
                "core_per_thread_MBps": round(1.048576 * 1000 / busiest[0][0], 0) if busiest and busiest[0][0] else None}


async def with_neighbour(backend: ToolBackend, neighbour: Any, work) -> tuple[float, dict[str, Any]]:
    stop = asyncio.Event()
    lat: list[float] = []
    task = asyncio.ensure_future(echo_loop(backend, neighbour, stop, lat))
    load = [round(os.getloadavg()[0], 1)]
    t0 = time.monotonic()
    try:
        await work()
    finally:
        seconds = time.monotonic() - t0
        stop.set()
        await task
    load.append(round(os.getloadavg()[0], 1))
    return seconds, {"load_1min": load, "echoes": len(lat), "p50_ms": round(quantile(lat, 0.5) * 1000, 2),
                     "p99_ms": round(quantile(lat, 0.99) * 1000, 2),
                     "max_ms": round(max(lat, default=float("nan")) * 1000, 2)}


def make_file(path: Path, mb: int) -> None:
    block = os.urandom(1 << 20)
    with open(path, "wb") as fh:
        for i in range(mb):
            fh.write(block[i % 256:] + block[:i % 256])  # not one repeated block


async def main(mb: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hmt-transfer-bench-"))
    src, back, copy = work / "src.bin", work / "back.bin", work / "copy.bin"
    await asyncio.to_thread(make_file, src, mb)
    size = src.stat().st_size
    t0 = time.monotonic()
    await asyncio.to_thread(subprocess.run, ["cp", str(src), str(copy)], check=True)
    cp_s = time.monotonic() - t0
    config = SandboxConfig(name="transfer-bench", slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1,
                           memory=4096, slot_disk=mb * 2 + 64, execution_timeout_s=600)
    out: dict[str, Any] = {"machine": machine(), "mb": mb, "cp_MBps": round(size / 1e6 / cp_s, 1)}
    try:
        async with ToolBackend(config) as backend:
            heavy = await backend.acquire("heavy")
            neighbour = await backend.acquire("neighbour")

            async def idle() -> None:
                await asyncio.sleep(3)

            _, out["neighbour_alone"] = await with_neighbour(backend, neighbour, idle)
            with CpuSplit() as cpu:
                up_s, out["neighbour_during_upload"] = await with_neighbour(
                    backend, neighbour, lambda: backend.upload(heavy, src, "big.bin"))
            out["upload_cpu"] = cpu.per_mib(size)
            with CpuSplit() as cpu:
                down_s, out["neighbour_during_download"] = await with_neighbour(
                    backend, neighbour, lambda: backend.download(heavy, "big.bin", back))
            out["download_cpu"] = cpu.per_mib(size)
            with CpuSplit() as cpu:
                speed = await stream_speed(backend, heavy, size)
            out["stream_cpu"] = cpu.per_mib(2 * size)  # both ways
            out["stream_up_MBps"] = round(speed["up_MBps"], 1)
            out["stream_down_MBps"] = round(speed["down_MBps"], 1)
            out["upload_MBps"] = round(size / 1e6 / up_s, 1)
            out["download_MBps"] = round(size / 1e6 / down_s, 1)
            out["round_trip_equal"] = await asyncio.to_thread(
                lambda: subprocess.run(["cmp", "-s", str(src), str(back)]).returncode == 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="file size in MiB (default 1024)")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--label", help="a name for this run, kept in the JSON (e.g. 'before')")
    parser.add_argument("--hash-thread", choices=("auto", "on", "off"), default="auto",
                        help="each end's SHA-256 in a thread of its own: as its cores allow (auto, "
                             "from 4), always, or never (_transfer_wire.HASH_THREAD)")
    args = parser.parse_args()
    if args.hash_thread != "auto":
        from hermes_modal_tool import _transfer_wire

        if hasattr(_transfer_wire, "HASH_THREAD"):
            _transfer_wire.HASH_THREAD = args.hash_thread == "on"
        else:
            parser.error("--hash-thread: this tree has no hash threads")
    result = asyncio.run(main(args.mb))
    result["hash_thread"] = args.hash_thread
    if args.label:
        result["label"] = args.label
    print(f"{args.mb} MiB: upload {result['upload_MBps']} MB/s, download {result['download_MBps']} MB/s, "
          f"cp {result['cp_MBps']} MB/s; round trip equal: {result['round_trip_equal']}")
    print(f"  stream (same frames and window, no file, thread or checksum): up {result['stream_up_MBps']} MB/s, "
          f"down {result['stream_down_MBps']} MB/s")
    cores = os.cpu_count() or 1
    for key in ("upload_cpu", "download_cpu", "stream_cpu"):
        c = result[key]
        need = c["host_ms_per_MiB"] + c["sandbox_ms_per_MiB"]
        print(f"  {key}: host {c['host_ms_per_MiB']} + sandbox {c['sandbox_ms_per_MiB']} ms of CPU per MiB, "
              f"{c['cores_busy']} cores busy (others {c['other_cores']}); "
              f"all {cores} cores would move {1000 / need * cores * 1.048576 if need else 0:.0f} MB/s; "
              f"busiest threads {', '.join(f'{side} {ms}' for side, ms in c['busiest_threads_ms_per_MiB'])} "
              f"ms/MiB: a core per thread would move {c['core_per_thread_MBps']} MB/s")
    for key in ("neighbour_alone", "neighbour_during_upload", "neighbour_during_download"):
        n = result[key]
        print(f"  {key}: {n['echoes']} echoes, p50 {n['p50_ms']} ms, p99 {n['p99_ms']} ms, max {n['max_ms']} ms"
              f" (load {n['load_1min'][0]} -> {n['load_1min'][1]})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
