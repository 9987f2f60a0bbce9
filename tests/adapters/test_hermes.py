"""The Hermes terminal tool and plugin, on real sandboxes and the real ``hermes-agent``.

``terminal_tool`` is called the way Hermes code calls it: from plain sync code,
from many threads, from inside a running event loop. The plugin is found and
loaded by Hermes's own plugin manager through the ``hermes_agent.plugins`` entry
point, and called through ``model_tools.handle_function_call``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support import SHM_DIR, TOKEN_VAR, Leftovers, describe

from hermes_modal_tool.adapters.hermes import (
    TERMINAL_TOOL_DESCRIPTION,
    check_terminal_requirements,
    cleanup_all_environments,
    cleanup_vm,
    get_active_environments_info,
    terminal_tool,
)
from hermes_modal_tool.adapters.hermes_plugin import TOOL_NAME, TOOLSET
from hermes_modal_tool.tools import TOOL_SPECS

PLUGIN = "hermes-modal-tool"


def state_dir() -> Path:
    """A directory for the local driver's state; slots (other uids) must traverse it,
    so it cannot live under pytest's private tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="hmt-hermes-test-", dir="/tmp"))
    path.chmod(0o711)
    return path


def run(command: str, **kwargs: Any) -> dict[str, Any]:
    """terminal_tool, its JSON decoded."""
    return json.loads(terminal_tool(command, **kwargs))


@pytest.fixture(autouse=True)
def terminal_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Small sandboxes whose slots carry a token; state under ``tmp_path``; every
    backend stopped after the test and nothing left behind."""
    for var in list(os.environ):
        if var.startswith(("TERMINAL_", "ATROPOS_MODAL_")):
            monkeypatch.delenv(var)
    token = uuid.uuid4().hex
    monkeypatch.setenv("TERMINAL_MODAL_SLOTS_PER_SANDBOX", "4")
    monkeypatch.setenv("TERMINAL_MODAL_MAX_SANDBOXES", "3")
    monkeypatch.setenv("TERMINAL_MODAL_MEMORY", "1024")
    monkeypatch.setenv("TERMINAL_MODAL_ENV_VARS", f"{TOKEN_VAR}={token}")
    state = state_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(state))  # the local driver's state root
    cleanup_all_environments()
    leftovers = Leftovers(token)
    try:
        yield tmp_path
    finally:
        shm = {m.decode() for p in leftovers.processes() for m in SHM_DIR.findall(p.cmdline)}
        cleanup_all_environments()
        deadline = time.monotonic() + 3
        while (leftovers.processes() or any(map(os.path.exists, shm))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not leftovers.processes(), f"left behind: {describe(leftovers.processes())}"
        assert not [d for d in shm if os.path.exists(d)], "control directories left behind"
        left = list(state.iterdir())
        shutil.rmtree(state, ignore_errors=True)
        assert not left, f"state left behind: {left}"


# -- terminal_tool ------------------------------------------------------------------------

def test_a_task_keeps_its_shell_and_tasks_are_apart() -> None:
    first = run("mkdir proj && cd proj && export STAGE=build && echo secret > s.txt", task_id="a")
    assert first == {"output": "", "exit_code": 0, "error": None}
    again = run("pwd; echo $STAGE; cat s.txt", task_id="a")
    assert again["exit_code"] == 0
    workspace_a, stage, secret = again["output"].split()
    assert workspace_a.endswith("/proj") and (stage, secret) == ("build", "secret")

    other = run("pwd; ls -A; cat " + workspace_a + "/s.txt", task_id="b")
    workspace_b = other["output"].splitlines()[0]
    # Each task starts in its own private /workspace (the original's workdir), as if it
    # owned a container: b's /workspace is not a's.
    assert workspace_a == "/workspace/proj" and workspace_b == "/workspace"
    assert other["exit_code"] != 0 and "secret" not in other["output"]

    assert run("false", task_id="a") == {"output": "", "exit_code": 1, "error": None}
    default = run("pwd")  # no task id: the "default" task
    assert default["exit_code"] == 0
    info = get_active_environments_info()
    assert info["task_ids"] == ["a", "b", "default"] and info["count"] == 3
    assert info["tasks"]["a"]["workspace"].startswith("/data/slot_")


def test_eight_threads_at_once() -> None:
    def call(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        wrote = run(f"echo {i} > mine.txt && sleep 0.5 && cat mine.txt", task_id=f"thread-{i}")
        seen = run("pwd; ls", task_id=f"thread-{i}")
        return wrote, seen

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    elapsed = time.monotonic() - started
    for i, (wrote, seen) in enumerate(results):
        assert wrote == {"output": f"{i}\n", "exit_code": 0, "error": None}
        assert seen["output"].split()[1:] == ["mine.txt"]
    tasks = get_active_environments_info()["tasks"]
    assert len({tasks[f"thread-{i}"]["slot_id"] for i in range(8)}) == 8  # eight slots
    assert elapsed < 0.5 * 8, f"the calls did not overlap ({elapsed:.2f}s)"
    loops = [t for t in threading.enumerate() if t.name == "hermes-modal-tool-loop"]
    assert len(loops) == 1, "one background event-loop thread serves every caller"


def test_inside_a_running_event_loop() -> None:
    async def agent_step() -> list[dict[str, Any]]:
        asyncio.get_running_loop()  # a loop is running in this thread
        return [run("cd /tmp && echo in-loop", task_id="async"), run("pwd", task_id="async")]

    first, second = asyncio.run(agent_step())
    assert first["output"] == "in-loop\n" and second["output"] == "/tmp\n"


def test_timeout_is_124_and_the_command_ran_once() -> None:
    started = time.monotonic()
    out = run("echo started; echo run >> runs.log; sleep 30", timeout=1, task_id="slow")
    assert time.monotonic() - started < 10
    assert out["exit_code"] == 124 and "started" in out["output"]
    assert "timed out" in out["error"]
    time.sleep(1.0)  # a retry, if there were one, would have appended by now
    assert run("cat runs.log", task_id="slow")["output"] == "run\n"


def test_default_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERMINAL_TIMEOUT", "1")
    out = run("sleep 20")
    assert out["exit_code"] == 124
    assert run("echo still here")["output"] == "still here\n"  # the session survived


def test_cleanup_vm_empties_the_workspace() -> None:
    run("echo data > keep.txt && mkdir d", task_id="c")
    assert run("ls", task_id="c")["output"].split() == ["d", "keep.txt"]
    assert cleanup_vm("c") is True
    assert cleanup_vm("c") is False and cleanup_vm("never-used") is False
    assert "c" not in get_active_environments_info()["task_ids"]
    assert run("ls -A", task_id="c") == {"output": "", "exit_code": 0, "error": None}


def test_idle_task_is_released_after_its_lifetime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERMINAL_LIFETIME_SECONDS", "1")
    run("echo x > f", task_id="idle")
    deadline = time.monotonic() + 6
    while get_active_environments_info()["count"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert get_active_environments_info()["count"] == 0
    assert run("ls -A", task_id="idle")["output"] == ""


def test_background_returns_at_once() -> None:
    started = time.monotonic()
    out = run("sleep 30", background=True, task_id="bg")
    assert time.monotonic() - started < 5
    assert out["exit_code"] == 0 and ".background/job_1.log" in out["output"]


def test_profiles_file_and_bad_profile_name(monkeypatch: pytest.MonkeyPatch, terminal_env: Path) -> None:
    profiles = terminal_env / "modal_profiles.yaml"
    profiles.write_text(textwrap.dedent("""\
        default_profile: small
        profiles:
          small: {max_pool: 2}
          big: {memory: 1536, env_vars: {PROFILE_NAME: big}}
        """))
    monkeypatch.setenv("TERMINAL_MODAL_PROFILES_FILE", str(profiles))
    run("echo kept > k.txt", task_id="p")
    assert get_active_environments_info()["tasks"]["p"]["profile"] == "small"

    bad = run("echo hi", task_id="p", profile="nope")
    assert bad["exit_code"] == -1 and "'nope'" in bad["error"] and "small" in bad["error"]
    assert run("cat k.txt", task_id="p")["output"] == "kept\n"  # the task kept its slot
    assert run("cat k.txt", task_id="p", profile="small")["output"] == "kept\n"

    big = run("echo $PROFILE_NAME", task_id="q", profile="big")
    assert big["output"] == "big\n"
    assert get_active_environments_info()["tasks"]["q"]["profile"] == "big"


def test_configuration_errors_come_back_as_json(monkeypatch: pytest.MonkeyPatch, terminal_env: Path) -> None:
    monkeypatch.setenv("TERMINAL_MODAL_PROFILES_FILE", str(terminal_env / "missing.yaml"))
    out = run("echo hi")
    assert out["exit_code"] == -1 and "missing.yaml" in out["error"]

    monkeypatch.delenv("TERMINAL_MODAL_PROFILES_FILE")
    monkeypatch.setenv("TERMINAL_ENV", "modal")
    for var in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_SERVER_URL"):
        monkeypatch.delenv(var, raising=False)
    # The driver is installed, but there are no credentials (the original checked
    # MODAL_TOKEN_ID or ~/.modal.toml too).
    assert check_terminal_requirements() is False
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-placeholder")
    assert check_terminal_requirements() is True
    monkeypatch.delenv("MODAL_TOKEN_ID")
    out = run("echo hi")
    assert out["exit_code"] == -1 and "no Modal credentials" in out["error"], out
    assert "MODAL_TOKEN_ID" in out["error"] and "TERMINAL_ENV=local" in out["error"]
    cleanup_all_environments()

    monkeypatch.setenv("TERMINAL_ENV", "docker")
    assert "TERMINAL_ENV" in run("echo hi")["error"]


def test_bad_arguments_come_back_as_json() -> None:
    assert "timeout" in run("echo", timeout=-1)["error"]
    assert "command" in json.loads(terminal_tool(None))["error"]  # type: ignore[arg-type]
    assert "task_id" in run("echo", task_id=7)["error"]  # type: ignore[arg-type]


def test_hermes_own_variables_are_not_profile_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hermes's CLI bridges its config into these before any tool runs.
    monkeypatch.setenv("TERMINAL_MODAL_MODE", "auto")
    monkeypatch.setenv("TERMINAL_TIMEOUT", "180")
    assert run("echo ok")["output"] == "ok\n"


def test_requirements_and_description() -> None:
    assert check_terminal_requirements() is True
    assert TERMINAL_TOOL_DESCRIPTION == TOOL_SPECS["bash"].description


def test_backends_are_stopped_at_interpreter_exit() -> None:
    state = state_dir()
    token = uuid.uuid4().hex
    script = textwrap.dedent("""\
        from hermes_modal_tool.adapters.hermes import terminal_tool
        print(terminal_tool("echo hi", task_id="x"))
        print(terminal_tool("sleep 300", background=True, task_id="y"))
        """)  # and exits without cleaning up
    env = {**os.environ, "TMPDIR": str(state), "TERMINAL_MODAL_ENV_VARS": f"{TOKEN_VAR}={token}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0])["output"] == "hi\n"
    leftovers = Leftovers(token)
    deadline = time.monotonic() + 3
    while leftovers.processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leftovers.processes(), describe(leftovers.processes())
    left = list(state.iterdir())
    shutil.rmtree(state, ignore_errors=True)
    assert not left, "the exit hook did not remove the sandboxes' state"


# -- the Hermes plugin -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hermes_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Hermes with its home (config, logs, state db) in a temp dir."""
    home = tmp_path_factory.mktemp("hermes-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HERMES_HOME", str(home))
        mp.setenv("HOME", str(home))
        yield home


def _set_enabled(home: Path, *plugins: str) -> None:
    lines = ["plugins:", "  enabled:"] + [f"    - {p}" for p in plugins] if plugins else ["plugins: {}"]
    (home / "config.yaml").write_text("\n".join(lines) + "\n# " + uuid.uuid4().hex + "\n")


def test_plugin_is_discovered_through_the_entry_point_and_works(hermes_home: Path) -> None:
    model_tools = pytest.importorskip("model_tools")  # hermes-agent; importing it discovers plugins
    from hermes_cli.plugins import ENTRY_POINTS_GROUP, discover_plugins, get_plugin_manager

    assert ENTRY_POINTS_GROUP == "hermes_agent.plugins"

    _set_enabled(hermes_home)  # installed but not enabled: found, not loaded
    discover_plugins(force=True)
    [entry] = [p for p in get_plugin_manager().list_plugins() if p["key"] == PLUGIN]
    assert entry["source"] == "entrypoint" and entry["enabled"] is False

    _set_enabled(hermes_home, PLUGIN)
    discover_plugins(force=True)
    [entry] = [p for p in get_plugin_manager().list_plugins() if p["key"] == PLUGIN]
    assert entry["enabled"] is True and entry["tools"] == 1 and entry["error"] is None

    definitions = model_tools.get_tool_definitions(enabled_toolsets=[TOOLSET], quiet_mode=True)
    [tool] = [d["function"] for d in definitions]
    assert tool["name"] == TOOL_NAME and tool["description"] == TOOL_SPECS["bash"].description
    assert set(tool["parameters"]["properties"]) == {"command", "timeout", "background", "stdin"}
    assert model_tools.get_toolset_for_tool(TOOL_NAME) == TOOLSET

    def call(args: dict[str, Any], task_id: str) -> dict[str, Any]:
        result = model_tools.handle_function_call(TOOL_NAME, args, task_id=task_id)
        assert isinstance(result, str)
        return json.loads(result)

    assert call({"command": "mkdir w && cd w && echo one > f"}, "task-1")["exit_code"] == 0
    in_one = call({"command": "pwd; cat f"}, "task-1")
    in_two = call({"command": "pwd; ls -A"}, "task-2")
    workspace_one, content = in_one["output"].split()
    assert workspace_one == "/workspace/w" and content == "one"
    assert in_two["output"].split() == ["/workspace"]  # task-2's own /workspace: empty

    timed_out = call({"command": "sleep 20", "timeout": "1"}, "task-2")  # Hermes coerces "1"
    assert timed_out["exit_code"] == 124
    stdin = call({"command": "tr a-z A-Z", "stdin": "shout"}, "task-2")
    assert stdin["output"] == "SHOUT"
    wrong = call({"command": "pwd", "workdir": "/"}, "task-2")
    assert wrong["exit_code"] == -1 and "workdir" in wrong["error"]
    assert sorted(get_active_environments_info()["task_ids"]) == ["task-1", "task-2"]


def test_plugin_can_replace_the_terminal_tool_with_the_operators_grant(tmp_path: Path) -> None:
    pytest.importorskip("model_tools")
    script = textwrap.dedent(f"""\
        import json, sys
        import model_tools
        from hermes_cli.plugins import get_plugin_manager
        [entry] = [p for p in get_plugin_manager().list_plugins() if p["key"] == {PLUGIN!r}]
        if entry["error"]:
            print(json.dumps({{"error": entry["error"]}})); sys.exit()
        defs = model_tools.get_tool_definitions(enabled_toolsets=["terminal"], quiet_mode=True)
        [tool] = [d for d in defs if d["function"]["name"] == "terminal"]
        out = model_tools.handle_function_call("terminal", {{"command": "pwd"}}, task_id="t")
        print(json.dumps({{"description": tool["function"]["description"], "out": json.loads(out)}}))
        """)

    def hermes_with(config: str) -> dict[str, Any]:
        home = tmp_path / uuid.uuid4().hex
        home.mkdir()
        (home / "config.yaml").write_text(config)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TERMINAL_")}
        env.update(HERMES_HOME=str(home), HOME=str(home),
                   HERMES_MODAL_TOOL_REPLACE_TERMINAL="1")
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=60, cwd=home)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    refused = hermes_with(f"plugins:\n  enabled: [{PLUGIN}]\n")
    assert "allow_tool_override" in refused["error"]
    granted = hermes_with(f"plugins:\n  enabled: [{PLUGIN}]\n  entries:\n"
                          f"    {PLUGIN}: {{allow_tool_override: true}}\n")
    assert granted["description"] == TERMINAL_TOOL_DESCRIPTION
    assert granted["out"]["exit_code"] == 0 and granted["out"]["output"] == "/workspace\n"  # the task's own /workspace
