"""GPU slots on the local driver, without a GPU: stand-in device nodes and driver files.

The stand-in tree (``HERMES_MODAL_TOOL_GPU_ROOT``, a test-only setting) holds character
devices made with ``mknod`` (``nvidia0``..., ``nvidiactl``, ``nvidia-uvm``...), the driver's
``information`` files naming the GPU model, a driver library directory and a fake
``nvidia-smi``. The nodes' major numbers are ones no driver has registered on this host
(``/proc/devices``), taken from the ranges the kernel's devices.txt keeps for local use
(60-63, 120-127; never handed out dynamically), not the NVIDIA driver's own (195 and a
dynamic one): on a GPU host those would reach the real driver (which answers EINVAL to a
stand-in's open) and could hand a slot the real GPU. So on every host, opening a stand-in
node fails with ENXIO ("No such device or address"): the kernel finding no driver for
it, which only happens through a ``--dev-bind`` (a plain ``--bind`` mounts it ``nodev``:
EACCES). Slots are real bubblewrap sandboxes. The host's status sampler reads the
stand-in's ``nvidia-smi`` (``hermes_modal_tool.gpus``: NVML only without a stand-in root).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from support import bash, eventually

from hermes_modal_tool import (
    ConfigError,
    GpuMismatchError,
    GpuUnavailableError,
    SandboxConfig,
    SandboxStartError,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of stand-in devices needs root")

MODEL = "NVIDIA H100 80GB HBM3"
UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000")
VERSION = "580.65.06"
#: Character majors devices.txt reserves for local/experimental use (never allocated
#: dynamically, unlike 234-254 and 384-511 where nvidia-uvm's major lands).
LOCAL_MAJORS = (60, 61, 62, 63, 120, 121, 122, 123, 124, 125, 126, 127)


def registered_char_majors() -> set[int]:
    """The character majors a driver has registered on this host (``/proc/devices``)."""
    text = Path("/proc/devices").read_text()
    chars = text.split("Character devices:", 1)[1].split("Block devices:", 1)[0]
    return {int(line.split()[0]) for line in chars.splitlines() if line.strip()}


def free_majors() -> tuple[int, int]:
    """Two character majors no driver here has (for the GPU and nvidia-uvm stand-ins)."""
    taken = registered_char_majors()
    assert 1 in taken and 5 in taken, taken  # positive control: the kernel's list was read
    free = [m for m in LOCAL_MAJORS if m not in taken]
    if len(free) < 2:
        pytest.skip(f"no two free local-use character majors here (registered: {sorted(taken)})")
    return free[0], free[1]
SMI = """#!/bin/sh
# A stand-in nvidia-smi: -L lists the GPUs; --query-compute-apps lists host processes
# whose command line starts with gpu-job-marker, each "using" 123 MiB.
case "$1" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: UUID0)";;
  --query-compute-apps=*)
    # One grep over every process (a fork per process takes seconds on a loaded host).
    for f in $(grep -l '^gpu-job-marker' /proc/[0-9]*/cmdline 2>/dev/null); do
      p=${f#/proc/}; echo "${p%/cmdline}, 123"
    done;;
esac
""".replace("UUID0", UUIDS[0])
MPS = """#!/bin/sh
# A stand-in MPS control daemon: records how it was called and what it was told.
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> "$(dirname "$0")/../../../../mps.log"
"""


def standin(gpus: int = 2, model: str = MODEL, mps: bool = False) -> Path:
    """A stand-in driver tree: ``gpus`` GPU nodes, control nodes, /proc and driver files.
    World-readable: slots run as their own uids and bwrap opens the sources as them."""
    gpu_major, uvm_major = free_majors()
    root = Path(tempfile.mkdtemp(prefix="hmt-gpu-"))
    os.chmod(root, 0o755)
    (root / "dev/nvidia-caps").mkdir(parents=True)
    (root / "proc/driver/nvidia/gpus").mkdir(parents=True)
    for i in range(gpus):
        os.mknod(root / f"dev/nvidia{i}", 0o666 | stat.S_IFCHR, os.makedev(gpu_major, i))
        info = root / f"proc/driver/nvidia/gpus/0000:0{i + 1}:00.0/information"
        info.parent.mkdir()
        info.write_text(f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {UUIDS[i]}\n"
                        f"Device Minor: \t {i}\nBus Location: \t 0000:0{i + 1}:00.0\n")
    os.mknod(root / "dev/nvidiactl", 0o666 | stat.S_IFCHR, os.makedev(gpu_major, 255))
    os.mknod(root / "dev/nvidia-uvm", 0o666 | stat.S_IFCHR, os.makedev(uvm_major, 0))
    os.mknod(root / "dev/nvidia-uvm-tools", 0o666 | stat.S_IFCHR, os.makedev(uvm_major, 1))
    (root / "proc/driver/nvidia/version").write_text(
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {VERSION}  Sun Jul 20 2025\n")
    (root / "sys/module/nvidia").mkdir(parents=True)
    (root / "sys/module/nvidia/version").write_text(VERSION + "\n")
    (root / "sys/bus/pci/devices").mkdir(parents=True)
    lib = root / "usr/local/nvidia/lib64"
    lib.mkdir(parents=True)
    for name in ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so"):
        (lib / f"{name}.{VERSION}").write_text(f"stand-in {name}\n")
        (lib / f"{name}.1").symlink_to(f"{name}.{VERSION}")
    (lib / "libunrelated.so.1").write_text("not the driver's\n")
    bindir = root / "usr/local/nvidia/bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(SMI)
    if mps:
        (bindir / "nvidia-cuda-mps-control").write_text(MPS)
    for p in bindir.iterdir():
        p.chmod(0o755)
    for where, dirs, _ in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(where, d), 0o755)
    return root


def marked(pid: int) -> bool:
    """True while host process ``pid`` is a slot's stand-in GPU job."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"gpu-job-marker")
    except OSError:
        return False


@pytest.fixture
def gpu_root(monkeypatch):
    roots = []

    def make(**kw) -> Path:
        root = standin(**kw)
        roots.append(root)
        monkeypatch.setenv("HERMES_MODAL_TOOL_GPU_ROOT", str(root))
        return root

    monkeypatch.delenv("HERMES_MODAL_TOOL_GPU", raising=False)
    yield make
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


SEE = ("for n in /dev/nvidia*; do test -c $n && echo char:$n; done; "
       "echo module=$(cat /sys/module/nvidia/version 2>/dev/null); "
       "ls /dev/nvidia-caps >/dev/null 2>&1 && echo caps; "
       "echo visible=$CUDA_VISIBLE_DEVICES nvidia=$NVIDIA_VISIBLE_DEVICES; ")


async def test_slot_sees_assigned_gpu_nodes_driver_files_and_env(make_backend, gpu_root):
    root = gpu_root(gpus=2)
    # Positive control: the host's stand-ins are character devices, of a major no driver
    # here has (so the ENXIO below is the kernel finding no driver, on a GPU host too).
    node = os.stat(root / "dev/nvidia0")
    assert stat.S_ISCHR(node.st_mode) and stat.S_ISCHR(os.stat(root / "dev/nvidia1").st_mode)
    assert os.major(node.st_rdev) not in registered_char_majors() | {195}, os.major(node.st_rdev)
    gpu = SandboxConfig(name="gpu-prof", gpu="H100", slots_per_sandbox=2, min_sandboxes=1,
                        max_sandboxes=1, memory=1024)
    plain = SandboxConfig(name="plain-prof", slots_per_sandbox=1, min_sandboxes=1, max_sandboxes=1,
                          memory=512)
    backend = await make_backend(profiles={"gpu-prof": gpu, "plain-prof": plain},
                                 default_profile="plain-prof")
    a = await backend.acquire("t-a", profile="gpu-prof")
    b = await backend.acquire("t-b", profile="gpu-prof")
    lib = "/usr/local/nvidia/lib64"
    out = (await bash(backend, a, SEE + f"cat {lib}/libcuda.so.1; ls {lib}; "
                      f"echo x > {lib}/libcuda.so.1 || echo ro-lib; "
                      "head -c1 /dev/nvidia0; /usr/local/nvidia/bin/nvidia-smi -L")).output
    # Exactly the assigned GPU (the first sandbox gets the first H100) and the control nodes.
    assert "char:/dev/nvidia0\n" in out and "char:/dev/nvidia1" not in out, out
    assert "char:/dev/nvidiactl" in out and "char:/dev/nvidia-uvm\n" in out, out
    assert "char:/dev/nvidia-uvm-tools" in out and "caps" in out, out
    assert f"visible={UUIDS[0]} nvidia={UUIDS[0]}" in out and f"module={VERSION}" in out, out
    # The driver's files, read-only, and nothing else of the directory.
    assert "stand-in libcuda.so" in out and "libnvidia-ml.so.1" in out, out
    assert "libunrelated" not in out and "ro-lib" in out, out
    # The node was --dev-bind'ed: opening it reached the (missing) driver, not a nodev mount.
    assert "No such device or address" in out and "Permission denied" not in out, out
    assert f"UUID: {UUIDS[0]}" in out, out
    # The second slot of the same sandbox shares the same GPU.
    out_b = (await bash(backend, b, SEE)).output
    assert "char:/dev/nvidia0\n" in out_b and f"visible={UUIDS[0]}" in out_b, out_b
    # Another profile's slot sees no GPU (and the rest of /dev is the usual minimal set).
    c = await backend.acquire("t-c", profile="plain-prof")
    out_c = (await bash(backend, c, SEE + "ls /dev")).output
    assert "char:" not in out_c and "visible= nvidia=" in out_c and "null" in out_c, out_c
    assert "module=\n" in out_c, out_c
    status = backend.get_status()["pools"]
    [given] = status["gpu-prof"]["gpu"]["sandboxes"].values()
    assert given["devices"] == ["/dev/nvidia0"] and given["sharing"] == "time-slicing"
    assert given["gpus"][0]["name"] == MODEL and status["plain-prof"]["gpu"] is None


async def test_gpu_processes_per_slot_in_status_and_killed_on_release(make_backend, gpu_root):
    gpu_root(gpus=1)
    # A workspace-only slot (the sandbox's directories bound read-only, no layered root).
    backend = await make_backend(gpu="any", slots_per_sandbox=2, filesystem="workspace-only")
    slot = await backend.acquire("t-proc")
    out = (await bash(backend, slot, SEE + "(exec -a gpu-job-marker sleep 60) >/dev/null 2>&1 &")).output
    assert "char:/dev/nvidia0" in out and f"visible={UUIDS[0]}" in out and f"module={VERSION}" in out, out

    def slot_procs(status):
        [pool] = status["pools"].values()
        [sb] = pool["gpu"]["sandboxes"].values()
        return sb["slots"].get(int(slot.slot_id.rsplit("_", 1)[-1])) if sb["slots"] else None

    async def status():
        return backend.get_status()

    # The sampler runs the stand-in nvidia-smi (bounded by 5 s) every 2 s, off the loop.
    procs = slot_procs(await eventually(status, lambda s: slot_procs(s), timeout=30))
    assert procs, (await status())["pools"]
    assert len(procs) == 1 and procs[0]["used_memory_mib"] == 123
    pid = procs[0]["pid"]
    assert marked(pid)  # the kernel's view: that host process is the slot's GPU job
    await backend.release(slot, reset_workspace=True)

    async def check():
        return not marked(pid)

    assert await eventually(check, bool)


def test_status_sampler_reads_the_standin_not_this_hosts_nvml(gpu_root, monkeypatch):
    """With a stand-in root the sampler lists the stand-in's processes, even where NVML
    (``pynvml``) is importable and answers for the real GPUs (as on a GPU host)."""
    import subprocess
    import sys
    import types

    from hermes_modal_tool import gpus

    class Proc:
        pid, usedGpuMemory = 4242, 7 << 20

    real = types.ModuleType("pynvml")  # NVML's Python API, answering as a real GPU host's
    real.nvmlInit = real.nvmlShutdown = lambda: None
    real.nvmlDeviceGetCount = lambda: 1
    real.nvmlDeviceGetHandleByIndex = lambda i: i
    real.nvmlDeviceGetComputeRunningProcesses = lambda handle: [Proc()]
    monkeypatch.setitem(sys.modules, "pynvml", real)
    # Positive control: without a stand-in root the sampler reads NVML.
    monkeypatch.delenv("HERMES_MODAL_TOOL_GPU_ROOT", raising=False)
    assert gpus._compute_apps() == ([(4242, 7)], "nvml")
    gpu_root(gpus=1)
    job = subprocess.Popen(["gpu-job-marker", "30"], executable=shutil.which("sleep"))
    try:
        assert eventually_sync(lambda: marked(job.pid))
        procs, how = gpus._compute_apps()
        assert how == "nvidia-smi" and (job.pid, 123) in procs and (4242, 7) not in procs, procs
    finally:
        job.kill()
        job.wait()


def eventually_sync(check, timeout: float = 10.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


async def test_mps_daemon_started_and_stopped_with_the_sandbox(make_backend, gpu_root):
    root = gpu_root(gpus=1, mps=True)
    backend = await make_backend(gpu="H100", gpu_sharing="mps", gpu_mps_threads=25,
                                 gpu_mps_memory=2048, slots_per_sandbox=2)
    slot = await backend.acquire("t-mps")
    out = (await bash(backend, slot, "env | grep ^CUDA_MPS | sort; test -d /run/nvidia-mps && echo pipe")).output
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in out, out
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M" in out, out
    assert "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps" in out and "pipe" in out, out
    log = (root / "mps.log").read_text()
    assert log.startswith("args=-d pipe=/") and "quit" not in log, log
    [pool] = backend.get_status()["pools"].values()
    [sb] = pool["gpu"]["sandboxes"].values()
    assert sb["sharing"] == "mps", sb
    await backend.stop()
    assert "stdin=quit" in (root / "mps.log").read_text()


async def test_no_gpu_fails_with_a_named_error_unless_ignored(make_backend, gpu_root, monkeypatch):
    root = gpu_root(gpus=0)
    assert (root / "usr/local/nvidia/bin/nvidia-smi").exists()  # a driver, no GPU
    backend = await make_backend(name="needs-gpu", gpu="H100", start=False)
    with pytest.raises(GpuUnavailableError) as exc:
        await backend.start()
    msg = str(exc.value)
    assert "needs-gpu" in msg and "H100" in msg and "no NVIDIA GPU" in msg, msg
    assert "HERMES_MODAL_TOOL_GPU=ignore" in msg and isinstance(exc.value, SandboxStartError)
    # The documented setting runs the same profile without a GPU, on purpose.
    monkeypatch.setenv("HERMES_MODAL_TOOL_GPU", "ignore")
    backend = await make_backend(name="needs-gpu", gpu="H100")
    slot = await backend.acquire("t-ignore")
    out = (await bash(backend, slot, SEE)).output
    assert "char:" not in out and "visible= " in out, out
    [pool] = backend.get_status()["pools"].values()
    [sb] = pool["gpu"]["sandboxes"].values()
    assert sb["gpus"] == [] and "ignore" in sb["note"]


async def test_gpu_type_mismatch_names_profile_type_and_what_was_found(make_backend, gpu_root):
    gpu_root(gpus=1, model="Tesla T4")
    backend = await make_backend(name="wants-h100", gpu="H100", start=False)
    with pytest.raises(GpuMismatchError) as exc:
        await backend.start()
    msg = str(exc.value)
    assert "wants-h100" in msg and "H100" in msg and "Tesla T4 (/dev/nvidia0)" in msg, msg
    # Positive control: the same host serves a T4 profile, and two T4s are too many.
    ok = await make_backend(name="wants-t4", gpu="t4")
    slot = await ok.acquire("t-t4")
    assert "char:/dev/nvidia0" in (await bash(ok, slot, SEE)).output
    two = await make_backend(name="wants-two", gpu="T4:2", start=False)
    with pytest.raises(GpuMismatchError, match="found only 1"):
        await two.start()


@pytest.mark.parametrize("value", ["H100:0", "H100:x", "", "H 100", "T4:9"])
def test_gpu_value_errors_name_profile_and_value(value):
    with pytest.raises(ConfigError) as exc:
        SandboxConfig(name="bad-gpu", gpu=value)
    assert "bad-gpu" in str(exc.value) and "gpu" in str(exc.value) and repr(value) in str(exc.value)


@pytest.mark.parametrize("value", ["T4", "h100", "H100:2", "A100-80GB", "H100!", "any", "any:2"])
def test_gpu_values_modal_accepts(value):
    assert SandboxConfig(gpu=value).gpu == value


async def test_modal_driver_passes_gpu_and_its_slots_get_the_containers_gpus(
        make_backend, gpu_root, modal_server, monkeypatch):
    from conftest import running_sandboxes

    from hermes_modal_tool import ModalSandboxConfig

    # A container without a GPU: the agent finds none there and the start fails, named.
    monkeypatch.delenv("HERMES_MODAL_TOOL_GPU_ROOT", raising=False)
    none = await make_backend(config=ModalSandboxConfig(
        name="modal-gpu", gpu="T4:2", slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1),
        start=False)
    with pytest.raises(GpuUnavailableError, match="modal-gpu.*no NVIDIA GPU"):
        await none.start()
    # With stand-in nodes in the container's /dev (as Modal's runtime binds real ones),
    # the agent gives them to the slots as the local driver does.
    gpu_root(gpus=2)
    backend = await make_backend(config=ModalSandboxConfig(
        name="modal-gpu", gpu="T4:2", slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1))
    [record] = running_sandboxes(modal_server, "modal-gpu")
    assert record.gpu == "T4:2"  # what Sandbox.create was given
    slot = await backend.acquire("t-modal")
    out = (await bash(backend, slot, SEE)).output
    assert "char:/dev/nvidia0\n" in out and "char:/dev/nvidia1\n" in out, out
    assert "char:/dev/nvidiactl" in out and "visible=0,1 nvidia=0,1" in out, out
    [pool] = backend.get_status()["pools"].values()
    [sb] = pool["gpu"]["sandboxes"].values()
    assert sb["devices"] == ["/dev/nvidia0", "/dev/nvidia1"] and sb["slots"] is None


async def test_cuda_less_image_gets_the_driver_files_where_its_loader_looks(
        make_backend, gpu_root, tmp_path, monkeypatch):
    from image_builder import busybox_rootfs

    gpu_root(gpus=1)
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_CACHE", str(tmp_path / "cache"))
    image = tmp_path / "rootfs"
    busybox_rootfs(image)  # no driver, no CUDA; a Debian-style multiarch library directory
    (image / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (image / "usr/lib/x86_64-linux-gnu/libimage.so.1").write_text("the image's own\n")
    backend = await make_backend(image=f"dir:{image}", gpu="H100")
    slot = await backend.acquire("t-image")
    lib = "/usr/lib/x86_64-linux-gnu"
    out = (await bash(backend, slot, SEE + f"cat {lib}/libcuda.so.1 {lib}/libimage.so.1; "
                      f"echo x > {lib}/libnvidia-ml.so.1 || echo ro-lib; nvidia-smi -L; "
                      "ls /usr/local/nvidia 2>&1")).output
    assert "char:/dev/nvidia0" in out and f"visible={UUIDS[0]}" in out, out
    assert "stand-in libcuda.so\nthe image's own\n" in out and "ro-lib" in out, out
    assert f"UUID: {UUIDS[0]}" in out and "No such file" in out, out  # in /usr/bin, not the host's path


def run_benchmark(*args: str, root: Path) -> tuple[int, str]:
    import subprocess
    import sys

    env = {**os.environ, "HERMES_MODAL_TOOL_GPU_ROOT": str(root)}
    env.pop("HERMES_MODAL_TOOL_GPU", None)
    bench = Path(__file__).resolve().parent.parent / "benchmarks/gpu.py"
    proc = subprocess.run([sys.executable, str(bench), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_gpu_benchmark_says_so_without_a_gpu_and_checks_slots_with_one(gpu_root):
    code, out = run_benchmark("--slots", "1,0", root=gpu_root(gpus=0))
    assert code == 2 and "--slots: expected slot counts" in out, out
    code, out = run_benchmark(root=gpu_root(gpus=0))
    assert code == 3 and "no NVIDIA GPU on this machine" in out, out
    # Stand-in GPUs: the slot's checks run (nvidia-smi -L, the nodes, the variable); the
    # CUDA job fails, named, on a libcuda that is no library (there is no GPU here).
    code, out = run_benchmark("--slots", "1", root=gpu_root(gpus=1))
    # The listing is the stand-in's (its UUID). On a GPU host the slot's PATH finds the
    # host's own nvidia-smi first (the slot's root is the host's): it finds no driver behind
    # the stand-in nodes and fails, printing why, before the stand-in's runs.
    assert code == 1 and "[host root] nvidia-smi -L (exit 0):\n" in out, out
    assert f"GPU 0: {MODEL} (UUID: {UUIDS[0]})" in out, out
    assert f"CUDA_VISIBLE_DEVICES={UUIDS[0]}" in out and "/dev/nvidia0" in out, out
    assert "[host root] CUDA job: FAILED" in out and "driver: " in out and "libcuda.so.1" in out, out
