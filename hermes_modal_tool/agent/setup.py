"""The agent's ``init``: the sandbox's configuration, isolation, limits and slots.

Stdlib-only, Python 3.8. Mixed into :class:`.main.Agent`.
"""

import os
import resource
import sys

from .. import protocol
from .fs import layerspares, rootfs, rootplan, rootprobe, slotdisk, slottmpfs, trees, volumes
from .heartbeat import Heartbeat
from .limits import caps, cgroups, gpu, isolation, shmwatch
from .net import slotnet
from .slot import SlotRuntime


class Setup:
    """Mixed into the agent: handles ``init``."""

    def handle_init(self, msg):
        cfg = msg["config"]
        self.config = cfg
        self.workspace_base = cfg["workspace_base"]
        self.state_dir = cfg["state_dir"]
        # Control files are rewritten on every command: keep them on tmpfs when we can.
        self.ctl_root = cfg.get("ctl_root") or os.path.join(self.state_dir, "ctl")
        self.host_root = cfg.get("host_root") or self.workspace_base
        self.isolation = cfg.get("isolation", "bwrap")
        self.bwrap = cfg.get("bwrap")
        self.network = slotnet.network_mode(cfg.get("network", True))
        self.net = None  # network: egress: the router and slots' namespaces (net/slotnet.py)
        self.network_note = ""  # why the profile's default egress became none, if it did
        self.hide = list(cfg.get("hide", []))
        # (source, target, read_only) per volume; slots of their own uids must reach them
        self.volumes = volumes.parse(cfg, cfg.get("uid_base") is not None and os.geteuid() == 0)
        # In a container (Modal) the slots see the container's environment (image
        # variables, Modal secrets) plus the profile's; locally only the profile's.
        self.env = {}
        if cfg.get("inherit_env"):
            self.env.update((k, v) for k, v in os.environ.items() if not k.startswith("PYTHON"))
        self.env.update(cfg.get("env", {}))
        self.limit = int(cfg.get("output_limit", 50000))
        uid_base = cfg.get("uid_base")
        self.uid_base = uid_base if (uid_base is not None and os.geteuid() == 0) else None
        isolation_note = ""
        if self.isolation == "bwrap" and self.bwrap == "auto":
            # Bubblewrap on top where it works in this container; else each slot keeps
            # its own uid, 0700 workspace and process group (see SECURITY.md).
            self.bwrap, isolation_note = isolation.find_working_bwrap(
                self.env.get("PATH") or os.environ.get("PATH", ""), self.uid_base)
            if self.bwrap is None:
                self.isolation = "none"
        self.workdir = cfg.get("workdir") or None
        if cfg.get("heartbeat"):
            self.heartbeat = Heartbeat(self.loop, cfg["heartbeat"]["file"], cfg["heartbeat"]["every"])
        self.slot_disk_mb = cfg.get("slot_disk") or None
        self.image_root = cfg.get("image_root") or None  # an unpacked image: the slots' lower
        self.image_bash = cfg.get("image_bash") or None  # the host's static bash, if needed
        self.filesystem, filesystem_note = self._choose_filesystem(cfg)
        self.layer_disks, disk_mb, disk_default, disk_note = slotdisk.plan(self, cfg)
        limits = dict(cfg.get("limits", {}))
        self.tmpfs_mb = caps.tmpfs_mb_for(limits)
        limits.setdefault("sandbox_pids", (limits.get("pids") or 0) * cfg["slots"] + 64
                          if limits.get("pids") else None)
        os.makedirs(self.state_dir, exist_ok=True)
        os.chmod(self.state_dir, 0o711)
        os.makedirs(self.ctl_root, exist_ok=True)
        os.chmod(self.ctl_root, 0o711)
        if cfg.get("gpu"):  # a gpu profile: the slots' devices, driver files and env (gpu.py)
            self.gpu = gpu.AgentGpu(cfg["gpu"], self.state_dir, self.image_root)
            self.env = self.gpu.slot_env(self.env)
        os.makedirs(self.host_root, exist_ok=True)
        os.chmod(self.host_root, 0o711)
        self.cgroups = None
        limit_mode = "none"
        reason = ""
        if cfg.get("cgroups", True):
            self.cgroups = cgroups.Cgroups(
                cfg.get("cgroup_name") or "%s-%d" % (cfg.get("sandbox_id", "sandbox"), os.getpid()),
                limits)
            limit_mode = self.cgroups.mode
            reason = self.cgroups.reason
            if limit_mode == "cgroup-v2" and cfg.get("cgroup_delegation"):
                reason = "%s, made by %s" % (reason, cfg["cgroup_delegation"])
            if limit_mode == "rlimit":
                self.cgroups = None
        self.rlimits = [] if self.cgroups else isolation.rlimits_for(limits, self.uid_base is not None)
        if not self.cgroups:
            limit_mode = "rlimit"
        if self.network == "egress":  # before any slot starts
            self.net, self.network_note = slotnet.start_or_degrade(
                cfg.get("egress"), "the profile's egress", cfg.get("network_explicit", True))
            if self.net is None:
                self.network = "none"
        tmpfs_root, tmpfs_note = slottmpfs.plan(self, limit_mode)
        for i in range(int(cfg["slots"])):
            self.slots[i] = SlotRuntime(self, i)
            self.slots[i].tmpfs = (slottmpfs.SlotTmpfs(tmpfs_root, i, self.tmpfs_mb)
                                   if tmpfs_root else None)
        # Slots without bubblewrap: what each holds in the shared memory-backed places.
        self.shm_watch, shm_note = shmwatch.plan(self, limits, len(self.slots))
        if self.shm_watch is not None:
            self.shm_watch.start()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
        slot_caps = caps.caps_report(limits, limit_mode, self.filesystem, self.tmpfs_mb,
                                     self.slot_disk_mb, self.isolation, bool(tmpfs_root),
                                     self.contain_root, tmpfs_note,
                                     self.shm_watch.caps() if self.shm_watch else None, shm_note,
                                     self._cpu_controller(),
                                     (self.layer_disks, disk_mb, disk_default, disk_note),
                                     self.uid_base is not None)
        return {
            "protocol": protocol.PROTOCOL_VERSION,
            "python": "%d.%d.%d" % sys.version_info[:3],
            "pid": os.getpid(),
            "isolation": self.isolation,
            "isolation_note": isolation_note,
            "limits": limit_mode,
            "limits_note": reason,
            "slot_uids": self.uid_base is not None,
            "abstract_sockets": isolation.scopes.abstract_socket_scope()[1],
            "slots": len(self.slots),
            "network": self.network,
            "network_note": self.network_note,
            # network: egress: the sandbox's router namespace (/proc/<pid>/fd/<n>; tests attach
            # the fake internet there with upstream: none)
            "network_router": self.net.router_path if self.net is not None else None,
            "filesystem": self.filesystem,
            "filesystem_note": filesystem_note,
            "caps": slot_caps,
            "slot_disk": slot_caps["disk"] if slot_caps["disk"]["mib"] else None,
            "gpu": dict(self.gpu.report, cgroup=self.cgroups.name if self.cgroups else None)
            if self.gpu else None,
        }

    def _cpu_controller(self):
        """Whether the slots' cgroups have the cpu controller (None without cgroups)."""
        placement = getattr(self.cgroups, "placement", None)
        if self.cgroups is None:
            return None
        return placement is None or "cpu" in placement.controllers

    def _choose_filesystem(self, cfg):
        """``("overlay", "")`` when each slot gets a layered root of its own, else
        ``("workspace-only", why)``. ``filesystem: overlay`` in the config makes it required."""
        wanted = cfg.get("filesystem") or "auto"
        if self.image_root:  # slots on an image need a layered root
            if wanted == "workspace-only":
                raise RuntimeError("filesystem: workspace-only cannot run an image")
            wanted = "overlay"
        if wanted == "workspace-only":
            return "workspace-only", "the profile asks for filesystem: workspace-only"
        if self.isolation != "bwrap" or self.uid_base is None:
            why = ("slots run without bubblewrap" if self.isolation != "bwrap"
                   else "the agent is not root, so slots cannot have a uid of their own")
        else:
            os.makedirs(self.state_dir, exist_ok=True)
            why = rootprobe.probe(self.state_dir, known=bool(cfg.get("layered_root_known")))
        if why:
            if wanted == "overlay":
                raise RuntimeError("%s is not possible here: %s" % (
                    "an image (the lower layer of a layered root)" if self.image_root
                    else "filesystem: overlay", why))
            return "workspace-only", why
        self.trash_dir = os.path.join(self.state_dir, "trash")
        self.layer_spares = layerspares.LayerSpares(os.path.join(self.state_dir, "spare"))
        trees.spread_subdirs(self.state_dir)
        for sub in ("fs", "mnt", "trash", "tpl", "spare"):
            os.makedirs(os.path.join(self.state_dir, sub), mode=0o711, exist_ok=True)
        trees.spread_subdirs(os.path.join(self.state_dir, "fs"))  # each slot's apart (trees.py)
        # The slots' mount points for their lowers (rootfs: nothing is ever written there)
        # on a tmpfs: no inode of the state's file system made or freed per slot.
        mnt = os.path.join(self.state_dir, "mnt")
        try:
            rootfs.mount_tmpfs(mnt, "size=64k,mode=711")
        except OSError:
            trees.spread_subdirs(mnt)  # on disk, then; each slot's apart
        # The slots' template layers (see rootfs): ~40 entries and one small file per slot.
        self.template_dir = os.path.join(self.state_dir, "tpl")
        try:
            rootfs.mount_tmpfs(self.template_dir, "size=%dk,mode=711" % (1024 + 16 * int(cfg["slots"])))
        except OSError as exc:
            why = "no tmpfs for the slots' template layers: %s" % (exc.strerror or exc,)
            if wanted == "overlay":
                raise RuntimeError("a layered root is not possible here: %s" % why) from None
            return "workspace-only", why
        hidden = list(self.hide) + [self.state_dir, self.ctl_root]
        base = self.workspace_base.rstrip("/")
        if not (base == self.host_root or base.startswith(self.host_root + "/")
                or self.host_root.startswith(base + "/")):
            hidden.append(self.host_root)  # workspace-only layout's dirs (not the slots' base)
        self.upper_plan = rootplan.UpperPlan.for_image(self.image_root) if self.image_root \
            else rootplan.UpperPlan(hidden, cfg.get("masked") or [],
                                    bool(cfg.get("hide_host_top", False)))
        # What all slots' templates hold: the workspaces' parent, the working and control
        # directories, the volumes' mount points (a slot's own workspace goes into its layers, see rootfs).
        self.shared_template = rootplan.SharedTemplate(
            os.path.join(self.template_dir, "shared"), self.upper_plan,
            [self.workspace_base.rstrip("/") or "/", self.workdir, isolation.CTL_PATH]
            + volumes.targets(self.volumes))  # the volumes' mount points too
        return "overlay", ""
