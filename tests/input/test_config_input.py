"""SandboxConfig / ModalSandboxConfig fields and profiles files given bad input.

Every bad value raises ConfigError (never a bare pydantic/yaml/OS error) naming the
key and the value; a bad profiles file names the file, the profile and the key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hermes_modal_tool import ConfigError, ModalSandboxConfig, SandboxConfig, load_profiles

FIELDS = list(SandboxConfig.model_fields)

#: Wrong values per field (each one must be refused).
BAD: dict[str, list[Any]] = {
    "name": ["", 5, None, [], {}],
    "app_name": [5, [], {}],
    "driver": ["docker", "LOCAL", "", 5, None],
    "image": [5, None, [], {}],
    "gpu": [5, [], {}, "T4:0", "H100:x", "", "T4:99"],
    "gpu_sharing": ["mig", "", "MPS", 5, None],
    "gpu_mps_threads": [0, -1, 101, "half", 1.5],
    "gpu_mps_memory": [0, -1, "1G", 1.5, 10**12],
    "volumes": ["/data", [{"source": "relative", "target": "/mnt/x"}],
                [{"source": "/tmp", "target": "/proc/x"}], [{"source": "/tmp", "target": "mnt"}],
                [{"source": "/tmp", "target": "/mnt/x", "read_only": "yes"}], 5],
    "cpu": [0, -1, "lots", math.nan, math.inf, 1e9, None, [], {}],
    "memory": [0, -1, 1.5, "2G", 10**12, 10**400, None, [], {}],
    "slots_per_sandbox": [0, -1, 4097, "ten", 1.5, None, [], {}],
    "min_sandboxes": [-1, "one", 1.5, 10**9, None],
    "max_sandboxes": [0, -1, "five", 2.5, 10**9, None],
    "idle_timeout": [0, -1, "soon", math.nan, None, []],
    "max_lifetime": [0, -5, "long", math.nan, -math.inf, None],
    "acquire_timeout_s": [0, -1, math.nan, math.inf, 86401, "sixty", None],
    "execution_timeout_s": [0, -1, math.nan, math.inf, 10**9, "30s", None],
    "secrets": ["a,b", [5], [""], ["../x"], ["a/b"], [".hidden"], ["a\x00"], {"a": 1}, None],
    "env_vars": [["A=1"], "A=1", {"1A": "x"}, {"": "x"}, {"A-B": "x"}, {"A": 5}, {"A": None},
                 {"\u00e9": "x"}, None],
    "workspace_base": ["data", "", "/", "/a/../b", "/a/./b", "/a\x00b", "/a\nb", 5, None],
    "scale_down_idle": ["maybe", 0, -1, math.nan, math.inf, [], None],
    "workdir": ["data", "", "/", "/a/../b", "/a\x00b", 5],
    "slot_disk": [0, -1, "1G", 1.5, 10**12],
    "snapshot_disk": [0, -1, "1G", 1.5, 10**12, None],
    "setup": ["echo hi", [1], {"a": 1}, 5],
    "filesystem": ["overlay2", "", "none", 5, None],
    "disk_limit": ["quota", "", "none", 5, None],
    "network": ["loopback", 2, [], None],
    "egress": ["all", 5, ["a"], {"allow": ["10.0.0.0/33"]}, {"allow": "x.test"},
               {"upstream": "internet"}, {"dns": "nine"}, {"proxy": "yes"}, {"proxy": 1},
               {"proxy": "http://proxy.test:3128"}, None],
    "spread": ["sometimes", 2, [], None],
    "isolation": ["docker", "", True, None],
    "slot_memory": [0, -1, "1G", 1.5, []],
    "pids_limit": [0, 7, -1, 10**7, "many", None],
    "slot_processes": [0, -1, 5000, "many", None, 2.5],
    "slot_process_output": [0, -1, 5000, "lots", None, 1.5],
    "output_limit": [0, 99, -1, 10**9, "big", None],
    "add_python": ["2.7", "3", "latest", "", 3.11, None],
    "heartbeat_timeout": [0, 2, -1, math.nan, 10**9, "30s", None],
}
CASES = [(f, v) for f in FIELDS for v in BAD.get(f, [])]


def test_every_field_has_bad_values() -> None:
    assert set(BAD) == set(FIELDS), set(FIELDS) ^ set(BAD)


@pytest.mark.parametrize("cls", [SandboxConfig, ModalSandboxConfig])
@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}-{v!r:.15}" for f, v in CASES])
def test_bad_field_value_is_a_config_error_naming_key_and_value(cls: type[SandboxConfig], field: str,
                                                                 value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**{field: value})
    msg = str(info.value)
    assert repr(field) in msg or field in msg, msg
    assert _shows(msg, value), f"{field}={value!r:.40}: the message does not show the value: {msg}"


def _shows(msg: str, value: Any) -> bool:
    """The message shows the bad value, or (for a container) a bad element of it."""
    if isinstance(value, (list, dict)) and value:
        items = list(value.items()) if isinstance(value, dict) else [(v, v) for v in value]
        return any(_shows(msg, k) or _shows(msg, v) for k, v in items)
    return repr(value)[:20] in msg or str(value)[:20] in msg


@pytest.mark.parametrize("cls", [SandboxConfig, ModalSandboxConfig])
@pytest.mark.parametrize("key", ["cpus", "min_pool", "Memory", "", "timeout", "profile"])
def test_unknown_key_is_named(cls: type[SandboxConfig], key: str) -> None:
    with pytest.raises(ConfigError, match="unknown key") as info:
        cls(**{key: 1})
    assert repr(key) in str(info.value)


def test_min_greater_than_max_names_both() -> None:
    with pytest.raises(ConfigError) as info:
        SandboxConfig(min_sandboxes=3, max_sandboxes=2)
    assert "min_sandboxes (3)" in str(info.value) and "max_sandboxes (2)" in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("cpu", -1), ("memory", "lots"), ("driver", "docker"),
                                              ("env_vars", {"1A": "x"}), ("nonexistent", 1)])
def test_assignment_is_validated_with_a_config_error(field: str, value: Any) -> None:
    """validate_assignment=True: a bad assignment must also be a ConfigError naming the key."""
    cfg = SandboxConfig()
    before = cfg.model_dump()
    with pytest.raises(ConfigError) as info:
        setattr(cfg, field, value)
    assert field in str(info.value)
    assert cfg.model_dump() == before


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5)


@pytest.mark.parametrize("field", FIELDS)
def test_random_values_give_a_config_or_a_config_error_naming_the_field(field: str) -> None:
    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(value=json_values)
    @example(value=10**400)
    @example(value=math.nan)
    def prop(value: Any) -> None:
        try:
            cfg = SandboxConfig(**{field: value})
        except ConfigError as exc:
            assert field in str(exc), str(exc)
        else:
            assert isinstance(cfg, SandboxConfig)

    prop()


# -- profiles files --------------------------------------------------------------------

def write(tmp_path: Path, text: str | bytes, name: str = "profiles.yaml") -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


BAD_FILES: list[tuple[str, str | bytes, list[str]]] = [
    ("empty", "", ["empty"]),
    ("only-comment", "# nothing\n", ["empty"]),
    ("not-yaml", "profiles: [unclosed\n", ["not valid YAML", "line"]),
    ("tabs", "profiles:\n\tdefault: {}\n", ["not valid YAML"]),
    ("list-top", "- a\n- b\n", ["mapping", "list"]),
    ("scalar-top", "hello\n", ["mapping", "str"]),
    ("unknown-top-key", "profiles:\n  default: {}\nprofile: x\n", ["'profile'", "unknown key"]),
    ("profiles-list", "profiles:\n  - default\n", ["'profiles'"]),
    ("profiles-str", "profiles: default\n", ["'profiles'"]),
    ("no-profiles", "default_profile: default\n", ["no profile"]),
    ("profile-list", "profiles:\n  default: [1, 2]\n", ["default"]),
    ("profile-str", "profiles:\n  default: big\n", ["default", "big"]),
    ("unknown-key", "profiles:\n  default:\n    cpus: 2\n", ["'default'", "'cpus'", "unknown key"]),
    ("wrong-type", "profiles:\n  gpu:\n    memory: lots\n", ["'gpu'", "'memory'", "lots"]),
    ("alias-wrong-type", "profiles:\n  gpu:\n    max_pool: many\n", ["'gpu'", "'max_pool'", "many"]),
    ("min-gt-max", "profiles:\n  gpu:\n    min_pool: 3\n    max_pool: 1\n", ["'gpu'", "min", "max"]),
    ("both-vocabularies", "profiles:\n  default:\n    min_pool: 1\n    min_sandboxes: 1\n",
     ["'default'", "min_pool", "min_sandboxes"]),
    ("bad-default", "default_profile: gpu\nprofiles:\n  default: {}\n", ["'gpu'", "default"]),
    ("default-not-str", "default_profile: 5\nprofiles:\n  default: {}\n", ["default_profile", "5"]),
    ("int-key", "profiles:\n  default:\n    1: x\n", ["default", "1"]),
    ("workdir-relative", "profiles:\n  default:\n    workdir: data\n", ["'default'", "workdir", "data"]),
    ("env-vars-list", "profiles:\n  default:\n    env_vars: [A=1]\n", ["'default'", "env_vars"]),
    ("secrets-str", "profiles:\n  default:\n    secrets: 5\n", ["'default'", "secrets"]),
    ("non-utf8", b"profiles:\n  default:\n    image: \xff\xfe\n", ["UTF-8"]),
    ("nul-byte", "profiles:\n  default:\n    image: a\x00b\n", ["profiles.yaml"]),
    ("duplicate-key", "profiles:\n  default:\n    cpu: 1\n    cpu: 2\n", ["'default'", "cpu"]),
    ("duplicate-profile", "profiles:\n  default: {cpu: 1}\n  default: {cpu: 2}\n", ["'default'"]),
    ("yaml-tag", "profiles:\n  default: !!python/object:os.system {}\n", ["not valid YAML"]),
    ("anchor", "profiles: {default: {image: &a [x, x], gpu: *a}}\n", ["'default'", "image"]),
]


@pytest.mark.parametrize(("label", "text", "words"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_profiles_file_names_file_profile_and_key(tmp_path: Path, label: str, text: str | bytes,
                                                      words: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_profiles(path, env={})
    msg = str(info.value)
    assert str(path) in msg, f"the file is not named: {msg}"
    for w in words:
        assert w in msg, f"{label}: {w!r} not in {msg!r}"


def test_profiles_path_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_profiles(tmp_path, env={})


@pytest.mark.parametrize("path", ["", "\x00", "a\nb.yaml"])
def test_odd_profiles_paths(tmp_path: Path, path: str) -> None:
    with pytest.raises(ConfigError):
        load_profiles(path, env={})


@pytest.mark.parametrize(("var", "value"), [
    ("ATROPOS_MODAL_MAX_SANDBOXES", "eight"), ("TERMINAL_MODAL_CPU", "-1"),
    ("TERMINAL_MODAL_ENV_VARS", "A"), ("TERMINAL_MODAL_ENV_VARS", "1A=x"), ("TERMINAL_MODAL_NETWORK", "maybe"),
    ("TERMINAL_MODAL_BOGUS", "1"), ("ATROPOS_MODAL_PROFILE_DEFAULT_MEMORY", "lots"),
    ("ATROPOS_MODAL_PROFILE_DEFAULT_NOPE", "1"), ("TERMINAL_MODAL_SECRETS", "../x"),
    ("TERMINAL_MODAL_WORKDIR", "relative"), ("TERMINAL_MODAL_DRIVER", "docker"),
])
def test_bad_environment_variable_is_named(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_profiles(None, env={var: value})
    assert var in str(info.value), str(info.value)


def test_profiles_file_variable_pointing_nowhere(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_profiles(None, env={"TERMINAL_MODAL_PROFILES_FILE": str(tmp_path / "nope.yaml")})


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80) | st.sampled_from(["profiles:\n  a:\n    cpu: ", "profiles: {a: {", "{", ": :"]))
def test_random_profile_files_load_or_raise_config_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text.encode("utf-8", "surrogatepass"), "random.yaml")
    try:
        profiles, default = load_profiles(path, env={})
    except ConfigError as exc:
        assert str(path) in str(exc), str(exc)
    else:
        assert default in profiles
