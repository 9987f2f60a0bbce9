"""GPU slots on a GPU host: do slots see the GPU, and what does sharing one cost?

Checks first (each printed, the run stops at the first that fails):

1. a slot of a ``gpu`` profile on the host's root: ``nvidia-smi -L`` lists the GPU and a
   small CUDA job (a checked matrix product: the host's PyTorch or CuPy if the slot's
   ``python3`` has them, else a PTX kernel through ``libcuda``'s driver API with
   ctypes: ``benchmarks/_gpu_job.py``) gives the right result;
2. a slot on a CUDA-less image with the driver injected: ``--image`` (any image with
   ``python3``: the same job runs there), else one made here from busybox and the
   host's C library (``nvidia-smi -L`` only).

Then for N in ``--slots`` (1, 4, 16): one sandbox with N slots runs the same job at
once on one GPU; printed per N: time to the first CUDA result per slot (median and
max, from the batch's submission; and from each job's own process start), the
throughput (jobs/s) against one process doing N jobs in a row in one slot, and the
GPU memory per slot (what ``get_status()`` sampled: NVML or ``nvidia-smi``). With
``nvidia-cuda-mps-control`` present (and not ``--no-mps``) the N runs are repeated
with ``gpu_sharing: mps``. The GPU's compute mode, MIG layout and clocks are never
changed.

On a machine without a GPU it prints why and exits with code 3 (nothing measured).

Usage::

    .venv/bin/python benchmarks/gpu.py [--slots 1,4,16] [--n 512] [--image REF] [--no-mps] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine  # noqa: E402

from hermes_modal_tool import SandboxConfig, ToolBackend  # noqa: E402
from hermes_modal_tool.agent.limits import gpu as agent_gpu  # noqa: E402
from hermes_modal_tool.gpus import discovery_root, read_cdi  # noqa: E402

NO_GPU = 3
JOB = (Path(__file__).resolve().parent / "_gpu_job.py").read_text()


def slot_counts(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``; argparse's error for anything else."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(not 1 <= c <= 256 for c in counts):
        raise argparse.ArgumentTypeError(f"expected slot counts 1..256 separated by commas, got {text!r}")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=slot_counts, default=[1, 4, 16], help="slot counts (default 1,4,16)")
    p.add_argument("--n", type=int, default=512, help="matrix size of the job (default 512)")
    p.add_argument("--image", help="a CUDA-less image with python3 (default: busybox + host libc)")
    p.add_argument("--gpu", default="any", help="the profile's gpu (default 'any')")
    p.add_argument("--no-mps", action="store_true", help="skip the MPS runs")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args(argv)


def config(name: str, slots: int, gpu: str, **fields: Any) -> SandboxConfig:
    """One sandbox of ``slots`` slots, each with 3 GiB (a CUDA context and PyTorch take
    about 1) and the machine's cores, so that the host side of the job is not what waits."""
    return SandboxConfig(name=name, gpu=gpu, slots_per_sandbox=slots, min_sandboxes=1, max_sandboxes=1,
                         memory=3072 * slots, cpu=float(min(slots, os.cpu_count() or 1)),
                         execution_timeout_s=600, acquire_timeout_s=120, **fields)


async def bash(backend: ToolBackend, slot: Any, command: str, timeout: float = 600) -> Any:
    [r] = await backend.execute_batch([(slot, "bash", {"command": command})], timeout_s=timeout)
    return r


def job_command(n: int, repeat: int = 1, hold: float = 0.0) -> str:
    return (f"cat > /tmp/gpu_job.py <<'EOF_JOB'\n{JOB}\nEOF_JOB\n"
            f"python3 /tmp/gpu_job.py --n {n} --repeat {repeat} --hold {hold}")


def job_result(r: Any) -> dict[str, Any]:
    for line in reversed(r.output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"ok": False, "error": f"exit {r.returncode}: {r.output[-400:]} {r.error or ''}"}


async def check(label: str, cfg: SandboxConfig, run_job: bool, n: int) -> bool:
    backend = ToolBackend(cfg)
    await backend.start()
    try:
        slot = await backend.acquire("check")
        r = await bash(backend, slot, "nvidia-smi -L || /usr/local/nvidia/bin/nvidia-smi -L; "
                                      "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; ls /dev/nvidia*")
        print(f"[{label}] nvidia-smi -L (exit {r.returncode}):\n  " + r.output.strip().replace("\n", "\n  "))
        ok = r.returncode == 0 and "GPU " in r.output
        if ok and run_job:
            res = job_result(await bash(backend, slot, job_command(n)))
            print(f"[{label}] CUDA job: " + (f"ok via {res['way']}, {res['jobs'][0] * 1000:.1f} ms"
                                             if res.get("ok") else f"FAILED: {res.get('error')}"))
            ok = bool(res.get("ok"))
        return ok
    finally:
        await backend.stop()


def busybox_glibc_image(where: Path) -> str | None:
    """A CUDA-less image: busybox plus the host's C library (what ``nvidia-smi`` links)."""
    busybox = shutil.which("busybox")
    if busybox is None:
        return None
    root = where / "rootfs"
    for d in ("bin", "etc", "tmp", "usr/lib/x86_64-linux-gnu", "lib64", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, root / "bin/busybox")
    for name in ("sh", "ls", "cat", "echo"):
        (root / "bin" / name).symlink_to("busybox")
    smi = shutil.which("nvidia-smi") or "/usr/local/nvidia/bin/nvidia-smi"
    out = subprocess.run(["ldd", smi], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/") and "nvidia" not in path and os.path.exists(path):
            dest = root / ("lib64" if "ld-linux" in path else "usr/lib/x86_64-linux-gnu") / Path(path).name
            shutil.copy2(path, dest)
    return f"dir:{root}"


async def run_n(n_slots: int, args: argparse.Namespace, sharing: str) -> dict[str, Any]:
    backend = ToolBackend(config(f"gpu-n{n_slots}-{sharing}", n_slots, args.gpu, gpu_sharing=sharing))
    await backend.start()
    try:
        slots = [await backend.acquire(f"t{i}") for i in range(n_slots)]
        await asyncio.gather(*(bash(backend, s, "true") for s in slots))  # shells warm
        # Baseline: one process doing N jobs in a row, in one slot.
        t = time.perf_counter()
        base = job_result(await bash(backend, slots[0], job_command(args.n, repeat=n_slots)))
        base_s = time.perf_counter() - t
        if not base.get("ok"):
            return {"slots": n_slots, "sharing": sharing, "error": base.get("error")}
        memory: dict[int, int] = {}

        async def sample() -> None:
            while True:
                [pool] = backend.get_status()["pools"].values()
                for entry in pool["gpu"]["sandboxes"].values():
                    for idx, procs in (entry.get("slots") or {}).items():
                        memory[idx] = max(memory.get(idx, 0), sum(p["used_memory_mib"] for p in procs))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample())
        submitted = time.time()
        t = time.perf_counter()
        results = await backend.execute_batch(
            [(s, "bash", {"command": job_command(args.n, hold=3.0)}) for s in slots], timeout_s=600)
        wall = time.perf_counter() - t - 3.0  # each job held its memory 3 s at the end
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        jobs = [job_result(r) for r in results]
        bad = [j.get("error") for j in jobs if not j.get("ok")]
        if bad:
            return {"slots": n_slots, "sharing": sharing, "error": bad[0]}
        from_submit = [j["first"] - submitted for j in jobs]
        from_start = [j["first"] - j["start"] for j in jobs]
        return {"slots": n_slots, "sharing": sharing, "way": jobs[0]["way"],
                "first_result_s": {"median": statistics.median(from_submit), "max": max(from_submit),
                                   "per_slot": from_submit},
                "first_result_from_process_start_s": statistics.median(from_start),
                "throughput_jobs_s": n_slots / wall, "in_a_row_jobs_s": n_slots / base_s,
                "memory_mib_per_slot": memory}
    finally:
        await backend.stop()


def show(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"N={r['slots']:>3} {r['sharing']:<12} FAILED: {r['error']}")
        return
    f = r["first_result_s"]
    mem = ", ".join(f"{v}" for _, v in sorted(r["memory_mib_per_slot"].items())) or "not sampled"
    print(f"N={r['slots']:>3} {r['sharing']:<12} first result median {f['median']:.2f} s, max {f['max']:.2f} s "
          f"(from process start {r['first_result_from_process_start_s']:.2f} s); "
          f"{r['throughput_jobs_s']:.2f} jobs/s in slots vs {r['in_a_row_jobs_s']:.2f} jobs/s in a row "
          f"(x{r['throughput_jobs_s'] / r['in_a_row_jobs_s']:.2f}); GPU MiB per slot: {mem}")


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["HERMES_MODAL_TOOL_GPU"] = "require"
    root = discovery_root()
    found = agent_gpu.discover(root, read_cdi(root))
    if not found["gpus"]:
        print(f"no NVIDIA GPU on this machine (no /dev/nvidia<N> under {root}, nothing in "
              "/proc/driver/nvidia/gpus): nothing to measure. Run this on a GPU host.")
        return NO_GPU
    print(json.dumps({"machine": machine(), "gpus": found["gpus"], "driver": found["version"]}))
    if not await check("host root", config("gpu-check", 1, args.gpu), True, args.n):
        return 1
    with tempfile.TemporaryDirectory(prefix="hmt-gpu-bench-") as tmp:
        os.chmod(tmp, 0o755)
        image = args.image or await asyncio.to_thread(busybox_glibc_image, Path(tmp))
        if image is None:
            print("[image] skipped: no busybox to make a CUDA-less image from (give --image)")
        elif not await check("CUDA-less image", config("gpu-image", 1, args.gpu, image=image),
                             bool(args.image), args.n):
            return 1
    has_mps = any(b.endswith("/nvidia-cuda-mps-control") for b in found["bins"])
    sharings = ["time-slicing"] + (["mps"] if has_mps and not args.no_mps else [])
    if not has_mps:
        print("MPS: nvidia-cuda-mps-control not found, time-slicing only")
    results = []
    for sharing in sharings:
        for n in args.slots:
            results.append(await run_n(n, args, sharing))
            show(results[-1])
    if args.json:
        text = json.dumps({"gpus": found["gpus"], "results": results}, indent=1)
        await asyncio.to_thread(Path(args.json).write_text, text)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
