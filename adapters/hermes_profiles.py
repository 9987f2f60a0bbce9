"""The original terminal tool's profile type, ``ModalProfile``, and how the tool finds its profiles.

Code written for the Hermes fork's ``tools/terminal_tool.py`` builds and loads
``ModalProfile`` objects; here each one is a view of a
:class:`~hermes_modal_tool.SandboxConfig` (``min_pool``/``max_pool`` are
``min_sandboxes``/``max_sandboxes``), validated the same strict way: a bad value
raises :class:`~hermes_modal_tool.ConfigError` naming the profile and key instead
of being replaced by defaults.

Where the terminal tool's profiles come from (:func:`terminal_profiles`):

1. the file ``TERMINAL_MODAL_PROFILES_FILE`` names, else ``./modal_profiles.yaml``
   when it exists (as the original looked there), else the environment;
2. the original's defaults below every other source: commands time out after 60 s
   (``execution_timeout_s``), the shell starts in ``TERMINAL_CWD`` or ``/workspace``
   (``workdir``), idle sandboxes are stopped after 180 s (``scale_down_idle``);
3. every ``ATROPOS_MODAL_*``/``TERMINAL_MODAL_*`` variable, as
   :mod:`hermes_modal_tool.profiles` describes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import SandboxConfig
from ..errors import ConfigError, ConfigWarning
from ..profiles import IGNORED_KEYS, load_profiles, split_profile_var

#: The file the original terminal tool read when no file was named.
DEFAULT_PROFILES_FILE = "modal_profiles.yaml"
#: Hermes's own variables under the ``TERMINAL_MODAL_`` prefix (its CLI sets them from
#: config.yaml): not profile keys, so not handed to load_profiles.
HERMES_OWN_VARS = frozenset({"TERMINAL_MODAL_MODE"})
#: Variables the original terminal tool read for every backend that mean nothing here
#: (warned about by name when set).
NO_EFFECT_VARS = {
    "TERMINAL_SCRATCH_DIR": "slots keep their files in their sandbox's own state directory",
    "TERMINAL_DISK_WARNING_GB": "there is no host scratch directory to watch; limit a slot's disk "
                                "with the profile's slot_disk (MiB)",
    "SUDO_PASSWORD": "commands run as root (uid 0) in their own slot; sudo is not rewritten",
}
#: The original terminal tool's defaults that differ from SandboxConfig's.
TERMINAL_DEFAULTS: dict[str, Any] = {"execution_timeout_s": 60.0, "workdir": "/workspace",
                                     "scale_down_idle": 180.0}


def warn_no_effect(env: Mapping[str, str]) -> None:
    """A :class:`ConfigWarning` for each :data:`NO_EFFECT_VARS` variable that is set."""
    for var, why in NO_EFFECT_VARS.items():
        if env.get(var):
            warnings.warn(f"environment variable {var}: has no effect here: {why}", ConfigWarning,
                          stacklevel=3)


def terminal_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """:data:`TERMINAL_DEFAULTS`, with ``workdir`` from ``TERMINAL_CWD`` when set.

    Raises:
        ConfigError: ``TERMINAL_CWD`` is not an absolute path.
    """
    defaults = dict(TERMINAL_DEFAULTS)
    cwd = (env.get("TERMINAL_CWD") or "").strip()
    if cwd:
        if not cwd.startswith("/"):
            raise ConfigError(f"environment variable TERMINAL_CWD: must be an absolute path (the "
                              f"directory commands start in, inside each slot), got {cwd!r}")
        defaults["workdir"] = cwd
    return defaults


def profiles_file(env: Mapping[str, str]) -> str | None:
    """The profiles file the terminal tool reads: ``TERMINAL_MODAL_PROFILES_FILE``
    (or ``ATROPOS_MODAL_PROFILES_FILE``), else ``./modal_profiles.yaml`` if it exists."""
    for var in ("TERMINAL_MODAL_PROFILES_FILE", "ATROPOS_MODAL_PROFILES_FILE"):
        if env.get(var):
            return env[var]
    return DEFAULT_PROFILES_FILE if Path(DEFAULT_PROFILES_FILE).is_file() else None


def profile_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment without Hermes's own ``TERMINAL_MODAL_*`` variables."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k not in HERMES_OWN_VARS}


def terminal_profiles(env: Mapping[str, str] | None = None, cls: type[SandboxConfig] = SandboxConfig,
                      defaults: Mapping[str, Any] | None = None) -> tuple[dict[str, SandboxConfig], str]:
    """The terminal tool's profiles and default profile (see the module docstring).

    Args:
        env: the environment (default ``os.environ``).
        cls: the config class.
        defaults: more field values below every other source.

    Raises:
        ConfigError: listing every problem of the file or variables.
    """
    env = profile_env(env)
    return load_profiles(profiles_file(env), env=env, cls=cls,
                         defaults={**terminal_defaults(env), **(defaults or {})})


@dataclass
class ModalProfile:
    """One sandbox profile as the original terminal tool spelled it.

    Units: ``cpu`` in cores, ``memory`` in MiB, ``idle_timeout``, ``max_lifetime``
    and ``scale_down_idle`` in seconds (``scale_down_idle`` may also be True: after
    ``idle_timeout``, or False: never); ``workdir`` None starts the shell in the
    slot's workspace. ``secrets`` are secret names, ``env_vars``
    plain variables set in every slot. ``use_dotenv`` is accepted but has no effect
    (a :class:`~hermes_modal_tool.ConfigWarning` says so when it is true).

    Raises:
        ConfigError: at construction, a value is refused (naming profile and key).

    Example:
        >>> ModalProfile(name="gpu", gpu="T4", max_pool=2).to_config().max_sandboxes
        2
    """

    name: str
    image: str = "python:3.11"
    gpu: str | None = None
    cpu: float = 1.0
    memory: int = 2048
    min_pool: int = 1
    max_pool: int = 5
    idle_timeout: float = 120
    max_lifetime: float = 3600
    scale_down_idle: float | bool = 180
    workdir: str | None = "/workspace"
    secrets: list[str] = field(default_factory=list)
    env_vars: dict[str, str] = field(default_factory=dict)
    use_dotenv: bool = False

    def __post_init__(self) -> None:
        if self.use_dotenv:
            warnings.warn(f"ModalProfile {self.name!r}: use_dotenv has no effect here: "
                          f"{IGNORED_KEYS['USE_DOTENV']}", ConfigWarning, stacklevel=3)
        self.to_config()  # refuse a bad value now, naming the key

    def to_config(self, cls: type[SandboxConfig] = SandboxConfig, **fields: Any) -> SandboxConfig:
        """This profile as a config; ``fields`` set other fields (``slots_per_sandbox``,
        ``driver``, ``execution_timeout_s``, ...).

        Raises:
            ConfigError: naming the profile and every bad key.
        """
        values = {"image": self.image, "gpu": self.gpu, "cpu": self.cpu, "memory": self.memory,
                  "min_pool": self.min_pool, "max_pool": self.max_pool,
                  "idle_timeout": self.idle_timeout, "max_lifetime": self.max_lifetime,
                  "scale_down_idle": self.scale_down_idle, "workdir": self.workdir,
                  "secrets": list(self.secrets), "env_vars": dict(self.env_vars), **fields}
        return cls.from_dict(self.name, values)

    @classmethod
    def from_config(cls, config: SandboxConfig) -> ModalProfile:
        """The view of a config (its other fields are not kept)."""
        return cls(name=config.name, image=config.image, gpu=config.gpu, cpu=config.cpu,
                   memory=config.memory, min_pool=config.min_sandboxes, max_pool=config.max_sandboxes,
                   idle_timeout=config.idle_timeout, max_lifetime=config.max_lifetime,
                   scale_down_idle=config.scale_down_idle,
                   workdir=config.workdir,
                   secrets=list(config.secrets), env_vars=dict(config.env_vars))

    @classmethod
    def from_env(cls, profile_name: str) -> ModalProfile:
        """The profile from ``TERMINAL_MODAL_PROFILE_{profile_name}_{KEY}`` variables
        (the name as written, or upper case) over the original's defaults.
        ``..._SECRETS`` is ``a,b``, ``..._ENV_VARS`` is ``K1=v1;K2=v2``.

        Raises:
            ConfigError: a variable has an unknown key or a bad value (named).
        """
        tag = "TERMINAL_MODAL_PROFILE_"
        spellings = {profile_name, profile_name.upper().replace("-", "_")}
        env = {k: v for k, v in os.environ.items() if k.startswith(tag)
               and (split_profile_var(k[len(tag):]) or ("",))[0] in spellings}
        env["TERMINAL_MODAL_PROFILES"] = env["TERMINAL_MODAL_DEFAULT_PROFILE"] = profile_name
        profiles, _ = load_profiles(None, env=env, prefixes=("TERMINAL_MODAL_",),
                                    defaults=TERMINAL_DEFAULTS)
        return cls.from_config(profiles[profile_name])

    @classmethod
    def load_profiles(cls, config_file: str | os.PathLike[str] | None = None) -> dict[str, ModalProfile]:
        """The profiles the terminal tool uses: from ``config_file``, else as
        :func:`terminal_profiles` finds them. Unlike the original, a bad file raises
        instead of being replaced by defaults.

        Raises:
            ConfigError: listing every problem of the file or variables.
        """
        env = profile_env()
        if config_file is not None:
            profiles, _ = load_profiles(config_file, env=env, defaults=terminal_defaults(env))
        else:
            profiles, _ = terminal_profiles(env)
        return {name: cls.from_config(cfg) for name, cfg in profiles.items()}
