"""Porting from the original: configuration and code written for the Hermes fork's
``tools/terminal_tool.py`` and ``atropos/backends/modal_backend.py``, unchanged but
for the import, on both drivers.

Each test writes configuration the way the original's users do (its environment
variables and its ``modal_profiles.yaml`` forms) and checks that the values land
where the original put them, that nothing raises, and that whatever has no effect
here is reported with a ConfigWarning naming the variable or key.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import running_sandboxes
from support import TOKEN_VAR, Leftovers, describe

from hermes_modal_tool import (
    ConfigError,
    ConfigWarning,
    ExecutionResult,
    ModalSandboxConfig,
    ModalToolBackend,
    ToolResult,
    load_profiles,
)
from hermes_modal_tool.adapters.hermes import (
    ModalProfile,
    cleanup_all_environments,
    get_active_environments_info,
    terminal_tool,
)
from hermes_modal_tool.adapters.hermes_profiles import terminal_profiles


def run(command: str, **kwargs: Any) -> dict[str, Any]:
    return json.loads(terminal_tool(command, **kwargs))


@pytest.fixture
def original_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, driver: str,
                 request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """A clean environment for the terminal tool on ``driver``: no TERMINAL_*/ATROPOS_*
    variables, secrets ``a`` and ``b`` for either driver, local state under a fresh
    directory; afterwards every backend is stopped and nothing is left behind."""
    for var in list(os.environ):
        if var.startswith(("TERMINAL_", "ATROPOS_MODAL_")):
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    token = uuid.uuid4().hex
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    (secrets_dir / "a.env").write_text("A_SECRET=sa\n")
    (secrets_dir / "b.env").write_text("B_SECRET=sb\n")
    monkeypatch.setenv("HERMES_MODAL_TOOL_SECRETS_DIR", str(secrets_dir))
    server = None
    if driver == "modal":
        server = request.getfixturevalue("modal_server")
        server.add_secret("a", {"A_SECRET": "sa"})
        server.add_secret("b", {"B_SECRET": "sb"})
    monkeypatch.setenv("TERMINAL_ENV", driver)
    state = Path(tempfile.mkdtemp(prefix="hmt-porting-", dir="/tmp"))
    state.chmod(0o711)  # slots (other uids) traverse it
    monkeypatch.setattr(tempfile, "tempdir", str(state))
    cleanup_all_environments()
    leftovers = Leftovers(token)
    try:
        yield {"token": token, "server": server, "dir": tmp_path}
    finally:
        cleanup_all_environments()
        deadline = time.monotonic() + 3
        while leftovers.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not leftovers.processes(), f"left behind: {describe(leftovers.processes())}"
        left = list(state.iterdir())
        shutil.rmtree(state, ignore_errors=True)
        assert not left, f"state left behind: {left}"
        if server is not None:
            for name in ("default", "testenv", "gpu"):
                assert not running_sandboxes(server, name), f"sandboxes of {name} left running"


def no_config_warnings(caught: list[warnings.WarningMessage]) -> None:
    config = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert not config, config


# -- the terminal tool, configured by environment variables ---------------------------------

def test_terminal_tool_with_the_originals_variables(original_env, monkeypatch):
    env = {
        # the original slot pool's variables, for every profile
        "TERMINAL_MODAL_SLOTS": "3", "TERMINAL_MODAL_MIN": "1", "TERMINAL_MODAL_MAX": "2",
        "TERMINAL_MODAL_EXEC_TIMEOUT": "2", "TERMINAL_MODAL_WORKSPACE": "/workspace/slots",
        "TERMINAL_MODAL_ACQUIRE_TIMEOUT": "30", "TERMINAL_MODAL_MEMORY": "1024",
        "TERMINAL_MODAL_IDLE_TIMEOUT": "100", "TERMINAL_MODAL_MAX_LIFETIME": "900",
        # the original terminal tool's
        "TERMINAL_MODAL_SCALE_DOWN_IDLE": "180", "TERMINAL_MODAL_DEFAULT_PROFILE": "testenv",
        "TERMINAL_MODAL_PROFILE_testenv_IMAGE": "python:3.11",
        "TERMINAL_MODAL_PROFILE_testenv_ENV_VARS": f"K1=v1;K2=v2;{TOKEN_VAR}={original_env['token']}",
        "TERMINAL_MODAL_PROFILE_testenv_SECRETS": "a,b",
        "TERMINAL_MODAL_PROFILE_testenv_MAX_POOL": "1",
        "TERMINAL_CWD": "/srv/app",
        "TERMINAL_LIFETIME_SECONDS": "300",
    }
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        [profile] = ModalProfile.load_profiles().values()
        configs, default = terminal_profiles()
        hello = run("echo $K1 $K2 $A_SECRET $B_SECRET", task_id="t1")
        slow = run("echo started; sleep 10", task_id="t1")
        wrote = run("head -c 1048576 /dev/zero > blob && echo done", task_id="t1")
        info = get_active_environments_info()
    no_config_warnings(caught)
    # Where the original put each value.
    assert default == "testenv" and profile.name == "testenv"
    assert (profile.image, profile.min_pool, profile.max_pool, profile.idle_timeout,
            profile.max_lifetime, profile.scale_down_idle, profile.workdir) == (
        "python:3.11", 1, 1, 100, 900, 180, "/srv/app")
    assert profile.secrets == ["a", "b"] and profile.env_vars["K1"] == "v1"
    cfg = configs["testenv"]
    assert (cfg.slots_per_sandbox, cfg.execution_timeout_s, cfg.workspace_base,
            cfg.acquire_timeout_s, cfg.memory, cfg.scale_down_after) == (3, 2, "/workspace/slots", 30, 1024, 180)
    # And the tool runs with them.
    assert hello == {"output": "v1 v2 sa sb\n", "exit_code": 0, "error": None}
    assert slow["exit_code"] == 124 and slow["output"].startswith("started")  # EXEC_TIMEOUT: 2 s
    assert wrote["output"] == "done\n"
    assert info["workdirs"] == {"t1": "/srv/app"}
    assert info["tasks"]["t1"]["workspace"].startswith("/workspace/slots/slot_")
    assert info["tasks"]["t1"]["profile"] == "testenv"
    assert info["total_slots"] == 3 and info["total_disk_usage_mb"] >= 1.0


@pytest.mark.parametrize("driver", ["modal"], indirect=True)  # slot_pool is the Modal driver
def test_the_original_slot_pool_is_modal(original_env, monkeypatch):
    monkeypatch.setenv("TERMINAL_ENV", "slot_pool")
    monkeypatch.setenv("TERMINAL_SLOT_APP_NAME", "my-slot-pool")
    monkeypatch.setenv("TERMINAL_MODAL_SLOTS", "2")
    monkeypatch.setenv("TERMINAL_MODAL_ENV_VARS", f"{TOKEN_VAR}={original_env['token']}")
    assert run("echo pooled", task_id="p")["output"] == "pooled\n"
    [record] = running_sandboxes(original_env["server"], "default")
    assert record.app_name == "my-slot-pool"
    assert get_active_environments_info()["env_type"] == "modal"


def test_terminal_tool_finds_modal_profiles_yaml_in_the_current_directory(original_env):
    # The original terminal tool's YAML: ModalProfile fields, scale_down_idle in seconds.
    token = original_env["token"]
    (original_env["dir"] / "modal_profiles.yaml").write_text(f"""\
profiles:
  default:
    image: python:3.11
    min_pool: 1
    max_pool: 1
    idle_timeout: 120
    max_lifetime: 3600
    scale_down_idle: 180
    memory: 1024
    env_vars: {{WHO: default, {TOKEN_VAR}: {token}}}
  gpu:
    image: python:3.11
    min_pool: 0
    max_pool: 1
    scale_down_idle: 60
    workdir: /workspace/gpu
    memory: 1024
    secrets: [a]
    env_vars: {{WHO: gpu, {TOKEN_VAR}: {token}}}
    use_dotenv: false
""")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = run("echo $WHO", task_id="x")
        gpu = run("echo $WHO $A_SECRET", task_id="y", profile="gpu")
        info = get_active_environments_info()
        profiles = ModalProfile.load_profiles()
    no_config_warnings(caught)
    assert plain["output"] == "default\n" and gpu["output"] == "gpu sa\n"
    assert info["workdirs"] == {"x": "/workspace", "y": "/workspace/gpu"}
    assert profiles["gpu"].scale_down_idle == 60 and profiles["default"].max_pool == 1


# -- the Atropos backend, as the original's code calls it ------------------------------------

async def test_atropos_backend_code_runs_unchanged(make_backend, driver):
    tag = make_backend.leftovers.tag
    config = ModalSandboxConfig(name="cpu", slots_per_sandbox=2, min_sandboxes=0, max_sandboxes=1,
                                memory=1024, driver=driver)
    config = tag(config.with_app_name(base_app="my-training"))
    assert config.app_name == "my-training-cpu"
    # Profiles without "default", default_profile left at "default": fine until a call needs it.
    backend = ModalToolBackend.with_profiles(app_name="rl", profiles={"cpu": config},
                                             default_profile="default")
    await make_backend.adopt(backend)
    with pytest.warns(ConfigWarning, match="default_profile 'default'"):
        await backend.start()
    slot = await backend.acquire(None, profile="cpu")
    assert slot.trajectory_id and slot.trajectory_id.startswith("traj-")
    assert backend.default_timeout_s is None  # no default profile
    [r] = await backend.execute_batch([(slot, "bash", {"command": "echo hi"})], timeout_s=30)
    tool = r.to_tool_result()
    assert isinstance(tool, ToolResult)
    assert (tool.success, tool.output, tool.error, tool.uniq_id) == (True, "hi\n", "", r.execution_id)
    assert tool.metadata["returncode"] == 0 and '"output": "hi\\n"' in tool.to_xml()
    status = backend.get_status()
    assert (status["profiles"], status["active_pools"], status["default_profile"]) == (
        ["cpu"], ["cpu"], "default")
    assert (status["healthy_sandboxes"], status["max_sandboxes"], status["sandboxes"]) == (1, 1, 1)
    assert status["pools"]["cpu"]["healthy_sandboxes"] == 1
    with pytest.raises(ConfigError, match="default_profile 'default' is not one of the profiles"):
        await backend.acquire("needs-the-default")
    await backend.release(slot)
    await backend.stop()


async def test_single_profile_status_and_timeout(make_backend, driver):
    config = make_backend.leftovers.tag(ModalSandboxConfig(
        name="default", slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=2, memory=1024,
        execution_timeout_s=45, driver=driver))
    backend = ModalToolBackend(config)
    await make_backend.adopt(backend, start=True)
    assert backend.default_timeout_s == 45
    status = backend.get_status()
    assert (status["healthy_sandboxes"], status["max_sandboxes"], status["slots_per_sandbox"]) == (1, 2, 2)
    a, b = await asyncio.gather(backend.acquire(), backend.acquire())
    assert a.trajectory_id != b.trajectory_id and None not in (a.trajectory_id, b.trajectory_id)
    await backend.stop()


# -- configuration only (no sandboxes) ---------------------------------------------------------

ORIGINAL_VARIABLES = [
    # (variable, value, field, expected)
    ("TERMINAL_MODAL_SLOTS", "7", "slots_per_sandbox", 7),
    ("TERMINAL_MODAL_MIN", "0", "min_sandboxes", 0),
    ("TERMINAL_MODAL_MAX", "9", "max_sandboxes", 9),
    ("TERMINAL_MODAL_MIN_POOL", "2", "min_sandboxes", 2),
    ("TERMINAL_MODAL_MAX_POOL", "3", "max_sandboxes", 3),
    ("TERMINAL_MODAL_EXEC_TIMEOUT", "300", "execution_timeout_s", 300),
    ("TERMINAL_MODAL_ACQUIRE_TIMEOUT", "20", "acquire_timeout_s", 20),
    ("TERMINAL_MODAL_WORKSPACE", "/scratch", "workspace_base", "/scratch"),
    ("TERMINAL_MODAL_SCALE_DOWN_IDLE", "180", "scale_down_idle", 180),
    ("TERMINAL_MODAL_SCALE_DOWN_IDLE", "false", "scale_down_idle", False),
    ("TERMINAL_MODAL_IDLE_TIMEOUT", "60", "idle_timeout", 60),
    ("TERMINAL_MODAL_MAX_LIFETIME", "600", "max_lifetime", 600),
    ("TERMINAL_MODAL_IMAGE", "python:3.12", "image", "python:3.12"),
    ("TERMINAL_MODAL_GPU", "T4", "gpu", "T4"),
    ("TERMINAL_MODAL_CPU", "2", "cpu", 2.0),
    ("TERMINAL_MODAL_MEMORY", "4096", "memory", 4096),
    ("TERMINAL_MODAL_SECRETS", "a, b", "secrets", ["a", "b"]),
    ("TERMINAL_MODAL_APP_NAME", "hermes-sandbox", "app_name", "hermes-sandbox"),
    ("TERMINAL_CWD", "/home/me/project", "workdir", "/home/me/project"),
    ("ATROPOS_MODAL_SLOTS_PER_SANDBOX", "4", "slots_per_sandbox", 4),
    ("ATROPOS_MODAL_MIN_SANDBOXES", "0", "min_sandboxes", 0),
    ("ATROPOS_MODAL_MAX_SANDBOXES", "8", "max_sandboxes", 8),
    ("ATROPOS_MODAL_EXECUTION_TIMEOUT", "15", "execution_timeout_s", 15),
    ("ATROPOS_MODAL_WORKSPACE_BASE", "/data2", "workspace_base", "/data2"),
    ("ATROPOS_MODAL_ENV_VARS", "K1=v1;K2=v2", "env_vars", {"K1": "v1", "K2": "v2"}),
]


@pytest.mark.parametrize(("var", "value", "field", "expected"), ORIGINAL_VARIABLES,
                         ids=[f"{v[0]}={v[1]}" for v in ORIGINAL_VARIABLES])
def test_each_original_variable_lands_in_its_field(var, value, field, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configs, default = terminal_profiles({var: value})
    no_config_warnings(caught)
    assert getattr(configs[default], field) == expected


def test_terminal_defaults_are_the_originals():
    [cfg] = terminal_profiles({})[0].values()
    assert (cfg.execution_timeout_s, cfg.workdir, cfg.scale_down_idle) == (60, "/workspace", 180)
    assert ModalProfile(name="x") == ModalProfile.from_config(ModalProfile(name="x").to_config())
    original = ModalProfile(name="x")
    assert (original.image, original.gpu, original.cpu, original.memory, original.min_pool,
            original.max_pool, original.idle_timeout, original.max_lifetime,
            original.scale_down_idle, original.workdir, original.secrets, original.env_vars) == (
        "python:3.11", None, 1.0, 2048, 1, 5, 120, 3600, 180, "/workspace", [], {})


def test_profile_variables_in_their_original_case(monkeypatch):
    for var in list(os.environ):
        if var.startswith(("TERMINAL_", "ATROPOS_MODAL_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("TERMINAL_MODAL_PROFILE_testenv_IMAGE", "python:3.12")
    monkeypatch.setenv("TERMINAL_MODAL_PROFILE_testenv_SECRETS", "a,b")
    monkeypatch.setenv("TERMINAL_MODAL_PROFILE_testenv_ENV_VARS", "K1=v1;K2=v2")
    monkeypatch.setenv("TERMINAL_MODAL_PROFILE_testenv_SCALE_DOWN_IDLE", "90")
    monkeypatch.setenv("TERMINAL_MODAL_PROFILE_testenv_WORKDIR", "/srv")
    monkeypatch.setenv("TERMINAL_MODAL_PROFILE_my-gpu_GPU", "A100")
    monkeypatch.setenv("TERMINAL_MODAL_DEFAULT_PROFILE", "testenv")
    profile = ModalProfile.from_env("testenv")
    assert (profile.image, profile.secrets, profile.env_vars, profile.scale_down_idle, profile.workdir) == (
        "python:3.12", ["a", "b"], {"K1": "v1", "K2": "v2"}, 90, "/srv")
    profiles = ModalProfile.load_profiles()
    assert set(profiles) == {"testenv", "my-gpu"} and profiles["my-gpu"].gpu == "A100"
    assert terminal_profiles()[1] == "testenv"
    # The Atropos spelling: upper case, "-" as "_".
    assert ModalSandboxConfig.from_env("my-gpu", env={"ATROPOS_MODAL_PROFILE_MY_GPU_GPU": "H100"}).gpu == "H100"


def test_global_secrets_are_added_to_each_profiles_own(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("profiles:\n  default:\n    secrets: [own]\n  other: {}\n")
    profiles, _ = load_profiles(path, env={"TERMINAL_MODAL_SECRETS": "shared,own"})
    assert profiles["default"].secrets == ["own", "shared"]
    assert profiles["other"].secrets == ["shared", "own"]


def test_settings_without_effect_are_warned_about_by_name(tmp_path):
    with pytest.warns(ConfigWarning, match="TERMINAL_MODAL_PROFILE_testenv_USE_DOTENV"):
        terminal_profiles({"TERMINAL_MODAL_PROFILE_testenv_USE_DOTENV": "true",
                           "TERMINAL_MODAL_DEFAULT_PROFILE": "testenv"})
    path = tmp_path / "p.yaml"
    path.write_text("profiles:\n  default:\n    use_dotenv: true\n")
    with pytest.warns(ConfigWarning, match="use_dotenv"):
        load_profiles(path, env={})
    path.write_text("profiles:\n  default: {}\n")
    with pytest.warns(ConfigWarning, match="TERMINAL_MODAL_PROFILE_gpu_GPU.*no profile 'gpu'"):
        load_profiles(path, env={"TERMINAL_MODAL_PROFILE_gpu_GPU": "T4"})
    with pytest.warns(ConfigWarning, match="use_dotenv"):
        ModalProfile(name="x", use_dotenv=True)
    # A file without "default" and no default named: the first profile, said aloud.
    path.write_text("profiles:\n  testenv: {}\n  gpu: {}\n")
    with pytest.warns(ConfigWarning, match="'testenv'"):
        assert load_profiles(path, env={})[1] == "testenv"


def test_the_originals_other_variables_are_warned_about(original_env, monkeypatch):
    monkeypatch.setenv("TERMINAL_MODAL_ENV_VARS", f"{TOKEN_VAR}={original_env['token']}")
    monkeypatch.setenv("TERMINAL_DISK_WARNING_GB", "500")
    monkeypatch.setenv("SUDO_PASSWORD", "hunter2")
    with pytest.warns(ConfigWarning) as caught:
        assert run("echo ok", task_id="w")["output"] == "ok\n"
    named = " ".join(str(w.message) for w in caught)
    assert "TERMINAL_DISK_WARNING_GB" in named and "SUDO_PASSWORD" in named
    assert "hunter2" not in named


def test_variables_the_original_never_read_still_raise():
    with pytest.raises(ConfigError, match="TERMINAL_MODAL_SLOTZ"):
        terminal_profiles({"TERMINAL_MODAL_SLOTZ": "3"})
    with pytest.raises(ConfigError, match="TERMINAL_CWD"):
        terminal_profiles({"TERMINAL_CWD": "relative/dir"})
    with pytest.raises(ConfigError, match="TERMINAL_MODAL_MIN.*TERMINAL_MODAL_MIN_POOL|TERMINAL_MODAL_MIN_POOL.*TERMINAL_MODAL_MIN"):
        terminal_profiles({"TERMINAL_MODAL_MIN": "1", "TERMINAL_MODAL_MIN_POOL": "2"})


def test_scale_down_idle_accepts_seconds_or_a_switch(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("profiles:\n  a: {scale_down_idle: 180}\n  b: {scale_down_idle: true}\n"
                    "  c: {scale_down_idle: false}\ndefault_profile: a\n")
    profiles, _ = load_profiles(path, env={})
    assert [profiles[n].scale_down_after for n in "abc"] == [180, 120, None]
    path.write_text("profiles:\n  a: {scale_down_idle: 0}\n")
    with pytest.raises(ConfigError, match="scale_down_idle"):
        load_profiles(path, env={})


def test_original_classmethods():
    cfg = ModalSandboxConfig.from_dict("gpu", {"gpu": "T4", "min_pool": 0, "max_pool": 2})
    assert (cfg.name, cfg.gpu, cfg.min_sandboxes, cfg.max_sandboxes, cfg.driver) == ("gpu", "T4", 0, 2, "modal")
    with pytest.raises(ConfigError, match="'gpu'.*cpus"):
        ModalSandboxConfig.from_dict("gpu", {"cpus": 2})
    assert ModalSandboxConfig(name="x").with_app_name("a").app_name == "a-x"
    assert ModalSandboxConfig(name="x").with_app_name(base="a").app_name == "a-x"
    assert set(ModalSandboxConfig.load_profiles()) >= {"default"}
    result = ExecutionResult(success=False, output="", error="exit code 2", metadata={"returncode": 2})
    assert result.to_tool_result().to_dict() == {"success": False, "output": "", "error": "exit code 2",
                                                 "metadata": {"returncode": 2},
                                                 "uniq_id": result.execution_id}


def test_the_original_terminal_tools_yaml_flag_imports():
    """Code written for the original checks ``YAML_AVAILABLE`` before reading
    modal_profiles.yaml; the import works here and the flag tells the truth."""
    import importlib.util

    from hermes_modal_tool.adapters.hermes import YAML_AVAILABLE

    assert YAML_AVAILABLE is True and importlib.util.find_spec("yaml") is not None
