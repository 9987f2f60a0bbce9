"""GPU slots: find the machine's NVIDIA devices and driver files; give them to a slot.

Stdlib-only, Python 3.8. Used by the agent (inside a Modal container it discovers the
container's GPUs itself) and by the local driver on the host (which discovers first,
so that a missing GPU or a type mismatch is a typed error before any agent starts).

What a slot of a ``gpu`` profile gets (see the README's "GPU slots"):

- its assigned ``/dev/nvidia<minor>`` nodes and the control nodes (``nvidiactl``,
  ``nvidia-uvm``, ``nvidia-uvm-tools``, ``nvidia-modeset``, ``nvidia-caps/``) with
  ``bwrap --dev-bind`` (the slot's other ``/dev`` entries are bwrap's minimal set, as
  for every slot);
- ``/sys/bus/pci``, ``/sys/devices`` and ``/sys/module/nvidia*`` read-only (what NVML
  and the CUDA runtime read); ``/proc/driver/nvidia`` is in the slot's own procfs
  already (driver entries are not per pid namespace);
- the driver's files (``libcuda.so*``, ``libnvidia-ml.so*``, ... , ``nvidia-smi``,
  firmware) read-only: at their own paths on the host's root (which may be a mount the
  slot's layered root does not include, e.g. ``/usr/local/nvidia``), or, on an image,
  in the image's own library directory and ``/usr/bin`` as ``nvidia-container-cli``
  does (glibc's loader searches that directory without a cache entry);
- ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` naming the same GPUs (UUIDs
  when known, else minor numbers).

``root`` is ``/`` except in tests: ``HERMES_MODAL_TOOL_GPU_ROOT`` (read by the host,
see :mod:`hermes_modal_tool.gpus`) points discovery at a stand-in tree whose
``dev/``, ``proc/driver/nvidia/``, ``usr/...`` and ``sys/...`` are bound at the same
paths without the prefix.
"""

import os
import re
import stat
import subprocess

#: Control nodes under /dev, given to every GPU slot where present.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
#: The driver's user-space libraries a CUDA program needs (nvidia-container-cli's "compute"
#: and "utility" sets).
LIB_NAMES = ("libcuda.so", "libcudadebugger.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so",
             "libnvidia-nvvm.so", "libnvidia-gpucomp.so", "libnvidia-opencl.so",
             "libnvidia-allocator.so", "libnvidia-cfg.so")
BIN_NAMES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced",
             "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
LIB_DIRS = ("usr/local/nvidia/lib64", "usr/local/nvidia/lib", "usr/lib/x86_64-linux-gnu",
            "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib", "lib/x86_64-linux-gnu", "lib64")
BIN_DIRS = ("usr/local/nvidia/bin", "usr/bin", "usr/local/bin", "bin")
SYS_PARTS = ("sys/bus/pci", "sys/devices", "sys/module/nvidia", "sys/module/nvidia_uvm")
#: Where the MPS control daemon's pipes are seen in a slot.
MPS_PIPE = "/run/nvidia-mps"
_NODE = re.compile(r"^nvidia(\d+)$")


def _under(root, rel):
    return os.path.join(root, rel.lstrip("/"))


def _is_char(path):
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read(65536).decode("utf-8", "replace")
    except OSError:
        return ""


def _gpus_from_proc(root):
    """GPUs from ``proc/driver/nvidia/gpus/*/information`` (model, minor, UUID, bus)."""
    base = _under(root, "proc/driver/nvidia/gpus")
    found = []
    try:
        buses = sorted(os.listdir(base))
    except OSError:
        return found
    for bus in buses:
        fields = {}
        for line in _read(os.path.join(base, bus, "information")).splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        try:
            minor = int(fields.get("device minor", ""))
        except ValueError:
            continue
        found.append({"minor": minor, "name": fields.get("model") or "unknown",
                      "uuid": fields.get("gpu uuid") or None, "bus": fields.get("bus location") or bus})
    return sorted(found, key=lambda g: g["minor"])


def _gpus_from_smi(smi):
    """GPUs from ``nvidia-smi --query-gpu`` (minor taken as the index); [] on failure."""
    try:
        out = subprocess.run([smi, "--query-gpu=index,name,uuid,pci.bus_id", "--format=csv,noheader"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10,
                             check=False).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            found.append({"minor": int(parts[0]), "name": parts[1], "uuid": parts[2] or None,
                          "bus": parts[3]})
    return found


def _ldconfig_dirs():
    """Directories ``ldconfig -p`` lists ``libcuda.so`` in (the host's loader cache)."""
    try:
        out = subprocess.run(["ldconfig", "-p"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             timeout=10, check=False).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.SubprocessError):
        return []
    dirs = []
    for line in out.splitlines():
        if "libcuda.so" in line and "=>" in line:
            d = os.path.dirname(line.split("=>", 1)[1].strip()).lstrip("/")
            if d not in dirs:
                dirs.append(d)
    return dirs


def _driver_files(root):
    """``(libraries, binaries, cached)``: lists of paths relative to ``root`` of the
    driver's files, and whether the loader's cache (``ldconfig -p``) lists the libraries.

    Libraries come from the first directory (``ldconfig -p``'s, then :data:`LIB_DIRS`)
    holding ``libcuda.so*``, every name of :data:`LIB_NAMES` there (symlinks included);
    binaries from the first of :data:`BIN_DIRS` holding each.
    """
    cached = _ldconfig_dirs() if root == "/" else []
    libs = []
    for rel in cached + [d for d in LIB_DIRS if d not in cached]:
        d = _under(root, rel)
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        if not any(n.startswith("libcuda.so") for n in names):
            continue
        libs = [os.path.join(rel, n) for n in names
                if any(n == b or n.startswith(b + ".") for b in LIB_NAMES)]
        break
    bins = []
    for name in BIN_NAMES:
        for rel in BIN_DIRS:
            if os.path.isfile(_under(root, os.path.join(rel, name))):
                bins.append(os.path.join(rel, name))
                break
    return libs, bins, bool(libs) and os.path.dirname(libs[0]) in cached


def _driver_version(root, libs):
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9][0-9.]+)",
                  _read(_under(root, "proc/driver/nvidia/version")))
    if m:
        return m.group(1)
    for rel in libs:
        m = re.match(r"libcuda\.so\.(\d+\.\d+(?:\.\d+)?)$", os.path.basename(rel))
        if m:
            return m.group(1)
    return None


def discover(root="/", cdi=None):
    """What this machine has: a JSON-able dict (see the module docstring for ``root``).

    Args:
        root: ``/``, or a stand-in tree (tests).
        cdi: an already parsed CDI spec for ``nvidia.com/gpu`` (its ``containerEdits``:
            ``deviceNodes``, ``mounts``, ``env``), or None: then the files are discovered.

    Returns:
        ``{"root", "gpus": [{"minor", "name", "uuid", "bus"}], "nodes": [control node
        names under /dev], "caps": bool, "libs": [rel paths], "bins": [rel paths],
        "firmware": [rel paths], "sys": [rel paths], "version", "source", "cdi_env",
        "cdi_mounts": [[host, container]]}``; ``gpus`` empty when there is none.
    """
    gpus = _gpus_from_proc(root)
    source = "/proc/driver/nvidia"
    libs, bins, cached = _driver_files(root)
    if not gpus and root == "/":
        smi = next((_under(root, b) for b in bins if b.endswith("/nvidia-smi")), None)
        gpus = _gpus_from_smi(smi) if smi else []
        source = "nvidia-smi"
    nodes_present = set()
    try:
        nodes_present = set(os.listdir(_under(root, "dev")))
    except OSError:
        pass
    if not gpus:  # device nodes only: GPUs of unknown model
        gpus = [{"minor": int(_NODE.match(n).group(1)), "name": "unknown", "uuid": None, "bus": None}
                for n in sorted(nodes_present) if _NODE.match(n)]
        source = "/dev"
    # Only GPUs whose node exists as a character device can be given to a slot.
    gpus = [g for g in gpus if _is_char(_under(root, "dev/nvidia%d" % g["minor"]))]
    version = _driver_version(root, libs)
    firmware = []
    if version:
        fw = "lib/firmware/nvidia/%s" % version
        if os.path.isdir(_under(root, fw)):
            firmware = [fw]
    found = {
        "root": root, "gpus": gpus, "source": source if gpus else None,
        "nodes": [n for n in CONTROL_NODES if _is_char(_under(root, "dev/" + n))],
        "caps": os.path.isdir(_under(root, "dev/nvidia-caps")),
        "libs": libs, "bins": bins, "firmware": firmware,
        "sys": [p for p in SYS_PARTS if os.path.isdir(_under(root, p))],
        "version": version, "cdi_env": {}, "cdi_mounts": [], "ld_cached": cached,
    }
    if cdi:
        edits = cdi.get("containerEdits") or {}
        found["cdi_env"] = dict(e.split("=", 1) for e in edits.get("env") or () if "=" in e)
        found["cdi_mounts"] = [[m["hostPath"], m["containerPath"]] for m in edits.get("mounts") or ()
                               if m.get("hostPath") and m.get("containerPath")]
        found["source_files"] = "cdi"
    return found


def _safe_dir(image_root, rel):
    """True when ``rel`` is a real directory of the image (no symlink on the way)."""
    path = image_root
    for part in rel.split("/"):
        path = os.path.join(path, part)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return False
        except OSError:
            return False
    return True


def image_lib_dir(image_root):
    """Where the image's loader looks without a cache entry: its multiarch directory
    (Debian, Ubuntu), else ``/usr/lib64`` (RHEL, Fedora), else ``/usr/lib``."""
    for rel in ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64"):
        if _safe_dir(image_root, rel):
            return "/" + rel
    return "/usr/lib"


def slot_plan(found, minors, image_root=None, sharing="time-slicing", mps_pipe=None):
    """The bwrap arguments and environment that give a slot the GPUs ``minors``.

    Args:
        found: :func:`discover`'s dict.
        minors: the minor numbers of the GPUs this sandbox's slots get.
        image_root: the unpacked image the slots run on, or None (the host's root).
        sharing: ``"time-slicing"`` or ``"mps"``.
        mps_pipe: the MPS control daemon's pipe directory (host side), bound read-write
            at :data:`MPS_PIPE` when ``sharing == "mps"``.

    Returns:
        ``{"argv": [...], "env": {...}, "path": dir}``; ``argv`` goes after the slot's
        ``--dev /dev`` and root binds (and before any ``--remount-ro /dev``); ``path``: the
        directory of ``nvidia-smi`` in the slot, for its ``PATH``.
    """
    root = found["root"]
    argv = []
    for m in minors:
        argv += ["--dev-bind", _under(root, "dev/nvidia%d" % m), "/dev/nvidia%d" % m]
    for n in found["nodes"]:
        argv += ["--dev-bind", _under(root, "dev/" + n), "/dev/" + n]
    if found["caps"]:
        argv += ["--dev-bind", _under(root, "dev/nvidia-caps"), "/dev/nvidia-caps"]
    for rel in found["sys"]:
        argv += ["--ro-bind", _under(root, rel), "/" + rel]
    files = []
    env = dict(found.get("cdi_env") or {})
    path = None
    if image_root:
        path = "/usr/bin"
        lib_dir = image_lib_dir(image_root)
        files += [(_under(root, r), lib_dir + "/" + os.path.basename(r)) for r in found["libs"]]
        files += [(_under(root, r), "/usr/bin/" + os.path.basename(r)) for r in found["bins"]]
    else:
        files += [(_under(root, r), "/" + r) for r in found["libs"] + found["bins"]]
        # Where the host's loader finds them only through its environment (a driver under
        # /usr/local/nvidia, say), the slot's gets that too; nvidia-smi's directory joins PATH.
        if found["libs"] and not found.get("ld_cached"):
            env["LD_LIBRARY_PATH"] = "/" + os.path.dirname(found["libs"][0])
        if found["bins"]:
            path = "/" + os.path.dirname(found["bins"][0])
    files += [(_under(root, r), "/" + r) for r in found["firmware"]]
    files += [tuple(m) for m in found.get("cdi_mounts") or ()]
    for src, dest in files:
        argv += ["--ro-bind", src, dest]
    uuids = [g["uuid"] for g in found["gpus"] if g["minor"] in minors]
    visible = ",".join(uuids) if len(uuids) == len(minors) and all(uuids) else ",".join(
        str(m) for m in minors)
    env.update({"CUDA_VISIBLE_DEVICES": visible, "NVIDIA_VISIBLE_DEVICES": visible,
                "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"})
    if sharing == "mps" and mps_pipe:
        argv += ["--bind", mps_pipe, MPS_PIPE]
        env["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE
    return {"argv": argv, "env": env, "path": path}


def mps_slot_env(threads_percent, memory_mb, count):
    """Per-slot MPS limits: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (share of SMs) and
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``"0=NM,1=NM"``, one entry per visible GPU)."""
    env = {}
    if threads_percent:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(threads_percent))
    if memory_mb:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
            "%d=%dM" % (i, int(memory_mb)) for i in range(count))
    return env


class GpuMissing(RuntimeError):
    """No GPU (or not of the type asked) for a gpu profile's slots: the host raises
    ``GpuUnavailableError`` for it (the reply's ``kind``)."""


def _tokens(text):
    return [t for t in re.split(r"[^A-Z0-9]+", text.upper()) if t]


def matches(name, gpu_type):
    """True when a GPU's model name (``"NVIDIA H100 80GB HBM3"``) is of Modal's type
    (``"H100"``, ``"A100-40GB"``, ``"H100!"``): each part of the type is a word of the
    name (``A10`` does not match ``A10G``); ``None`` (``any``) matches every GPU."""
    if gpu_type is None:
        return True
    words = _tokens(name)
    return all(t in words for t in _tokens(gpu_type))


def select(found, gpu_type, count, start=0):
    """``(minors, problem)``: ``count`` GPUs of ``gpu_type`` (None: any), taken
    round-robin from the ``start``-th matching one; ``minors`` None and ``problem`` a
    sentence saying what was asked and what was found when there are not enough."""
    have = found["gpus"]
    fit = [g for g in have if matches(g["name"], gpu_type)]
    asked = "%d x %s" % (count, gpu_type or "any GPU")
    if not have:
        return None, "asked for %s; this machine has no NVIDIA GPU (no /dev/nvidia<N> device)" % asked
    seen = ", ".join("%s (/dev/nvidia%d)" % (g["name"], g["minor"]) for g in have)
    if not fit:
        return None, "asked for %s; found %s" % (asked, seen)
    if len(fit) < count:
        return None, "asked for %s; found only %d of that type: %s" % (asked, len(fit), seen)
    first = start % len(fit)
    chosen = [fit[(first + i) % len(fit)]["minor"] for i in range(count)]
    return sorted(chosen), ""


class AgentGpu:
    """What the agent does for a ``gpu`` profile: the slots' bwrap arguments and
    environment, the MPS daemon, and the report for ``get_status()``.

    ``cfg`` (from the driver's ``init``): ``found`` (:func:`discover`'s dict, or None:
    discover here, as on Modal), ``root``, ``type``, ``count``, ``minors`` (or None:
    select here), ``sharing``, ``mps`` (``{"threads": %, "memory_mb": MiB}``), ``profile``.

    Raises:
        GpuMissing: no GPU, or not of the type asked (names the profile).
    """

    def __init__(self, cfg, state_dir, image_root):
        found = cfg.get("found") or discover(cfg.get("root") or "/")
        minors = cfg.get("minors")
        if minors is None:
            minors, problem = select(found, cfg.get("type"), int(cfg.get("count") or 1))
            if minors is None:
                raise GpuMissing("profile %r: no GPU for its slots: %s" % (cfg.get("profile"), problem))
        self.minors = list(minors)
        self.sharing = cfg.get("sharing") or "time-slicing"
        self.mps = None
        note = ""
        plan_pipe = None
        if self.sharing == "mps":
            control = next((_under(found["root"], b) for b in found["bins"]
                            if b.endswith("/nvidia-cuda-mps-control")), None)
            visible = slot_plan(found, self.minors)["env"]["CUDA_VISIBLE_DEVICES"]  # as the slots'
            if control is None:
                note = "nvidia-cuda-mps-control not found: time-slicing instead"
            else:
                mps = Mps(control, state_dir, visible)
                if mps.start():
                    self.mps, plan_pipe = mps, mps.pipe
                else:
                    note = mps.error + ": time-slicing instead"
        plan = slot_plan(found, self.minors, image_root, "mps" if self.mps else "time-slicing",
                         plan_pipe)
        self.argv = plan["argv"]
        self.env = plan["env"]
        self.path = plan["path"]
        if self.mps:
            limits = cfg.get("mps") or {}
            self.env.update(mps_slot_env(limits.get("threads"), limits.get("memory_mb"),
                                         len(self.minors)))
        self.report = {
            "gpus": [dict(g) for g in found["gpus"] if g["minor"] in self.minors],
            "devices": ["/dev/nvidia%d" % m for m in self.minors],
            "sharing": "mps" if self.mps else "time-slicing",
            "sharing_note": note,
            "visible_devices": self.env["CUDA_VISIBLE_DEVICES"],
            "driver_version": found.get("version"),
            "driver_files": len(found["libs"]) + len(found["bins"]),
            "mps_limits": {k: v for k, v in self.env.items() if k.startswith("CUDA_MPS_")},
        }

    def workspace_only_argv(self):
        """:attr:`argv` for a slot without a layered root (the sandbox's top-level
        directories bound read-only): a file whose place does not exist there cannot get
        a mount point, so only files already at their place are bound over."""
        out = []
        i = 0
        argv = self.argv
        while i < len(argv):
            op, src, dest = argv[i:i + 3]
            top = dest.strip("/").split("/")[0]
            if op != "--ro-bind" or top in ("dev", "sys", "run", "tmp") or os.path.exists(dest):
                out += [op, src, dest]
            i += 3
        return out

    def slot_env(self, env):
        """``env`` (the slots' environment) with the GPU variables, and ``nvidia-smi``'s
        directory at the end of its ``PATH`` when not there."""
        out = dict(env)
        out.update(self.env)
        dirs = (out.get("PATH") or "").split(":")
        if self.path and self.path not in dirs:
            out["PATH"] = ":".join([d for d in dirs if d] + [self.path])
        return out

    def close(self):
        if self.mps is not None:
            self.mps.stop()


class Mps:
    """The MPS control daemon of one sandbox: started with it, stopped with it.

    It runs as the agent's user with its own pipe and log directories (under the
    sandbox's state directory), so it serves only this sandbox's slots. It never
    changes the GPU's compute mode (``nvidia-smi -c``), MIG layout or clocks.
    """

    def __init__(self, control, state_dir, visible):
        self.control = control
        self.pipe = os.path.join(state_dir, "mps", "pipe")
        self.log = os.path.join(state_dir, "mps", "log")
        self.visible = visible
        self.running = False
        self.error = ""

    def _env(self):
        return {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": self.pipe,
                "CUDA_MPS_LOG_DIRECTORY": self.log, "CUDA_VISIBLE_DEVICES": self.visible}

    def start(self):
        """Start ``nvidia-cuda-mps-control -d``; True when it started (else ``error``)."""
        for d in (self.pipe, self.log):
            os.makedirs(d, mode=0o777, exist_ok=True)
            os.chmod(d, 0o777)  # the slots' own uids connect to its pipes
        try:
            proc = subprocess.run([self.control, "-d"], env=self._env(), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30,
                                  check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            self.error = "could not start %s: %s" % (self.control, exc)
            return False
        if proc.returncode != 0:
            self.error = "%s -d exited with %d: %s" % (
                self.control, proc.returncode, proc.stdout.decode("utf-8", "replace").strip()[:300])
            return False
        self.running = True
        return True

    def stop(self):
        """Ask the daemon to quit (it stops its servers); bounded, never raises."""
        if not self.running:
            return
        self.running = False
        try:
            subprocess.run([self.control], input=b"quit\n", env=self._env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10,
                           check=False)
        except (OSError, subprocess.SubprocessError):
            pass
