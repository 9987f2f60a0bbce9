"""Loading profiles: ``modal_profiles.yaml`` and ``ATROPOS_MODAL_*``/``TERMINAL_MODAL_*`` variables.

Where a profile's values come from, lowest to highest precedence:

1. the field defaults of :class:`~hermes_modal_tool.SandboxConfig` (or the caller's
   ``defaults``, e.g. the terminal tool's 60 s command timeout);
2. ``{PREFIX}{KEY}`` environment variables, for every profile;
3. the profiles file, per profile;
4. ``{PREFIX}PROFILE_{NAME}_{KEY}`` environment variables, for profile NAME (NAME
   as the profile is spelled, or upper case with ``-`` as ``_``).

KEY is a field name in upper case, or one of the original implementation's
spellings (:data:`ENV_KEYS`: ``SLOTS``, ``MIN``/``MIN_POOL``, ``MAX``/``MAX_POOL``,
``EXEC_TIMEOUT``, ``ACQUIRE_TIMEOUT``, ``WORKSPACE``). ``SECRETS`` is a comma-separated
list, ``ENV_VARS`` is ``K1=v1;K2=v2``. ``TERMINAL_MODAL_SECRETS`` is added to every
profile's own secrets (as the original terminal tool did) rather than replaced by them.

Which profiles exist: the file's, else the names listed in ``{PREFIX}PROFILES``,
else the names that ``TERMINAL_MODAL_PROFILE_<name>_<KEY>`` variables mention, else
one profile, ``default``. The default profile: ``{PREFIX}DEFAULT_PROFILE``, else the
file's ``default_profile:``, else ``default``, else (with a :class:`ConfigWarning`)
the first profile.

Nothing falls back silently: an unknown key, a wrong type, ``min > max``, a
default profile that is named but missing, or a missing profiles file raises one
:class:`~hermes_modal_tool.errors.ConfigError` listing every problem found, each
naming the file (or variable), the profile and the key. Settings of the original
that mean nothing here (``USE_DOTENV``) and per-profile variables naming a profile
that does not exist are reported with a :class:`ConfigWarning`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .errors import ConfigError, ConfigWarning

if TYPE_CHECKING:
    from .config import SandboxConfig

# The terminal tool's words for our fields.
ALIASES = {"min_pool": "min_sandboxes", "max_pool": "max_sandboxes"}
ENV_PREFIXES = ("ATROPOS_MODAL_", "TERMINAL_MODAL_")
#: Environment keys that differ from the field name (the original's spellings).
ENV_KEYS = {"ACQUIRE_TIMEOUT": "acquire_timeout_s", "EXECUTION_TIMEOUT": "execution_timeout_s",
            "EXEC_TIMEOUT": "execution_timeout_s", "MIN_POOL": "min_sandboxes",
            "MAX_POOL": "max_sandboxes", "MIN": "min_sandboxes", "MAX": "max_sandboxes",
            "SLOTS": "slots_per_sandbox", "WORKSPACE": "workspace_base"}
#: Keys the original read that have no effect here: a true value is warned about.
IGNORED_KEYS = {"USE_DOTENV": "loading ./.env into the sandbox is not supported; put the variables "
                              "in a secret (secrets: [name]) or in env_vars"}
# Variables with these prefixes that are not profile keys (MODE is set by Hermes's CLI).
_NOT_FROM_ENV = {"PROFILES", "PROFILES_FILE", "DEFAULT_PROFILE", "MODE"}
_TRUE = {"1", "true", "yes", "on"}


#: The config class profiles are built with when a caller names none (``cls``): set by
#: :mod:`.config` when it defines :class:`~hermes_modal_tool.SandboxConfig`. Config imports
#: this module and this module never imports config, so the two stay one-way.
_default_model: type[SandboxConfig] | None = None


def set_default_model(cls: type[SandboxConfig]) -> None:
    """Name the config class used when a caller gives no ``cls`` (called by :mod:`.config`)."""
    global _default_model
    _default_model = cls


def _model() -> type[SandboxConfig]:
    if _default_model is None:  # config.py is imported with the package, so it is set
        raise RuntimeError("hermes_modal_tool.config has not set the default config class")
    return _default_model


def _fields() -> set[str]:
    return set(_model().model_fields)


def _known_keys() -> list[str]:
    keys = {f.upper() for f in _fields()} | set(ENV_KEYS) | set(IGNORED_KEYS)
    return sorted(keys, key=len, reverse=True)


def _key_field(key: str) -> str:
    return ENV_KEYS.get(key, key.lower())


def _env_name(profile: str) -> str:
    return profile.upper().replace("-", "_")


def split_profile_var(rest: str) -> tuple[str, str] | None:
    """``"my-gpu_MAX_POOL"`` -> ``("my-gpu", "MAX_POOL")``; None when no known key ends it."""
    for key in _known_keys():
        if rest.endswith("_" + key) and len(rest) > len(key) + 1:
            return rest[: -len(key) - 1], key
    return None


def _own_key(rest: str, spellings: set[str]) -> str | None:
    """The KEY of ``<name>_<KEY>`` when ``<name>`` is one of ``spellings``, else None."""
    for name in spellings:
        if rest.startswith(name + "_") and rest[len(name) + 1:] in _known_keys():
            return rest[len(name) + 1:]
    return None


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
    if field == "scale_down_idle":
        low = raw.strip().lower()
        if low in ("true", "yes", "on", "false", "no", "off"):
            return low in ("true", "yes", "on")
        try:
            return float(raw)  # a number of seconds (the original's meaning)
        except ValueError:
            return raw  # refused by validation, naming the variable
    if field in ("gpu", "slot_memory", "app_name", "slot_disk") and raw.strip() == "":
        return None
    return raw


class _EnvReader:
    """Reads the variables of one environment; collects problems instead of raising."""

    def __init__(self, env: Mapping[str, str], prefixes: tuple[str, ...], problems: list[str]) -> None:
        self.env = env
        self.prefixes = prefixes
        self.problems = problems
        self.used: set[str] = set()

    def _add(self, values: dict[str, Any], names: dict[str, str], var: str, key: str,
             where: str) -> None:
        if key in IGNORED_KEYS:
            self.used.add(var)
            if self.env[var].strip().lower() in _TRUE:
                warnings.warn(f"environment variable {var}: has no effect here: {IGNORED_KEYS[key]}",
                              ConfigWarning, stacklevel=4)
            return
        field = _key_field(key)
        if field not in _fields():
            self.problems.append(f"{where}: unknown key {key!r}")
            return
        try:
            value = _parse_env(field, self.env[var])
        except ValueError as exc:
            self.problems.append(f"{where}: {exc}")
            return
        self.used.add(var)
        if field in names and values[field] != value:
            self.problems.append(f"{where}: {names[field]} and {var} both set {field}; give one")
            return
        values[field] = value
        names[field] = var

    def general(self) -> tuple[dict[str, Any], dict[str, str]]:
        """Values of ``{prefix}{KEY}`` for every profile (later prefixes win)."""
        values: dict[str, Any] = {}
        names: dict[str, str] = {}
        for prefix in self.prefixes:
            mine: dict[str, Any] = {}
            my_names: dict[str, str] = {}
            for var in sorted(self.env):
                if not var.startswith(prefix):
                    continue
                key = var[len(prefix):]
                if key.startswith("PROFILE_") or key in _NOT_FROM_ENV:
                    continue
                self._add(mine, my_names, var, key, f"environment variable {var}")
            values.update(mine)
            names.update(my_names)
        return values, names

    def for_profile(self, profile: str) -> tuple[dict[str, Any], dict[str, str]]:
        """Values of ``{prefix}PROFILE_{NAME}_{KEY}`` for one profile."""
        values: dict[str, Any] = {}
        names: dict[str, str] = {}
        spellings = {profile, _env_name(profile)}
        for prefix in self.prefixes:
            mine: dict[str, Any] = {}
            my_names: dict[str, str] = {}
            tag = f"{prefix}PROFILE_"
            for var in sorted(self.env):
                if not var.startswith(tag):
                    continue
                key = _own_key(var[len(tag):], spellings)
                if key is None:
                    continue
                self._add(mine, my_names, var, key, f"environment variable {var}: profile {profile!r}")
            values.update(mine)
            names.update(my_names)
        return values, names

    def profile_names(self, prefix: str) -> list[str]:
        """Profile names mentioned by ``{prefix}PROFILE_<name>_<KEY>`` variables, in order."""
        tag = f"{prefix}PROFILE_"
        found: dict[str, None] = {}
        for var in sorted(self.env):
            if var.startswith(tag):
                split = split_profile_var(var[len(tag):])
                if split is not None:
                    found[split[0]] = None
        return list(found)

    def leftovers(self, profiles: list[str], where: str) -> None:
        """Warn about per-profile variables no profile took; an unknown key is a problem."""
        for prefix in self.prefixes:
            tag = f"{prefix}PROFILE_"
            for var in sorted(self.env):
                if not var.startswith(tag) or var in self.used:
                    continue
                split = split_profile_var(var[len(tag):])
                if split is None:
                    self.problems.append(f"environment variable {var}: unknown key in "
                                         f"{var[len(tag):]!r} (expected {tag}<profile>_<KEY>)")
                elif not any(_own_key(var[len(tag):], {p, _env_name(p)}) for p in profiles):
                    warnings.warn(f"environment variable {var}: there is no profile {split[0]!r} in "
                                  f"{where} (profiles: {', '.join(profiles)}); the variable has no "
                                  "effect", ConfigWarning, stacklevel=3)

    def first(self, key: str) -> tuple[str, str] | None:
        """``(variable, value)`` of the last prefix that sets ``{prefix}{key}``."""
        found = None
        for prefix in self.prefixes:
            if self.env.get(f"{prefix}{key}"):
                found = (f"{prefix}{key}", self.env[f"{prefix}{key}"])
        return found


def load_profiles(
    profiles_file: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    prefixes: tuple[str, ...] = ENV_PREFIXES,
    cls: type[SandboxConfig] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> tuple[dict[str, SandboxConfig], str]:
    """Load profiles; return ``(profiles, default_profile)``.

    Args:
        profiles_file: a YAML file; if None, ``{prefix}PROFILES_FILE`` is used when set.
        env: the environment to read (default ``os.environ``).
        prefixes: variable prefixes, later ones winning (``ATROPOS_MODAL_``,
            ``TERMINAL_MODAL_``).
        cls: the config class (``ModalSandboxConfig`` makes ``driver="modal"`` the default).
        defaults: field values below every other source (field name -> value).

    Raises:
        ConfigError: the file is missing, unreadable, not YAML, has the wrong shape,
            or a profile has an unknown key, a wrong type or ``min > max``; one error
            lists every problem found.
    """
    cls = cls or _model()
    env = os.environ if env is None else env
    problems: list[str] = []
    reader = _EnvReader(env, prefixes, problems)
    base, base_names = reader.general()
    base = {**(defaults or {}), **base}
    if profiles_file is None:
        found = reader.first("PROFILES_FILE")
        profiles_file = found[1] if found else None
    default: str | None = None
    where = "environment"
    if profiles_file is not None:
        where = str(profiles_file)
        raw_profiles, default = _read(profiles_file, problems)
    else:
        listed = reader.first("PROFILES")
        if listed:
            names = [p.strip() for p in listed[1].split(",") if p.strip()]
        else:
            names = [n for p in prefixes if p == "TERMINAL_MODAL_" for n in reader.profile_names(p)]
        raw_profiles = {n: {} for n in (names or ["default"])}
    chosen = reader.first("DEFAULT_PROFILE")
    if chosen:
        default, where_default = chosen[1].strip(), f"environment variable {chosen[0]}"
    else:
        where_default = f"{where}: default_profile"
    global_secrets = env.get("TERMINAL_MODAL_SECRETS") if "TERMINAL_MODAL_" in prefixes else None
    profiles: dict[str, SandboxConfig] = {}
    for name, data in raw_profiles.items():
        name = str(name)
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            problems.append(f"{where}: profile {name!r}: expected a mapping of keys, got "
                            f"{type(data).__name__} {data!r:.80}")
            continue
        file_values = _from_file(data, where, name, problems)
        merged = {**base, **file_values}
        keys = {**base_names, **{f: k for k, f in ((k, ALIASES.get(k, k)) for k in data)}}
        vals, names_ = reader.for_profile(name)
        merged.update(vals)
        keys.update(names_)
        if global_secrets and ("secrets" in file_values or "secrets" in vals) and isinstance(
                merged.get("secrets"), list):
            merged["secrets"] = list(dict.fromkeys([*merged["secrets"], *_parse_env("secrets", global_secrets)]))
        cfg, errs = cls.check_profile(name, merged, where, keys)
        problems.extend(errs)
        if cfg is not None:
            profiles[name] = cfg
    reader.leftovers(list(raw_profiles), where)
    names_all = [str(n) for n in raw_profiles]
    if default is None:
        default = "default"
        if "default" not in names_all and names_all:
            default = names_all[0]
            if not problems:
                warnings.warn(f"{where}: no profile 'default' and no default_profile given; using "
                              f"{default!r} (the first profile) when a call names none", ConfigWarning,
                              stacklevel=2)
    elif default not in names_all:
        problems.append(f"{where_default} {default!r} is not one of the profiles "
                        f"({', '.join(names_all) or 'none defined'})")
    if problems:
        raise_all(problems, where)
    return profiles, default


def raise_all(problems: list[str], where: str) -> None:
    """Raise one ConfigError listing every problem (each names its source)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    raise ConfigError(f"{where}: {len(problems)} problems:\n- " + "\n- ".join(problems))


def _from_file(data: Mapping[str, Any], where: str, profile: str, problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            problems.append(f"{where}: profile {profile!r}: key {key!r} is not a string")
            continue
        if key.upper() in IGNORED_KEYS:
            if value is True or str(value).strip().lower() in _TRUE:
                warnings.warn(f"{where}: profile {profile!r}: key {key!r} has no effect here: "
                              f"{IGNORED_KEYS[key.upper()]}", ConfigWarning, stacklevel=3)
            continue
        field = ALIASES.get(key, key)
        if field in out:
            other = next(k for k in data if k != key and ALIASES.get(k, k) == field)
            problems.append(f"{where}: profile {profile!r}: keys {other!r} and {key!r} both set "
                            f"{field}; give one")
            continue
        out[field] = value
    return out


def _duplicate_keys(node: Any, where: str, problems: list[str], path: tuple[str, ...] = ()) -> None:
    """Report every key given twice in one mapping (YAML itself would keep the last)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                profile = f"profile {path[1]!r}: " if len(path) >= 2 and path[0] == "profiles" else ""
                problems.append(f"{where}: {profile}key {key!r} appears twice "
                                f"(lines {seen[key]} and {line})")
            else:
                seen[key] = line
            _duplicate_keys(value_node, where, problems, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _duplicate_keys(item, where, problems, path)


def _read(path: str | os.PathLike[str], problems: list[str]) -> tuple[dict[str, Any], str | None]:
    """The file's profiles (raw) and its ``default_profile:`` (None when absent).

    A file that cannot be read or parsed raises at once; problems of its shape are
    added to ``problems`` and reading goes on.
    """
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
        _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), str(p), problems)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        raise ConfigError(f"{p}: profiles file is empty; expected 'profiles:'")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{p}: expected a mapping with 'profiles:', got {type(data).__name__}")
    for key in data:
        if key not in ("profiles", "default_profile"):
            problems.append(f"{p}: key {key!r}: unknown key (got {data[key]!r:.80})")
    default = data.get("default_profile")
    if "default_profile" in data and not (isinstance(default, str) and default):
        problems.append(f"{p}: key 'default_profile': expected a profile name (got {default!r:.80})")
        default = None
    profiles = data.get("profiles")
    if profiles is not None and not isinstance(profiles, Mapping):
        problems.append(f"{p}: key 'profiles': expected a mapping of profile name -> keys "
                        f"(got {profiles!r:.80})")
        profiles = None
    if not profiles:
        problems.append(f"{p}: 'profiles:' defines no profile")
        profiles = {}
    return dict(profiles), default


def read_profiles_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a profiles YAML file's top level: ``{"profiles": {...}, "default_profile": name|None}``
    (the profiles themselves are validated by :func:`load_profiles`).

    Raises:
        ConfigError: the file is missing, unreadable, not YAML or has the wrong shape
            (every problem of its shape listed).
    """
    problems: list[str] = []
    profiles, default = _read(path, problems)
    if problems:
        raise_all(problems, str(path))
    return {"profiles": profiles, "default_profile": default}
