"""Images on the local driver: cold start (unpack), cached sandbox start, slot start, against
a container run of the same image (podman or docker, where one works here).

    .venv/bin/python benchmarks/images.py [--repeats 5] [--slots 10] [--json out.json]

The Debian image (bookworm, minbase + python3, see :mod:`hermes_modal_tool.testing.images`)
is built once with ``mmdebstrap`` and turned into an OCI layout with ``umoci``; it is kept
outside the repository (``$HMT_BENCH_CACHE``, default ``/var/cache/hermes-modal-tool-bench``),
not rebuilt per run; the tests' attack suite uses it too.
Every figure is printed with its peer measured in the same run: the host-root profile
(same engine, no image) as the floor, the container run as the competitor.

Targets (the issue's): cached sandbox start <= 100 ms, slot start on an image <= 20 ms,
and at least 10x faster than a container run per trajectory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from hermes_modal_tool import SandboxConfig, ToolBackend
from hermes_modal_tool.images import ImageCache
from hermes_modal_tool.testing.images import debian_image


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms (min {min(xs) * 1e3:.1f}, n={len(xs)})"


def config(name: str, image: str | None, slots: int) -> SandboxConfig:
    fields = {"name": name, "slots_per_sandbox": slots, "min_sandboxes": 1, "max_sandboxes": 1}
    if image:
        fields["image"] = image
    return SandboxConfig(**fields)


async def sandbox_start(name: str, image: str | None, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        backend = ToolBackend(config(name, image, 1))
        t0 = time.perf_counter()
        await backend.start()
        times.append(time.perf_counter() - t0)
        await backend.stop()
    return times


async def slot_start(name: str, image: str | None, slots: int) -> list[float]:
    """Per trajectory: acquire a fresh slot and run ``true`` in it (its shell starts in its
    own layer over the image), then release (its layer dropped)."""
    backend = ToolBackend(config(name, image, slots))
    await backend.start()
    times = []
    try:
        await backend.execute_batch([(await backend.acquire("warm"), "bash", {"command": "true"})])
        for i in range(slots * 2):
            t0 = time.perf_counter()
            slot = await backend.acquire(f"t{i}")
            [r] = await backend.execute_batch([(slot, "bash", {"command": "true"})])
            times.append(time.perf_counter() - t0)
            assert r.returncode == 0, r.output
            await backend.release(slot)
    finally:
        await backend.stop()
    return times


def container_run(image_layout: str, repeats: int) -> tuple[str, list[float] | str]:
    """``podman run --rm IMAGE true`` (or docker) on the same image, when a tool works.

    Where podman's defaults do not run here (crun refuses a hybrid cgroup hierarchy; its
    default rlimits exceed this machine's hard limits) it is retried with runc and this
    machine's limits; the label names the flags used."""
    layout = image_layout[len("oci:"):]
    why = []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    variants = [[], ["--runtime", "runc", "--ulimit", f"nofile={nofile}:{nofile}",
                     "--ulimit", "nproc=4096:4096"]]
    for tool in ("podman", "docker"):
        path = shutil.which(tool)
        if path is None:
            why.append(f"{tool}: not installed")
            continue
        if tool == "podman":
            load = subprocess.run([path, "pull", "-q", f"oci:{layout}"], capture_output=True,
                                  text=True)
            ref = load.stdout.strip().splitlines()[-1] if load.returncode == 0 else None
        else:
            load = subprocess.run([path, "info"], capture_output=True, text=True)
            ref = None  # docker has no daemon-less way to load an OCI layout here
        if ref is None:
            why.append(f"{tool}: {(load.stderr or load.stdout).strip().splitlines()[-1:]}")
            continue
        for flags in variants:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = subprocess.run([path, "run", "--rm", *flags, ref, "true"],
                                   capture_output=True, text=True)
                times.append(time.perf_counter() - t0)
                if r.returncode != 0:
                    why.append(f"{tool} run {' '.join(flags)}: {r.stderr.strip()[-200:]}")
                    break
            else:
                return " ".join([tool, "run --rm", *flags]), times
    return "none", "; ".join(why)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slots", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    try:
        image = debian_image(log)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    out: dict = {"image": image}
    with tempfile.TemporaryDirectory(prefix="hmt-bench-images-") as cache_dir:
        os.environ["HERMES_MODAL_TOOL_IMAGE_CACHE"] = cache_dir
        t0 = time.perf_counter()
        [cold] = await sandbox_start("img-cold", image, 1)
        entry = ImageCache(cache_dir).list()[0]
        out["cold_start_s"] = cold
        out["unpack"] = {"unpacker": entry["unpacker"], "mb": entry["size_bytes"] / 1e6}
        log(f"cold start took {time.perf_counter() - t0:.1f}s")
        # The same image as an OCI archive: unpacked by the package's own unpacker.
        layout = Path(image[len("oci:"):].rsplit(":", 1)[0])
        archive = layout.with_name(layout.name + ".tar")
        if not archive.exists():
            with tarfile.open(f"{archive}.part", "w") as tar:
                for name in sorted(os.listdir(layout)):
                    tar.add(layout / name, arcname=name)
            os.rename(f"{archive}.part", archive)
        tag = image.rsplit(":", 1)[1]
        os.environ["HERMES_MODAL_TOOL_IMAGE_CACHE"] = os.path.join(cache_dir, "builtin")
        [out["cold_start_builtin_s"]] = await sandbox_start("img-cold2", f"oci-archive:{archive}:{tag}", 1)
        os.environ["HERMES_MODAL_TOOL_IMAGE_CACHE"] = cache_dir
        out["cached_start_s"] = await sandbox_start("img", image, args.repeats)
        out["host_start_s"] = await sandbox_start("host", None, args.repeats)
        out["slot_start_s"] = await slot_start("img-slot", image, args.slots)
        out["host_slot_start_s"] = await slot_start("host-slot", None, args.slots)
    tool, container = container_run(image, args.repeats)
    out["container"] = {"tool": tool, "times_s": container if isinstance(container, list)
                        else None, "why_not": container if isinstance(container, str) else None}
    print(f"image: {image} ({out['unpack']['mb']:.0f} MB unpacked by {out['unpack']['unpacker']})")
    print(f"cold sandbox start (uncached: unpack + start): {cold:.2f} s by "
          f"{out['unpack']['unpacker']}, {out['cold_start_builtin_s']:.2f} s by the builtin "
          "unpacker (the same image as an OCI archive)")
    cached = statistics.median(out["cached_start_s"])
    slot = statistics.median(out["slot_start_s"])
    print(f"cached sandbox start, image:     {ms(out['cached_start_s'])}   target <= 100 ms: "
          f"{'met' if cached <= 0.1 else 'NOT met'}")
    print(f"sandbox start, host root (peer): {ms(out['host_start_s'])}")
    print(f"slot start on the image (acquire + first command): {ms(out['slot_start_s'])}   "
          f"target <= 20 ms: {'met' if slot <= 0.02 else 'NOT met'}")
    print(f"slot start, host root (peer):    {ms(out['host_slot_start_s'])}")
    if isinstance(container, list):
        run_s = statistics.median(container)
        print(f"{tool} IMAGE true: {ms(container)}   ours per trajectory "
              f"{run_s / slot:.0f}x faster (target >= 10x: {'met' if run_s / slot >= 10 else 'NOT met'})")
    else:
        print(f"container run: not measured here ({container})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
