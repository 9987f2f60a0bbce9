"""Profiles: the config model, ``modal_profiles.yaml`` and environment variables.

Nothing falls back silently: every bad input raises ConfigError naming the file
(or variable), the profile and the key.
"""

from __future__ import annotations

import ipaddress
import textwrap
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_modal_tool import (
    ConfigError,
    ConfigWarning,
    ModalSandboxConfig,
    ModalToolBackend,
    SandboxConfig,
    ToolBackend,
    load_profiles,
)

SEED_YAML = """\
profiles:
  default:
    image: python:3.11
    cpu: 1.0
    memory: 2048
    min_pool: 1
    max_pool: 5
    idle_timeout: 120
  gpu:
    image: pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime
    gpu: T4
    memory: 16384
    min_pool: 0
    max_pool: 2
"""


def write(tmp_path: Path, text: str, name: str = "modal_profiles.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(path, **env):
    """load_profiles with a controlled environment (never the real one)."""
    return load_profiles(path, env=env)


# -- the profiles file ---------------------------------------------------------------

def test_seed_yaml_loads(tmp_path):
    profiles, default = load(write(tmp_path, SEED_YAML))
    assert default == "default"
    assert set(profiles) == {"default", "gpu"}
    d, g = profiles["default"], profiles["gpu"]
    assert (d.image, d.cpu, d.memory, d.min_sandboxes, d.max_sandboxes, d.idle_timeout) == (
        "python:3.11", 1.0, 2048, 1, 5, 120)
    assert (g.image, g.gpu, g.memory, g.min_sandboxes, g.max_sandboxes) == (
        "pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime", "T4", 16384, 0, 2)
    assert d.name == "default" and g.name == "gpu"


def test_both_vocabularies(tmp_path):
    path = write(tmp_path, """\
        profiles:
          terminal:
            min_pool: 2
            max_pool: 4
            workdir: /work
          atropos:
            min_sandboxes: 0
            max_sandboxes: 3
            slots_per_sandbox: 8
            workspace_base: /data
        default_profile: atropos
    """)
    profiles, default = load(path)
    assert default == "atropos"
    assert (profiles["terminal"].min_sandboxes, profiles["terminal"].max_sandboxes) == (2, 4)
    assert profiles["terminal"].workdir == "/work"
    assert (profiles["atropos"].min_sandboxes, profiles["atropos"].max_sandboxes) == (0, 3)
    assert profiles["atropos"].slots_per_sandbox == 8


def test_scale_down_idle_secrets_env_vars(tmp_path):
    path = write(tmp_path, """\
        profiles:
          default:
            scale_down_idle: false
            secrets: [my-api-key]
            env_vars: {DEBUG: "1"}
            max_lifetime: 600
    """)
    cfg = load(path)[0]["default"]
    assert cfg.scale_down_idle is False
    assert cfg.secrets == ["my-api-key"]
    assert cfg.env_vars == {"DEBUG": "1"}
    assert cfg.max_lifetime == 600


def test_empty_profile_gets_defaults(tmp_path):
    profiles, _ = load(write(tmp_path, "profiles:\n  default:\n"))
    assert profiles["default"] == SandboxConfig(name="default")


def test_default_profile_must_exist(tmp_path):
    path = write(tmp_path, """\
        default_profile: gpu
        profiles:
          default: {}
    """)
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert str(path) in str(exc.value) and "gpu" in str(exc.value)


def test_modal_cls_makes_modal_the_default_driver(tmp_path):
    path = write(tmp_path, SEED_YAML)
    profiles, _ = load_profiles(path, env={}, cls=ModalSandboxConfig)
    assert profiles["default"].driver == "modal"
    assert load(path)[0]["default"].driver == "local"


def test_with_profiles_reads_the_file(tmp_path):
    path = write(tmp_path, SEED_YAML)
    backend = ToolBackend.with_profiles(app_name="rl", profiles_file=path)
    assert backend.default_profile == "default"
    assert set(backend.list_profiles()) == {"default", "gpu"}
    assert backend.profiles["gpu"].app_name == "rl-gpu"
    modal = ModalToolBackend.with_profiles(app_name="rl", profiles_file=path)
    assert modal.profiles["default"].driver == "modal"


# -- errors in the file ----------------------------------------------------------------

def assert_names(exc: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(exc.value)
    for part in parts:
        assert part in msg, f"{part!r} not named in: {msg}"


def test_unknown_key(tmp_path):
    path = write(tmp_path, """\
        profiles:
          default:
            cpu: 1.0
            cpus: 2
    """)
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "default", "cpus")


def test_wrong_type(tmp_path):
    path = write(tmp_path, """\
        profiles:
          gpu:
            cpu: lots
    """)
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "gpu", "cpu", "lots")


def test_min_greater_than_max(tmp_path):
    path = write(tmp_path, """\
        profiles:
          default:
            min_pool: 4
            max_pool: 2
    """)
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "default")
    msg = str(exc.value)
    assert "min_pool" in msg or "min_sandboxes" in msg
    assert "max_pool" in msg or "max_sandboxes" in msg


def test_same_key_in_both_vocabularies(tmp_path):
    path = write(tmp_path, """\
        profiles:
          default:
            min_pool: 1
            min_sandboxes: 2
    """)
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "default", "min_")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "not found")


def test_invalid_yaml(tmp_path):
    path = write(tmp_path, "profiles:\n  default:\n    cpu: [1, 2\n")
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "YAML")


def test_seed_yaml_as_copied_without_indentation_is_refused(tmp_path):
    # The seed document lost its indentation: that text must not load as something else.
    flat = "\n".join(line.strip() for line in SEED_YAML.splitlines()) + "\n"
    with pytest.raises(ConfigError) as exc:
        load(write(tmp_path, flat))
    assert_names(exc, str(tmp_path))


@pytest.mark.parametrize("body", ["profiles:\n  default: 3\n", "profiles:\n  default: [a, b]\n",
                                  "profiles:\n  default: just-a-string\n"])
def test_profile_not_a_mapping(tmp_path, body):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "default")


@pytest.mark.parametrize("body", ["", "- a\n- b\n", "profiles: 3\n", "profiles: {}\n",
                                  "profile:\n  default: {}\n"])
def test_bad_top_level(tmp_path, body):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path))


def test_with_profiles_does_not_fall_back_on_a_bad_file(tmp_path):
    path = write(tmp_path, "profiles:\n  default:\n    memory: plenty\n")
    with pytest.raises(ConfigError) as exc:
        ToolBackend.with_profiles(app_name="x", profiles_file=path)
    assert_names(exc, str(path), "default", "memory")


# -- environment variables -------------------------------------------------------------

def test_env_for_every_profile():
    profiles, default = load_profiles(env={
        "ATROPOS_MODAL_IMAGE": "python:3.12",
        "ATROPOS_MODAL_MAX_SANDBOXES": "7",
        "TERMINAL_MODAL_MIN_POOL": "2",
        "TERMINAL_MODAL_SECRETS": "one, two,three",
        "TERMINAL_MODAL_ENV_VARS": "a=1;b=2",
    })
    assert default == "default"
    cfg = profiles["default"]
    assert cfg.image == "python:3.12"
    assert cfg.max_sandboxes == 7
    assert cfg.min_sandboxes == 2
    assert cfg.secrets == ["one", "two", "three"]
    assert cfg.env_vars == {"a": "1", "b": "2"}


def test_terminal_prefix_wins_over_atropos():
    profiles, _ = load_profiles(env={"ATROPOS_MODAL_IMAGE": "a", "TERMINAL_MODAL_IMAGE": "b"})
    assert profiles["default"].image == "b"


def test_env_per_profile_wins_over_file(tmp_path):
    path = write(tmp_path, SEED_YAML)
    profiles, _ = load(path, ATROPOS_MODAL_PROFILE_GPU_MAX_POOL="9",
                       ATROPOS_MODAL_PROFILE_GPU_GPU="A100",
                       ATROPOS_MODAL_MEMORY="1024")
    assert profiles["gpu"].max_sandboxes == 9
    assert profiles["gpu"].gpu == "A100"
    # The general variable is below the file: the file's memory stays.
    assert profiles["gpu"].memory == 16384
    assert profiles["default"].memory == 2048
    assert profiles["default"].max_sandboxes == 5


def test_env_profile_name_with_dash(tmp_path):
    path = write(tmp_path, "profiles:\n  pytorch-gpu:\ndefault_profile: pytorch-gpu\n")
    profiles, _ = load(path, TERMINAL_MODAL_PROFILE_PYTORCH_GPU_CPU="4")
    assert profiles["pytorch-gpu"].cpu == 4.0


def test_profiles_file_from_env(tmp_path):
    path = write(tmp_path, SEED_YAML)
    profiles, _ = load_profiles(env={"TERMINAL_MODAL_PROFILES_FILE": str(path)})
    assert set(profiles) == {"default", "gpu"}


def test_missing_profiles_file_from_env_is_an_error(tmp_path):
    missing = tmp_path / "gone.yaml"
    with pytest.raises(ConfigError) as exc:
        load_profiles(env={"TERMINAL_MODAL_PROFILES_FILE": str(missing)})
    assert_names(exc, str(missing))


@pytest.mark.parametrize(("var", "value"), [
    ("ATROPOS_MODAL_CPU", "lots"),
    ("TERMINAL_MODAL_MAX_POOL", "many"),
    ("TERMINAL_MODAL_MIN_POOL", "-1"),
    ("ATROPOS_MODAL_SCALE_DOWN_IDLE", "perhaps"),
    ("TERMINAL_MODAL_ENV_VARS", "a=1;oops"),
    ("TERMINAL_MODAL_ENV_VARS", "1bad=x"),
    ("ATROPOS_MODAL_PROFILE_DEFAULT_MEMORY", "big"),
    ("ATROPOS_MODAL_NO_SUCH_KEY", "1"),
])
def test_bad_env_value_names_the_variable(var, value):
    with pytest.raises(ConfigError) as exc:
        load_profiles(env={var: value})
    assert var in str(exc.value)


def test_env_min_greater_than_max_names_both_variables():
    with pytest.raises(ConfigError) as exc:
        load_profiles(env={"TERMINAL_MODAL_MIN_POOL": "5", "TERMINAL_MODAL_MAX_POOL": "2"})
    msg = str(exc.value)
    assert "default" in msg
    # The values came from variables: the message says which ones to change.
    assert "TERMINAL_MODAL_MIN_POOL" in msg and "TERMINAL_MODAL_MAX_POOL" in msg


def test_unrelated_env_is_ignored():
    profiles, _ = load_profiles(env={"HOME": "/root", "TERMINAL_ENV": "local",
                                     "ATROPOS_OTHER": "x"})
    assert profiles["default"] == SandboxConfig(name="default")


# -- the model itself ------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(lo=st.integers(-3, 20), hi=st.integers(-3, 20))
def test_min_max_validation_property(lo, hi):
    valid = 0 <= lo <= hi and hi >= 1
    if valid:
        cfg = SandboxConfig(min_sandboxes=lo, max_sandboxes=hi)
        assert (cfg.min_sandboxes, cfg.max_sandboxes) == (lo, hi)
    else:
        with pytest.raises(ValueError):
            SandboxConfig(min_sandboxes=lo, max_sandboxes=hi)


@settings(max_examples=40, deadline=None)
@given(path=st.text(alphabet="/ab.", max_size=12))
def test_workspace_base_property(path):
    parts = [p for p in path.split("/") if p]
    ok = path.startswith("/") and parts and not any(p in (".", "..") for p in parts)
    if ok:
        assert SandboxConfig(workspace_base=path).workspace_base == "/" + "/".join(parts)
    else:
        with pytest.raises(ValueError):
            SandboxConfig(workspace_base=path)


@pytest.mark.parametrize("fields", [
    {"min_sandboxes": 3, "max_sandboxes": 1},
    {"cpu": "lots"},
    {"unknown_key": 1},
    {"env_vars": {"not a name": "x"}},
    {"secrets": ["../escape"]},
])
def test_direct_construction_raises_config_error(fields):
    # errors.py: errors of dependencies (pydantic among them) are translated, so a
    # caller never needs to import pydantic to catch a bad config.
    with pytest.raises(ConfigError):
        SandboxConfig(**fields)


def test_unknown_default_profile_raises_when_a_call_needs_it():
    # Code that names a profile on every call never needs the default (the original
    # accepted this); a call that needs it gets a clear error naming both.
    backend = ToolBackend(profiles={"a": SandboxConfig(name="a")}, default_profile="b")
    assert backend.profile("a").name == "a"
    with pytest.raises(ConfigError) as exc:
        backend.profile()
    assert "'b'" in str(exc.value) and "a" in str(exc.value) and "profile=" in str(exc.value)


# -- every problem at once ---------------------------------------------------------------

EVERY_ERROR_YAML = """\
extra: 1
profiles:
  default:
    cpu: lots
    cpus: 2
    memory: 1
    memory: 2
  gpu:
    min_pool: 4
    max_pool: 2
  web: 3
  fine: {}
"""


def test_every_problem_of_a_file_is_reported_at_once(tmp_path):
    path = write(tmp_path, EVERY_ERROR_YAML)
    with pytest.raises(ConfigError) as exc:
        load(path, TERMINAL_MODAL_PROFILE_FINE_MEMORY="big")
    lines = str(exc.value).splitlines()
    assert lines[0] == f"{path}: 7 problems:"
    expected = [("'default'", "'memory'", "twice"), ("'extra'", "unknown key"),
                ("'default'", "'cpu'", "'lots'"), ("'default'", "'cpus'", "unknown key"),
                ("'gpu'", "min_pool", "max_pool"), ("'web'", "mapping"),
                ("TERMINAL_MODAL_PROFILE_FINE_MEMORY", "'fine'", "'big'")]
    for words in expected:
        [line] = [x for x in lines[1:] if all(w in x for w in words)]  # one line per problem
        assert line.startswith(f"- {path}: ") or "TERMINAL_MODAL_PROFILE_FINE_MEMORY" in line


def test_profiles_check_lists_every_error(tmp_path):
    from click.testing import CliRunner

    from hermes_modal_tool import cli

    path = write(tmp_path, EVERY_ERROR_YAML)
    result = CliRunner().invoke(cli.main, ["profiles", "check", str(path)])
    assert result.exit_code == 1
    for words in (["'memory'", "twice"], ["'extra'"], ["'cpu'", "lots"], ["'cpus'"],
                  ["'gpu'", "min_pool"], ["'web'"]):
        assert any(all(w in line and str(path) in line for w in words)
                   for line in result.output.splitlines()), (words, result.output)


def test_profiles_check_lists_every_problem_of_one_profile(tmp_path):
    """A misspelt key and a bad value do not hide the check across keys (min > max):
    ``profiles check`` lists all three problems of the one profile, the typo with a hint."""
    from click.testing import CliRunner

    from hermes_modal_tool import cli

    path = write(tmp_path, "profiles:\n  default:\n    memroy: 2048\n    min_pool: 5\n"
                           "    max_pool: 2\n    cpu: -1\n")
    result = CliRunner().invoke(cli.main, ["profiles", "check", str(path)])
    assert result.exit_code == 1
    assert f"{path}: 3 problems:" in result.output, result.output
    for words in (["'memroy'", "unknown key", "did you mean 'memory'"], ["'cpu'", "(got -1)"],
                  ["min_sandboxes (5)", "max_sandboxes (2)", "min_pool", "max_pool"]):
        assert any(all(w in line for w in words) and "'default'" in line
                   for line in result.output.splitlines()), (words, result.output)
    # A bad value of a key the check across keys reads does not add a second, made-up problem.
    path = write(tmp_path, "profiles:\n  default:\n    min_pool: 5\n    max_pool: lots\n")
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert "max_pool" in str(exc.value) and "greater" not in str(exc.value), str(exc.value)


# -- network ---------------------------------------------------------------------------

@pytest.mark.parametrize(("given_", "mode"), [(True, "egress"), (False, "none"), ("egress", "egress"),
                                              ("none", "none"), ("Host", "host"), ("on", "egress")])
def test_network_modes_and_aliases(given_, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # true's one-time note (tests/net/test_network_default.py)
        assert SandboxConfig(name="n", network=given_).network == mode


def test_network_from_a_variable_keeps_the_aliases():
    profiles, _ = load_profiles(None, env={"ATROPOS_MODAL_NETWORK": "false"})
    assert {p.network for p in profiles.values()} == {"none"}


def test_bad_network_value_is_named(tmp_path):
    path = write(tmp_path, """\
        profiles:
          web:
            network: internet
    """)
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "web", "network", "internet")


@pytest.mark.parametrize(("egress", "named"), [
    ({"allow": ["10.0.0.0/33"]}, "10.0.0.0/33"),
    ({"deny": ["exa mple.com"]}, "exa mple.com"),
    ({"dns": "resolver.example"}, "resolver.example"),
    ({"upstream": "vpn"}, "vpn"),
])
def test_bad_egress_entry_is_named(tmp_path, egress, named):
    path = write(tmp_path, f"profiles:\n  web:\n    network: egress\n    egress: {egress!r}\n")
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert_names(exc, str(path), "web", "egress", named)


@pytest.mark.parametrize(("egress", "key"), [({"deny": ["evil.test"]}, "egress.deny"),
                                            ({"dns": "192.0.2.53"}, "egress.dns"),
                                            ({"upstream": "none"}, "egress.upstream")])
def test_egress_without_a_modal_equivalent_is_refused_on_modal(egress, key):
    assert SandboxConfig(name="ok", network="egress", egress=egress).network == "egress"  # local: fine
    with pytest.raises(ConfigError) as exc:
        SandboxConfig(name="m", driver="modal", network="egress", egress=egress)
    assert_names(exc, "'m'", key, "modal driver")


def test_modal_network_arguments():
    from hermes_modal_tool.modal_network import create_kwargs, open_allowlist

    def kwargs(**fields):
        return create_kwargs(SandboxConfig(name="m", driver="modal", **fields))

    assert kwargs(network="none") == {"block_network": True} and kwargs(network="host") == {}
    assert kwargs(network="egress", egress={"allow": ["203.0.113.0/24", "*.example.test"]}) == {
        "outbound_cidr_allowlist": ["203.0.113.0/24"], "outbound_domain_allowlist": ["*.example.test"]}
    # No allow list: every public IPv4 address, none of the default-denied ranges.
    cidrs = kwargs(network="egress")["outbound_cidr_allowlist"]
    assert cidrs == open_allowlist() and "8.0.0.0/7" in cidrs
    nets = [ipaddress.ip_network(c) for c in cidrs]
    for inside, allowed in (("8.8.8.8", True), ("203.0.113.10", True), ("10.1.2.3", False),
                            ("169.254.169.254", False), ("127.0.0.1", False), ("100.64.0.1", False)):
        assert any(ipaddress.ip_address(inside) in n for n in nets) == allowed, inside
    with pytest.raises(ConfigError) as exc:
        SandboxConfig(name="n", network="egress", isolation="none")
    assert_names(exc, "'n'", "egress", "isolation: bwrap")
