"""Sandbox profiles: the config model.

Profiles files and environment variables are read by
:func:`~hermes_modal_tool.profiles.load_profiles` (re-exported here); see
:mod:`hermes_modal_tool.profiles` for where each value comes from.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .network_config import EgressOptions, network_mode
from .profiles import (
    ALIASES,
    ENV_KEYS,
    ENV_PREFIXES,
    load_profiles,
    read_profiles_file,
    set_default_model,
    split_profile_var,
)
from .volumes import Volume, check_volumes

__all__ = ["ALIASES", "ENV_KEYS", "ENV_PREFIXES", "ModalSandboxConfig", "SandboxConfig",
           "build_profile", "load_profiles", "read_profiles_file", "validate_profile"]

DriverName = Literal["local", "modal", "ray"]
_Config = TypeVar("_Config", bound="SandboxConfig")


class SandboxConfig(BaseModel):
    """One profile: what a sandbox looks like and how its pool is sized.

    Units: ``cpu`` in cores, ``memory``/``slot_memory`` in MiB, every ``*_timeout``,
    ``max_lifetime`` and ``*_s`` in seconds, ``output_limit`` in characters.

    Example:
        >>> cfg = SandboxConfig(name="default", slots_per_sandbox=4, max_sandboxes=2)
        >>> cfg.with_app_name("my-training").app_name
        'my-training-default'
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigError(f"{type(self).__name__}: profile {self.name!r}: "
                              + "; ".join(_describe(exc)), errors=exc.errors()) from None

    def __init__(self, **data: Any) -> None:
        """Validate the fields; raise ConfigError (naming each bad key) instead of pydantic's error."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            name = data.get("name", "default")
            raise ConfigError(f"{type(self).__name__}: profile {name!r}: " + "; ".join(_describe(exc)),
                              errors=exc.errors()) from None

    name: str = Field("default", min_length=1, description="Profile name.")
    app_name: str | None = Field(None, description="Full app name; see with_app_name().")
    driver: DriverName = Field("local", description="'local' (bubblewrap), 'modal' or 'ray' (a Ray "
                                                     "actor per sandbox, bubblewrap on its node).")
    image: str = Field(
        "python:3.11", description="The slots' image: a registry reference (Modal builds it; the local "
                                   "driver pulls it when the profile sets it), or locally dir:, oci:, "
                                   "oci-archive:, docker-archive:. Left at the default, local slots use "
                                   "the host's root filesystem.")
    gpu: str | None = Field(
        None, description="GPUs per sandbox, Modal's syntax: a type ('T4', 'A100-80GB', 'H100', or "
                          "'any') and an optional count ('H100:2'). The slots of a sandbox share "
                          "its GPUs; the local driver gives them the host's (see the README's "
                          "'GPU slots').")
    gpu_sharing: Literal["time-slicing", "mps"] = Field(
        "time-slicing", description="How a sandbox's slots share its GPUs: 'time-slicing' (what "
                                    "CUDA does for several processes) or 'mps' (an NVIDIA MPS "
                                    "control daemon per sandbox, where the driver has one).")
    gpu_mps_threads: int | None = Field(
        None, ge=1, le=100, description="With gpu_sharing: mps, each slot's share of the SMs, percent "
                                        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); default: no limit.")
    gpu_mps_memory: int | None = Field(
        None, gt=0, le=16 * 1024 * 1024,
        description="With gpu_sharing: mps, GPU memory each slot may pin per GPU, MiB "
                    "(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT); default: no limit.")
    cpu: float = Field(1.0, gt=0, le=512, description="CPU cores per sandbox.")
    memory: int = Field(2048, gt=0, le=4 * 1024 * 1024, description="Memory per sandbox, MiB.")
    slots_per_sandbox: int = Field(10, ge=1, le=4096)
    min_sandboxes: int = Field(1, ge=0, le=100000)
    max_sandboxes: int = Field(5, ge=1, le=100000)
    spread: bool = Field(
        True, description="acquire leases a free slot of the live sandbox holding the fewest "
                          "leased slots, so held slots spread over the live sandboxes: each "
                          "sandbox's agent is one process serving its slots on one core, so "
                          "that is one core per sandbox (min_sandboxes: the host's cores to use "
                          "them all from the start). False packs them into the sandboxes used "
                          "last (fewer agents busy; those beyond min_sandboxes idle and stop "
                          "sooner).")
    idle_timeout: float = Field(120, gt=0, description="Idle seconds before a sandbox is stopped (down to min_sandboxes; see "
                                      "scale_down_idle); also Modal's server-side idle limit.")
    max_lifetime: float = Field(3600, gt=0, description="Longest a sandbox lives (s); Modal's timeout.")
    acquire_timeout_s: float = Field(60.0, gt=0, le=86400)
    execution_timeout_s: float = Field(30.0, gt=0, le=86400, description="Default per-call timeout (s).")
    secrets: list[str] = Field(default_factory=list, description="Secret names (Modal secrets, or local .env files).")
    env_vars: dict[str, str] = Field(default_factory=dict)
    workspace_base: str = Field("/data", description="Slots live at {workspace_base}/slot_{N}.")
    workdir: str | None = Field(
        None, description="The shell's starting directory in each slot (created in the slot's own "
                          "root if missing); default: the slot's workspace.")
    filesystem: Literal["auto", "overlay", "workspace-only"] = Field(
        "auto", description="Each slot's root: 'overlay' (a private copy-on-write root, the slot "
                            "is root in it), 'workspace-only' (the sandbox's root read-only, only "
                            "the workspace writable), or 'auto' (overlay where the machine allows).")
    slot_disk: int | None = Field(
        None, gt=0, le=16 * 1024 * 1024,
        description="Disk a slot may write (its writable layer and workspace), MiB; default: a "
                    "fair share of the sandbox's free disk (free / slots_per_sandbox) where the "
                    "kernel enforces it (see disk_limit), else no limit.")
    disk_limit: Literal["auto", "kernel", "watch"] = Field(
        "auto", description="How slot_disk holds: 'kernel' (each writable layer a file system of "
                            "that size and inode count: ENOSPC past it; needs root, loop devices "
                            "and mkfs.ext4), 'watch' (measured while commands run; the command "
                            "is stopped past it), or 'auto' (kernel where the machine allows).")
    volumes: list[Volume] = Field(
        default_factory=list,
        description="Host directories bound into every slot: [{source, target, read_only: true}] "
                    "(local driver); read-only unless read_only is false (then shared by the "
                    "profile's slots). See hermes_modal_tool/volumes.py.")
    setup: list[str] | None = Field(
        None, description="Commands every slot of the profile starts after: run once per content "
                          "key (commands, profile, image) in a fresh slot, snapshotted, and each "
                          "acquire forks from that snapshot (needs filesystem: overlay).")
    snapshot_disk: int = Field(
        8192, gt=0, le=16 * 1024 * 1024,
        description="Disk the snapshots of one sandbox may hold together, MiB; a snapshot past "
                    "it is refused (SnapshotError) until others are released.")
    scale_down_idle: bool | float = Field(
        True, description="Scale down: stop sandboxes (down to min_sandboxes) once idle this "
                          "long. True: after idle_timeout; False: never; a number: after that many "
                          "seconds (the original terminal tool's meaning; idle_timeout then only "
                          "sets Modal's own server-side idle limit).")
    network: Literal["none", "egress", "host"] = Field(
        "egress", description="Each slot's network: 'none' (loopback only), 'egress' (the "
                              "default: a network namespace of its own behind the agent's "
                              "policy, no reach into the host: see egress and the README's "
                              "Network section; on modal, Modal's outbound allow-lists per "
                              "sandbox), 'host' (the sandbox's network). true and false are "
                              "aliases of 'egress' and 'none'. Left unset, it is 'host' with "
                              "isolation: none, and a sandbox whose agent cannot make network "
                              "namespaces (not root) runs its slots with 'none' and says so in "
                              "get_status(); set explicitly, 'egress' there fails the start.")
    egress: EgressOptions = Field(
        default_factory=lambda: EgressOptions(),
        description="network: egress only: {allow: [CIDR or name pattern], deny: [...], "
                    "dns: 'address[:port]' of the resolver allowed names are asked of, "
                    "proxy: true for HTTP(S) only through the agent's forward proxy}.")
    isolation: Literal["bwrap", "none"] = Field(
        "bwrap", description="'none' runs slots without namespaces (trusted code only).")
    slot_memory: int | None = Field(
        None, gt=0, description="Memory limit per slot, MiB; default: a fair share, memory / "
                                "slots_per_sandbox (at least 64). See slot_memory_mb.")
    pids_limit: int = Field(512, ge=8, le=1_000_000, description="Processes per slot.")
    slot_processes: int = Field(
        16, ge=1, le=4096,
        description="Processes started through the API (start_process, bash with background) "
                    "one slot may have running at once; one more is refused (an error naming "
                    "this field). Ended ones are forgotten, oldest first, to make room.")
    slot_process_output: int = Field(
        16, ge=1, le=4096,
        description="Output of those processes the sandbox's agent keeps for one slot, MiB, "
                    "all of them together: each keeps its last slot_process_output / "
                    "slot_processes (at most 1 MiB); older output is dropped and counted.")
    output_limit: int = Field(50_000, ge=100, le=100_000_000, description="Output cap per call, characters.")
    heartbeat_timeout: float = Field(
        30.0, ge=3, le=86400,
        description="Modal: a sandbox ends itself when its owner has been silent this long (s). "
                    "The owner sends a heartbeat on the agent's stream every sixth of it, so an "
                    "owner killed with -9 leaves nothing running, without 'modal gc'.")
    add_python: str = Field(
        "auto", pattern=r"^(auto|no|3\.\d{1,2})$",
        description="Modal: Python to add to the image for the agent: 'auto' (3.11 unless the "
                    "image's name says it has Python), 'no', or a version such as '3.12'.")

    @field_validator("network", mode="before")
    @classmethod
    def _network_mode(cls, value: Any) -> Any:
        return network_mode(value)

    @field_validator("workspace_base", "workdir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith("/") or "\x00" in value or "\n" in value:
            raise ValueError(f"must be an absolute path, got {value!r}")
        parts = [p for p in value.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"must be an absolute path below '/', got {value!r}")
        return "/" + "/".join(parts)

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from .gpus import parse_gpu

        parse_gpu(value)  # ValueError: named with the profile and key by ConfigError
        return value.strip()

    @field_validator("scale_down_idle")
    @classmethod
    def _idle_seconds(cls, value: bool | float) -> bool | float:
        if not isinstance(value, bool) and not (0 < value < math.inf):
            raise ValueError(f"must be true, false or a positive number of seconds, got {value!r}")
        return value

    @property
    def slot_memory_mb(self) -> int:
        """The memory limit each slot gets (MiB): ``slot_memory`` if set, else a fair share
        of the sandbox, ``memory // slots_per_sandbox`` but at least 64 MiB, so that no slot
        can take its neighbours' memory (the sandbox's own limit still caps the sum).
        Writable tmpfs mounts in a slot are capped at half of it each (see SECURITY.md)."""
        return self.slot_memory or max(64, self.memory // self.slots_per_sandbox)

    @property
    def scale_down_after(self) -> float | None:
        """Seconds a sandbox may stay idle before the pool stops it (None: never)."""
        if self.scale_down_idle is False:
            return None
        if self.scale_down_idle is True:
            return float(self.idle_timeout)
        return float(self.scale_down_idle)

    @field_validator("env_vars")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not key or not (key[0].isalpha() or key[0] == "_") or not all(
                    c.isalnum() or c == "_" for c in key) or not key.isascii():
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or "/" in name or "\x00" in name or name.startswith("."):
                raise ValueError(f"{name!r} is not a valid secret name")
        return value

    @model_validator(mode="after")
    def _sizes(self) -> SandboxConfig:
        if self.min_sandboxes > self.max_sandboxes:
            raise ValueError(
                f"min_sandboxes ({self.min_sandboxes}) is greater than max_sandboxes ({self.max_sandboxes})")
        if self.volumes:
            check_volumes(self.volumes, self.workspace_base, self.driver)
        if self.network == "egress" and self.driver == "modal":
            from .modal_network import check  # Modal enforces egress itself: what it can

            check(self.egress, self.name)
        if self.isolation == "none" and "network" not in self.model_fields_set:
            self.__dict__["network"] = "host"  # no namespaces at all: nothing else is honest
        if self.network == "egress" and self.isolation == "none":
            raise ValueError("network: egress needs isolation: bwrap (without it a slot runs with "
                             "the agent's privileges and could leave its namespace)")
        return self

    def with_app_name(self: _Config, base_app: str | None = None, *,
                      base: str | None = None) -> _Config:
        """Return a copy whose ``app_name`` is ``"{base_app}-{name}"``.

        Args:
            base_app: the app name prefix (the original's argument name); ``base=`` is
                accepted too.

        Raises:
            UsageError: neither or both given, or not a non-empty string.
        """
        from .errors import UsageError

        if (base_app is None) == (base is None):
            raise UsageError("with_app_name() takes one app name prefix: with_app_name('my-app')")
        prefix = base_app if base_app is not None else base
        if not isinstance(prefix, str) or not prefix:
            raise UsageError(f"with_app_name(): the prefix must be a non-empty string, got {prefix!r:.80}")
        return self.model_copy(update={"app_name": f"{prefix}-{self.name}"})

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> SandboxConfig:
        """One profile from a mapping of keys (as in a profiles file; ``min_pool`` and
        ``max_pool`` allowed). Unlike the original, an unknown key or a bad value raises.

        Raises:
            ConfigError: naming the profile and every bad key.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"profile {name!r}: expected a mapping of keys, got {type(data).__name__}")
        return build_profile(name, dict(data), "from_dict", cls)

    @classmethod
    def from_env(cls, profile_name: str = "default", *,
                 env: Mapping[str, str] | None = None) -> SandboxConfig:
        """One profile from ``ATROPOS_MODAL_*``/``TERMINAL_MODAL_*`` variables: the general
        ``{PREFIX}{KEY}`` ones, then ``{PREFIX}PROFILE_{NAME}_{KEY}`` (no profiles file).

        Raises:
            ConfigError: a variable has an unknown key or a bad value (named).
        """
        env = os.environ if env is None else env
        spellings = {profile_name, profile_name.upper().replace("-", "_")}

        def wanted(var: str) -> bool:
            for prefix in ENV_PREFIXES:
                if var.startswith(f"{prefix}PROFILE_"):  # only this profile's own
                    return (split_profile_var(var[len(prefix) + 8:]) or ("",))[0] in spellings
            return not var.endswith(("_PROFILES", "_PROFILES_FILE", "_DEFAULT_PROFILE"))

        env = {k: v for k, v in env.items() if wanted(k)}
        env["ATROPOS_MODAL_PROFILES"] = env["ATROPOS_MODAL_DEFAULT_PROFILE"] = profile_name
        profiles, _ = load_profiles(None, env=env, cls=cls)
        return profiles[profile_name]

    @classmethod
    def load_profiles(cls, config_file: str | os.PathLike[str] | None = None) -> dict[str, SandboxConfig]:
        """The original's loader: ``{name: config}`` from ``config_file`` (else
        ``{PREFIX}PROFILES_FILE``, else the environment). Unlike the original, a bad
        file raises instead of falling back to defaults; see
        :func:`~hermes_modal_tool.load_profiles` for the default profile too.

        Raises:
            ConfigError: listing every problem of the file or environment.
        """
        return load_profiles(config_file, cls=cls)[0]

    @classmethod
    def check_profile(cls, name: str, values: Mapping[str, Any], where: str,
                      keys: Mapping[str, str] | None = None) -> tuple[SandboxConfig | None, list[str]]:
        """:func:`validate_profile` with this class: ``(config, [])`` or ``(None, problems)``
        (how :func:`~hermes_modal_tool.profiles.load_profiles` checks each profile)."""
        return validate_profile(name, values, where, cls, keys)

    def get_app_name(self, fallback: str = "hermes-modal-tool") -> str:
        """``app_name``, or ``"{fallback}-{name}"`` when none was set."""
        return self.app_name or f"{fallback}-{self.name}"


class ModalSandboxConfig(SandboxConfig):
    """:class:`SandboxConfig` with ``driver="modal"`` by default (the original's name)."""

    driver: DriverName = Field("modal", description="'modal' (default here) or 'local'.")

    def __init__(self, **data: Any) -> None:
        """As :class:`SandboxConfig`'s (here so type checkers see the same keyword
        arguments: pydantic's synthesized one would make every field required)."""
        super().__init__(**data)


def build_profile(name: str, data: Mapping[str, Any], where: str,
                  cls: type[SandboxConfig] = SandboxConfig,
                  keys: Mapping[str, str] | None = None) -> SandboxConfig:
    """Validate one profile's values; raise ConfigError naming ``where``, profile and key.

    Args:
        name: the profile name.
        data: field values (aliases such as ``min_pool`` allowed).
        where: the source, for messages (a file path, or "environment").
        keys: optional map field -> original key/variable, for messages.
    """
    values: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: profile {name!r}: key {key!r} is not a string")
        field = ALIASES.get(key, key)
        if field in values:
            raise ConfigError(f"{where}: profile {name!r}: two keys set {field}; give one")
        values[field] = value
    cfg, problems = validate_profile(name, values, where, cls, keys)
    if cfg is None:
        raise ConfigError(f"{where}: profile {name!r}: " + "; ".join(
            p.removeprefix(f"{where}: profile {name!r}: ") for p in problems))
    return cfg


def validate_profile(name: str, values: Mapping[str, Any], where: str,
                     cls: type[SandboxConfig] = SandboxConfig,
                     keys: Mapping[str, str] | None = None) -> tuple[SandboxConfig | None, list[str]]:
    """Validate one profile's field values: ``(config, [])`` or ``(None, problems)``,
    one problem per bad key, each naming ``where``, the profile and the key."""
    values = {"name": name, **values}  # a "name" key given in the values wins
    try:
        return cls(**values), []
    except ConfigError as exc:
        errors = exc.errors()
    problems = _describe(errors, keys)
    if errors and all(err["loc"] for err in errors):
        # pydantic runs the checks across fields (min > max) only when every field is
        # valid: run them again on the keys that are, so one report lists every problem.
        bad = {str(err["loc"][0]) for err in errors}
        try:
            cls(**{k: v for k, v in values.items() if k not in bad})
        except ConfigError as again:
            problems += _describe([e for e in again.errors()
                                   if not e["loc"] and not any(b in e["msg"] for b in bad)], keys)
    return None, [f"{where}: profile {name!r}: {p}" for p in problems]


def _describe(exc: ValidationError | ConfigError | list[Any],
              keys: Mapping[str, str] | None = None) -> list[str]:
    """One phrase per validation error (of ``exc``, or a list of pydantic's error dicts),
    naming the key as the user wrote it."""
    keys = keys or {}
    problems = []
    for err in exc if isinstance(exc, list) else exc.errors():
        loc = err["loc"]
        field = str(loc[0]) if loc else ""
        shown = keys.get(field, ".".join(str(p) for p in loc))
        given = err.get("input")
        got = f" (got {given!r:.80})" if err["type"] != "missing" else ""
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            near = difflib.get_close_matches(field, [*SandboxConfig.model_fields, *ALIASES], n=1)
            problems.append(f"key {shown!r}: unknown key" + (f" (did you mean {near[0]!r}?)" if near else ""))
        elif field:
            problems.append(f"key {shown!r}: {msg}{got}")
        else:
            # A check across fields (min > max): name where each side came from.
            sources = [f"{f} from {keys[f]}" for f in ("min_sandboxes", "max_sandboxes") if f in msg and f in keys]
            problems.append(msg + (f" ({'; '.join(sources)})" if sources else ""))
    return problems


set_default_model(SandboxConfig)
