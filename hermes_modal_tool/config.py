"""Sandbox profiles: the config model, ``modal_profiles.yaml`` and environment variables.

Where a profile's values come from, lowest to highest precedence:

1. the field defaults below;
2. ``{PREFIX}{KEY}`` environment variables (``ATROPOS_MODAL_IMAGE``,
   ``TERMINAL_MODAL_MEMORY``, ...), for every profile;
3. the profiles file (``modal_profiles.yaml``), per profile;
4. ``{PREFIX}PROFILE_{NAME}_{KEY}`` environment variables, for profile NAME.

Nothing falls back silently: an unknown key, a wrong type, ``min > max`` or a
missing profiles file raises :class:`~hermes_modal_tool.errors.ConfigError` naming
the file (or variable), the profile and the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

DriverName = Literal["local", "modal"]

# The terminal tool's words and the Modal sandbox's word for our fields.
ALIASES = {"min_pool": "min_sandboxes", "max_pool": "max_sandboxes"}
ENV_PREFIXES = ("ATROPOS_MODAL_", "TERMINAL_MODAL_")
# Environment keys that differ from the field name (the original's spellings).
ENV_KEYS = {"ACQUIRE_TIMEOUT": "acquire_timeout_s", "EXECUTION_TIMEOUT": "execution_timeout_s",
            "MIN_POOL": "min_sandboxes", "MAX_POOL": "max_sandboxes"}
# Variables with these prefixes that are not profile keys (MODE is set by Hermes's CLI).
_NOT_FROM_ENV = {"PROFILES", "PROFILES_FILE", "DEFAULT_PROFILE", "MODE"}


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
    driver: DriverName = Field("local", description="'local' (bubblewrap) or 'modal'.")
    image: str = Field("python:3.11", description="Container image (Modal); local uses the host's root filesystem.")
    gpu: str | None = Field(None, description="GPU type for Modal (T4, A10G, A100, H100, ...).")
    cpu: float = Field(1.0, gt=0, le=512, description="CPU cores per sandbox.")
    memory: int = Field(2048, gt=0, le=4 * 1024 * 1024, description="Memory per sandbox, MiB.")
    slots_per_sandbox: int = Field(10, ge=1, le=4096)
    min_sandboxes: int = Field(1, ge=0, le=100000)
    max_sandboxes: int = Field(5, ge=1, le=100000)
    idle_timeout: float = Field(120, gt=0, description="Stop sandboxes idle this long (s), down to the minimum.")
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
        description="Disk a slot may write (its writable layer and workspace), MiB; default: no limit.")
    scale_down_idle: bool = Field(True, description="Stop idle sandboxes after idle_timeout.")
    network: bool = Field(True, description="False: loopback only inside each slot.")
    isolation: Literal["bwrap", "none"] = Field(
        "bwrap", description="'none' runs slots without namespaces (trusted code only).")
    slot_memory: int | None = Field(None, gt=0, description="Memory limit per slot, MiB (default: memory).")
    pids_limit: int = Field(512, ge=8, le=1_000_000, description="Processes per slot.")
    output_limit: int = Field(50_000, ge=100, le=100_000_000, description="Output cap per call, characters.")
    add_python: str = Field(
        "auto", pattern=r"^(auto|no|3\.\d{1,2})$",
        description="Modal: Python to add to the image for the agent: 'auto' (3.11 unless the "
                    "image's name says it has Python), 'no', or a version such as '3.12'.")

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
        return self

    def with_app_name(self, base: str) -> SandboxConfig:
        """Return a copy whose ``app_name`` is ``"{base}-{name}"``."""
        return self.model_copy(update={"app_name": f"{base}-{self.name}"})

    def get_app_name(self, fallback: str = "hermes-modal-tool") -> str:
        """``app_name``, or ``"{fallback}-{name}"`` when none was set."""
        return self.app_name or f"{fallback}-{self.name}"


class ModalSandboxConfig(SandboxConfig):
    """:class:`SandboxConfig` with ``driver="modal"`` by default (the original's name)."""

    driver: DriverName = Field("modal", description="'modal' (default here) or 'local'.")


class ProfilesFile(BaseModel):
    """The shape of ``modal_profiles.yaml``."""

    model_config = ConfigDict(extra="forbid")

    default_profile: str = "default"
    profiles: dict[str, dict[str, Any] | None] = Field(default_factory=dict)


def _normalise(data: Mapping[str, Any], where: str, profile: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: profile {profile!r}: key {key!r} is not a string")
        field = ALIASES.get(key, key)
        if field in out:
            other = next(k for k in data if k != key and ALIASES.get(k, k) == field)
            raise ConfigError(f"{where}: profile {profile!r}: keys {other!r} and {key!r} both set "
                              f"{field}; give one")
        out[field] = value
    return out


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
    values = _normalise(data, where, name)
    values.setdefault("name", name)
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: profile {name!r}: " + "; ".join(_describe(exc, keys))) from None


def _describe(exc: ValidationError | ConfigError, keys: Mapping[str, str] | None = None) -> list[str]:
    """One phrase per validation error, naming the key as the user wrote it."""
    keys = keys or {}
    problems = []
    for err in exc.errors():
        loc = err["loc"]
        field = str(loc[0]) if loc else ""
        shown = keys.get(field, ".".join(str(p) for p in loc))
        given = err.get("input")
        got = f" (got {given!r:.80})" if err["type"] != "missing" else ""
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            problems.append(f"key {shown!r}: unknown key")
        elif field:
            problems.append(f"key {shown!r}: {msg}{got}")
        else:
            # A check across fields (min > max): name where each side came from.
            sources = [f"{f} from {keys[f]}" for f in ("min_sandboxes", "max_sandboxes") if f in msg and f in keys]
            problems.append(msg + (f" ({'; '.join(sources)})" if sources else ""))
    return problems


def _env_values(env: Mapping[str, str], prefix: str,
                profile: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Values from ``{prefix}{KEY}`` variables (or ``{prefix}PROFILE_{NAME}_{KEY}`` when a
    profile is given), and field -> variable name for messages."""
    tag = prefix if profile is None else f"{prefix}PROFILE_{profile.upper().replace('-', '_')}_"
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    fields = set(SandboxConfig.model_fields)
    for var, raw in env.items():
        if not var.startswith(tag):
            continue
        key = var[len(tag):]
        if profile is None and (key.startswith("PROFILE_") or key in _NOT_FROM_ENV):
            continue
        field = ENV_KEYS.get(key, key.lower())
        where = f"environment variable {var}" + (f": profile {profile!r}" if profile else "")
        if field not in fields:
            raise ConfigError(f"{where}: unknown key {key!r}")
        try:
            values[field] = _parse_env(field, raw)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        names[field] = var
    return values, names


def _parse_env(field: str, raw: str) -> Any:
    if field == "secrets":
        return [s.strip() for s in raw.split(",") if s.strip()]
    if field == "env_vars":
        pairs = {}
        for pair in raw.split(";"):
            if pair.strip():
                if "=" not in pair:
                    raise ValueError(f"env_vars entry {pair!r} is not KEY=VALUE")
                k, v = pair.split("=", 1)
                pairs[k.strip()] = v.strip()
        return pairs
    if field in ("gpu", "slot_memory", "app_name") and raw.strip() == "":
        return None
    return raw


def load_profiles(
    profiles_file: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    prefixes: tuple[str, ...] = ENV_PREFIXES,
    cls: type[SandboxConfig] = SandboxConfig,
) -> tuple[dict[str, SandboxConfig], str]:
    """Load profiles; return ``(profiles, default_profile)``.

    Args:
        profiles_file: a YAML file; if None, ``{prefix}PROFILES_FILE`` is used when set.
        env: the environment to read (default ``os.environ``).
        prefixes: variable prefixes, later ones winning (``ATROPOS_MODAL_``,
            ``TERMINAL_MODAL_``).
        cls: the config class (``ModalSandboxConfig`` makes ``driver="modal"`` the default).

    Raises:
        ConfigError: the file is missing, unreadable, not YAML, has the wrong shape,
            or a profile has an unknown key, a wrong type or ``min > max``.
    """
    env = os.environ if env is None else env
    base: dict[str, Any] = {}
    base_names: dict[str, str] = {}
    for prefix in prefixes:
        vals, names = _env_values(env, prefix)
        base.update(vals)
        base_names.update(names)
    if profiles_file is None:
        for prefix in prefixes:
            if env.get(f"{prefix}PROFILES_FILE"):
                profiles_file = env[f"{prefix}PROFILES_FILE"]
    raw_profiles: dict[str, dict[str, Any] | None]
    default = "default"
    where = "environment"
    if profiles_file is not None:
        where = str(profiles_file)
        parsed = read_profiles_file(profiles_file)
        raw_profiles = parsed.profiles
        default = parsed.default_profile
    else:
        names_list = ["default"]
        for prefix in prefixes:
            if env.get(f"{prefix}PROFILES"):
                names_list = [p.strip() for p in env[f"{prefix}PROFILES"].split(",") if p.strip()]
        raw_profiles = {n: {} for n in names_list}
    profiles: dict[str, SandboxConfig] = {}
    for name, data in raw_profiles.items():
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: profile {name!r}: expected a mapping of keys, got {type(data).__name__}")
        file_values = _normalise(data, where, name)
        merged = {**base, **file_values}
        keys = {**base_names, **{f: f"{k}" for k, f in ((k, ALIASES.get(k, k)) for k in data)}}
        for prefix in prefixes:
            vals, names = _env_values(env, prefix, name)
            merged.update(vals)
            keys.update(names)
        profiles[name] = build_profile(str(name), merged, where, cls, keys)
    if default not in profiles:
        raise ConfigError(f"{where}: default_profile {default!r} is not one of the profiles "
                          f"({', '.join(map(str, profiles)) or 'none defined'})")
    return profiles, default


def _check_duplicate_keys(node: Any, where: str, path: tuple[str, ...] = ()) -> None:
    """Refuse a key given twice in one mapping (YAML itself would silently keep the last)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                profile = f"profile {path[1]!r}: " if len(path) >= 2 and path[0] == "profiles" else ""
                raise ConfigError(f"{where}: {profile}key {key!r} appears twice "
                                  f"(lines {seen[key]} and {line})")
            seen[key] = line
            _check_duplicate_keys(value_node, where, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicate_keys(item, where, path)


def read_profiles_file(path: str | os.PathLike[str]) -> ProfilesFile:
    """Parse a profiles YAML file's top level (profiles are validated by load_profiles)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: profiles file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: profiles file is not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:  # e.g. a NUL in the path
        raise ConfigError(f"{str(p)!r}: not a usable path: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read profiles file: {exc.strerror}") from None
    try:
        _check_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), str(p))
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        raise ConfigError(f"{p}: profiles file is empty; expected 'profiles:'")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{p}: expected a mapping with 'profiles:', got {type(data).__name__}")
    try:
        parsed = ProfilesFile(**data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise ConfigError(f"{p}: key {key!r}: {msg} (got {err.get('input')!r:.80})") from None
    if not parsed.profiles:
        raise ConfigError(f"{p}: 'profiles:' defines no profile")
    return parsed
