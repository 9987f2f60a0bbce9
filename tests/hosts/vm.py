"""Boot a stock Debian kernel in a KVM virtual machine whose root is this host's own
``/`` (read-only over 9p, with a tmpfs overlay on top), or another root filesystem
(``run(root=...)``: the Debian 13 tree of :mod:`tests.hosts.rootfs`), and run one shell
script there.

Used by the host matrix (:mod:`tests.hosts.run`): the same checkout, virtual
environment and tools as here, on another kernel and another cgroup layout (cgroup v2
only). Nothing is written to the host: the VM's writes go to its tmpfs, and what it
reports to a directory shared with it (``out``).

What it needs: ``/dev/kvm``, ``qemu-system-x86_64`` (Debian: ``qemu-system-x86``),
``busybox`` (``busybox-static``) and ``apt-get`` to download the kernel package once
(``linux-image-amd64``'s dependency). Cached in :data:`CACHE` (outside the repository);
:func:`missing` says what is not there.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CACHE = Path(os.environ.get("HERMES_MODAL_TOOL_HOSTS_CACHE", "/var/cache/hermes-modal-tool-hosts"))
#: Modules the initramfs loads (with what they depend on), from the kernel package.
MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")

INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /lower /upper /newroot
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /mods/$m.ko || echo "hosts-vm: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower \
  || { echo "hosts-vm: no 9p root"; echo o > /proc/sysrq-trigger; }
mount -t tmpfs -o mode=755 upper /upper
mkdir -p /upper/u /upper/w
mount -t overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w root /newroot \
  || { echo "hosts-vm: overlay root failed"; echo o > /proc/sysrq-trigger; }
for d in proc sys dev; do mount --move /$d /newroot/$d; done
mkdir -p /newroot/hmt-out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out /newroot/hmt-out
if [ -d /newroot/hmt-out/systemd ]; then  # a cell under systemd: its units, then systemd
  cp /newroot/hmt-out/systemd/* /newroot/etc/systemd/system/
  # This host's / may be a container's (/.dockerenv): systemd would then take the VM for
  # one too and ignore systemd.unit= on the kernel's command line (and boot every unit
  # of the host's default target). The VM is not one; its default target is the cell's.
  rm -f /newroot/.dockerenv /newroot/run/.containerenv
  ln -sf hmt.target /newroot/etc/systemd/system/default.target
  exec switch_root /newroot /lib/systemd/systemd
fi
exec switch_root /newroot /bin/bash /hmt-out/stage2.sh
"""

STAGE2 = r"""#!/bin/bash
# PID 1 on the VM's root (the host's /, copy-on-write in memory).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
echo 1 > /proc/sys/kernel/sysrq
mount -t tmpfs -o mode=1777 tmp /tmp
for d in /run /var/tmp; do mount -t tmpfs -o mode=755 tmp $d; done
chmod 1777 /var/tmp
mkdir -p /dev/pts /dev/shm /run/user
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
umount /sys/fs/cgroup 2>/dev/null  # whatever the host's /sys/fs/cgroup held
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup
ip link set lo up
hostname hosts-vm
bash /hmt-out/cell.sh > /hmt-out/log 2>&1
echo $? > /hmt-out/rc
sync
echo o > /proc/sysrq-trigger
sleep 10
"""

#: Under systemd (``systemd=True``): a target with nothing but the basic system and the
#: cell, which runs as a root service and powers the VM off.
UNITS = {
    "hmt.target": """[Unit]
Description=host matrix cell
Requires=basic.target hmt-cell.service
After=basic.target hmt-cell.service
AllowIsolate=yes
""",
    "hmt-cell.service": """[Unit]
Description=host matrix cell
After=basic.target
[Service]
Type=oneshot
Environment=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
ExecStart=/bin/bash -c 'mount -t tmpfs -o mode=1777 tmp /tmp; echo 1 > /proc/sys/kernel/sysrq; \
  bash /hmt-out/cell.sh > /hmt-out/log 2>&1; echo $? > /hmt-out/rc; sync; echo o > /proc/sysrq-trigger'
StandardOutput=journal+console
""",
    # Masked (an empty unit file): it walks what tmpfiles.d names, which over 9p under
    # emulation takes longer than the whole cell.
    "systemd-tmpfiles-setup.service": "",
}


def accel() -> list[str]:
    """qemu's accelerator: KVM where it runs a stock kernel, else TCG (emulation).

    ``HERMES_MODAL_TOOL_HOSTS_ACCEL`` = ``kvm`` or ``tcg`` forces one. KVM is tried by
    default only where the CPU has ``vmx``/``svm``: a nested KVM without them (PVM,
    ``kvm-pvm`` in the kernel log) boots only kernels built as PVM guests, not Debian's.
    """
    want = os.environ.get("HERMES_MODAL_TOOL_HOSTS_ACCEL")
    if want is None:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
        want = "kvm" if re.search(r"\b(vmx|svm)\b", flags) else "tcg"
    if want == "kvm":
        return ["-enable-kvm", "-cpu", "host"]
    return ["-accel", "tcg,thread=multi", "-cpu", "max"]


def missing() -> str | None:
    """Why the VM cannot run here, or None."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "/dev/kvm is missing or not usable (no KVM here)"
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed (Debian: qemu-system-x86)"
    if not any(os.path.exists(p) for p in BUSYBOX):
        return "busybox is not installed (Debian: busybox-static)"
    if os.geteuid() != 0:
        return "the host matrix runs as root (it shares / with the VM and runs cells as root)"
    if not (CACHE / "debian12" / "vmlinuz").exists() and shutil.which("apt-get") is None:
        return f"no kernel cached in {CACHE} and no apt-get to download one"
    return None


def kernel(name: str = "debian12") -> tuple[Path, Path]:
    """``(vmlinuz, initramfs)`` for Debian's current ``linux-image-amd64``, downloaded
    (``apt-get download``) and unpacked once into ``CACHE/name``."""
    d = CACHE / name
    tag = hashlib.sha256(INIT.encode() + repr(MODULES).encode()).hexdigest()[:12]
    vmlinuz, initrd = d / "vmlinuz", d / (f"initrd-{tag}.cpio")
    if vmlinuz.exists() and initrd.exists():
        return vmlinuz, initrd
    d.mkdir(parents=True, exist_ok=True)
    if vmlinuz.exists() and (d / "modules").is_dir():  # a new init: the same kernel
        _initramfs(d / "modules", initrd)
        return vmlinuz, initrd
    dep = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], check=True,
                         capture_output=True, text=True).stdout
    pkg = re.search(r"Depends: (linux-image-\S+)", dep).group(1)
    if not list(d.glob(pkg + "_*.deb")):
        subprocess.run(["apt-get", "download", pkg], cwd=d, check=True, capture_output=True)
    deb = sorted(d.glob(pkg + "_*.deb"))[-1]
    x = d / "x"
    shutil.rmtree(x, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(x)], check=True)
    (release,) = os.listdir(x / "lib/modules")
    shutil.copy(next((x / "boot").glob("vmlinuz-*")), vmlinuz)
    shutil.rmtree(d / "modules", ignore_errors=True)
    shutil.move(str(x / "lib/modules" / release), d / "modules")
    _initramfs(d / "modules", initrd)
    shutil.rmtree(x)
    return vmlinuz, initrd


def _initramfs(moddir: Path, out: Path) -> None:
    found = {p.name[:-3]: p for p in moddir.rglob("*.ko")}
    order: list[str] = []

    def add(name: str) -> None:
        name = name.replace("-", "_") if name.replace("-", "_") in found else name
        if name in order or name not in found:
            return
        m = re.search(rb"depends=([^\0]*)\0", found[name].read_bytes())
        for dep in (m.group(1).decode().split(",") if m and m.group(1) else []):
            add(dep)
        order.append(name)

    for name in MODULES:
        add(name)
    busybox = next(p for p in BUSYBOX if os.path.exists(p))
    files = [("init", INIT.encode(), 0o100755), ("modules", "\n".join(order).encode(), 0o100644),
             ("bin/busybox", Path(busybox).read_bytes(), 0o100755)]
    files += [(f"mods/{n}.ko", found[n].read_bytes(), 0o100644) for n in order]
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        for i, d in enumerate(("bin", "mods")):
            _cpio(fh, d, b"", 0o040755, i + 1)
        for i, (name, data, mode) in enumerate(files):
            _cpio(fh, name, data, mode, i + 10)
        _cpio(fh, "TRAILER!!!", b"", 0, 0)
    os.replace(tmp, out)


def _cpio(fh, name: str, data: bytes, mode: int, ino: int) -> None:
    """One entry of a ``newc`` cpio archive (what the kernel unpacks as initramfs)."""
    raw = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0)
    fh.write(b"070701" + b"".join(b"%08X" % f for f in fields) + raw)
    fh.write(b"\0" * (-(110 + len(raw)) % 4) + data + b"\0" * (-len(data) % 4))


def run(script: str, name: str = "debian12", memory_mb: int = 4096, cpus: int = 2,
        timeout_s: float = 900, systemd: bool = False,
        keep: Path | None = None, root: Path = Path("/"),
        shares: dict[str, Path] | None = None) -> tuple[int, str, float]:
    """Boot the VM, run ``script`` (bash, as root: in PID 1's place, or with ``systemd``
    as a service once systemd has brought up the basic system) and return
    ``(exit code, its output, seconds from boot to power-off)``; exit code -1 when it
    did not finish in ``timeout_s`` (then the output ends with the console's tail).
    ``keep``: a directory to copy what the script wrote to ``/hmt-out`` into.
    ``root``: the directory the VM boots on (read-only, under its tmpfs overlay): this
    host's ``/``, or another root filesystem (:mod:`tests.hosts.rootfs`). ``shares``:
    more directories shared read-only, by 9p mount tag (the script mounts them:
    ``mount -t 9p -o trans=virtio,version=9p2000.L,ro TAG DIR``)."""
    vmlinuz, initrd = kernel(name)
    out = Path(tempfile.mkdtemp(prefix="hmt-hosts-"))
    try:
        (out / "stage2.sh").write_text(STAGE2)
        (out / "cell.sh").write_text(script)
        append = "console=ttyS0 quiet panic=-1 rdinit=/init"
        if systemd:
            (out / "systemd").mkdir()
            for name, text in UNITS.items():
                (out / "systemd" / name).write_text(text)
            append += " systemd.unit=hmt.target systemd.unified_cgroup_hierarchy=1"
        argv = ["qemu-system-x86_64", *accel(), "-m", str(memory_mb),
                "-smp", str(cpus), "-nographic", "-no-reboot", "-nodefaults", "-serial", "stdio",
                "-kernel", str(vmlinuz), "-initrd", str(initrd),
                "-append", append,
                "-virtfs", f"local,path={root},mount_tag=hostroot,security_model=none,"
                           "readonly=on,multidevs=remap",
                "-virtfs", f"local,path={out},mount_tag=out,security_model=none"]
        for tag, path in (shares or {}).items():
            argv += ["-virtfs", f"local,path={path},mount_tag={tag},security_model=none,"
                                "readonly=on,multidevs=remap"]
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout_s)
            console = proc.stdout.decode("utf-8", "replace")
        except subprocess.TimeoutExpired as exc:
            console = (exc.stdout or b"").decode("utf-8", "replace")
        took = time.monotonic() - start
        if keep is not None:
            shutil.copytree(out, keep, dirs_exist_ok=True)
        rc_file = out / "rc"
        log = (out / "log").read_text(errors="replace") if (out / "log").exists() else ""
        if not rc_file.exists():
            return -1, log + "\n--- console ---\n" + console[-4000:], took
        return int(rc_file.read_text().strip() or 1), log, took
    finally:
        shutil.rmtree(out, ignore_errors=True)
