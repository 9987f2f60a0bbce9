"""ToolBackend's entry points given bad input: constructor, with_profiles, start,
acquire, release, execute_batch request shapes. Errors name the bad value; a bad
request in a batch fails alone and loses nothing (shell state, files, other requests).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from conftest import BackendFactory
from support import bash

from hermes_modal_tool import (
    ConfigError,
    ExecutionResult,
    ModalSandboxConfig,
    ModalToolBackend,
    SandboxConfig,
    Slot,
    SlotState,
    ToolBackend,
    UsageError,
)


def failed_naming(result: ExecutionResult, *words: str) -> None:
    assert isinstance(result, ExecutionResult), result
    assert not result.success and result.error, result
    for w in words:
        assert w in result.error, f"error does not name {w!r}: {result.error!r}"


# -- constructor and with_profiles (no sandbox is started) --------------------------------

@pytest.mark.parametrize("config", ["default", 5, {"name": "x"}, ["x"], object(), SandboxConfig])
def test_constructor_refuses_a_config_that_is_not_one(config: Any) -> None:
    with pytest.raises(UsageError, match="SandboxConfig") as info:
        ToolBackend(config)
    assert type(config).__name__ in str(info.value)


def test_constructor_refuses_config_and_profiles_together() -> None:
    with pytest.raises(UsageError, match="config or profiles"):
        ToolBackend(SandboxConfig(), profiles={"default": SandboxConfig()})


@pytest.mark.parametrize("profiles", [{}, {"a": "x"}, {"a": {"cpu": 1}}, {"a": None}])
def test_constructor_refuses_bad_profiles_naming_them(profiles: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        ToolBackend(profiles=profiles)
    if profiles:
        assert "'a'" in str(info.value)


@pytest.mark.parametrize("profiles", ["default", ["default"], 5])
def test_constructor_refuses_profiles_that_are_not_a_mapping(profiles: Any) -> None:
    with pytest.raises((ConfigError, UsageError)) as info:
        ToolBackend(profiles=profiles)
    assert "profiles" in str(info.value), str(info.value)


@pytest.mark.parametrize("default", ["nope", 5, "A"])
def test_unknown_default_profile_is_named_with_the_known_ones(default: Any) -> None:
    # A name that is not a profile is refused when a call needs the default (code
    # that names a profile on every call never does); a non-name at once.
    with pytest.raises(ConfigError) as info:
        backend = ToolBackend(profiles={"a": SandboxConfig()}, default_profile=default)
        assert backend.profile("a").name == "a"
        backend.profile()
    assert repr(default) in str(info.value) and "a" in str(info.value), str(info.value)


def test_with_profiles_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        ToolBackend.with_profiles(profiles_file=missing)
    with pytest.raises(ConfigError, match="nope.yaml"):
        ModalToolBackend.with_profiles(profiles_file=str(missing))


def test_with_profiles_bad_file_names_file_profile_and_key(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("profiles:\n  gpu:\n    max_pool: lots\n")
    with pytest.raises(ConfigError) as info:
        ToolBackend.with_profiles(profiles_file=f)
    assert all(w in str(info.value) for w in (str(f), "'gpu'", "max_pool", "lots")), str(info.value)


def test_with_profiles_default_profile_not_in_profiles(tmp_path: Path) -> None:
    backend = ToolBackend.with_profiles(profiles={"default": SandboxConfig()}, default_profile="other")
    with pytest.raises(ConfigError, match="'other'"):
        backend.profile(None)


def test_with_profiles_keeps_modal_default_for_modal_backend() -> None:
    b = ModalToolBackend.with_profiles(profiles={"default": ModalSandboxConfig()})
    assert b.profiles["default"].driver == "modal"


# -- start / acquire / release ------------------------------------------------------------

async def test_start_with_unknown_profile_names_it(make_backend: BackendFactory) -> None:
    backend = await make_backend(start=False)
    with pytest.raises(ConfigError, match="'nope'"):
        await backend.start(["nope"])


async def test_start_with_a_string_instead_of_a_list_names_the_string(make_backend: BackendFactory) -> None:
    """start("gpu") is a common slip for start(["gpu"]): the error must not talk about profile 'g'."""
    backend = await make_backend(start=False)
    name = backend.default_profile
    try:
        await backend.start(name)
    except (ConfigError, UsageError) as exc:
        assert repr(name) in str(exc), f"start({name!r}) error does not name it: {exc}"


@pytest.mark.parametrize("profile", ["nope", "DEFAULT", " ", 5, ["x"], {"a": 1}, 0, []])
async def test_acquire_with_a_bad_profile_names_it(backend: ToolBackend, profile: Any) -> None:
    with pytest.raises((ConfigError, UsageError)) as info:
        await backend.acquire("t", profile=profile)
    assert repr(profile) in str(info.value), str(info.value)
    # nothing was leased
    assert backend.get_status()["acquired_slots"] == 0


@pytest.mark.parametrize("trajectory_id", [5, 1.5, b"t", ["t"], {"t": 1}, object(), True])
async def test_acquire_with_a_bad_trajectory_id_names_its_type(backend: ToolBackend, trajectory_id: Any) -> None:
    with pytest.raises(UsageError, match="trajectory_id") as info:
        await backend.acquire(trajectory_id)
    assert type(trajectory_id).__name__ in str(info.value)
    assert backend.get_status()["acquired_slots"] == 0


@pytest.mark.parametrize("thing", [None, "slot_0", 0, {"slot_id": "x"}, object()])
async def test_release_of_a_non_slot_names_what_it_got(backend: ToolBackend, thing: Any) -> None:
    with pytest.raises(UsageError, match="Slot") as info:
        await backend.release(thing)
    assert type(thing).__name__ in str(info.value)


async def test_double_release_is_a_usage_error_and_the_slot_is_reusable(backend: ToolBackend) -> None:
    slot = await backend.acquire("twice")
    await backend.release(slot)
    with pytest.raises(UsageError) as info:
        await backend.release(slot)
    assert slot.slot_id in str(info.value) or "released" in str(info.value) or "not held" in str(info.value)
    again = await backend.acquire("after")
    [r] = await backend.execute_batch([(again, "bash", {"command": "echo ok"})])
    assert r.output == "ok\n"


async def test_release_of_a_slot_from_another_backend(make_backend: BackendFactory) -> None:
    a = await make_backend()
    b = await make_backend(name="other" + a.default_profile)
    slot = await a.acquire("a")
    with pytest.raises(UsageError, match=slot.slot_id):
        await b.release(slot)
    [r] = await a.execute_batch([(slot, "bash", {"command": "echo still-mine"})])
    assert r.output == "still-mine\n"


async def test_a_released_slot_in_a_batch_fails_alone(backend: ToolBackend) -> None:
    old = await backend.acquire("old")
    await backend.release(old)
    live = await backend.acquire("live")
    results = await backend.execute_batch([(old, "bash", {"command": "echo no"}),
                                           (live, "bash", {"command": "echo yes"})])
    failed_naming(results[0], old.slot_id)
    assert results[1].output == "yes\n"


# -- execute_batch: request shapes --------------------------------------------------------

@pytest.mark.parametrize("requests", [None, 5, "bash", b"x", {"a": 1}, object(), (x for x in [])])
async def test_requests_that_are_not_a_list_raise_usage_error_naming_the_type(backend: ToolBackend,
                                                                            requests: Any) -> None:
    with pytest.raises(UsageError, match="requests") as info:
        await backend.execute_batch(requests)
    assert type(requests).__name__ in str(info.value)


async def test_bad_requests_fail_alone_and_keep_the_slot_state(backend: ToolBackend, slot: Slot) -> None:
    setup = await bash(backend, slot, "mkdir -p d && cd d && export KEEP=1 && echo f > ../f.txt")
    assert setup.success, setup
    other = await backend.acquire("other")
    fake = Slot(slot_id="fake_slot_9", workspace_dir="/data/slot_9", state=SlotState.ACQUIRED,
                trajectory_id="x")
    bad: list[tuple[Any, list[str]]] = [
        (None, ["request 1", "None"]),
        ("abc", ["request 2"]),
        ((slot, "bash"), ["request 3", "expected (slot, tool, args)"]),
        ((slot, "bash", {"command": "true"}, "extra"), ["request 4"]),
        (("slot_0", "bash", {"command": "true"}), ["request 5", "str"]),
        ((slot, 5, {"command": "true"}), ["request 6", "5"]),
        ((slot, None, {"command": "true"}), ["request 7", "None"]),
        ((slot, "bash", "echo hi"), ["request 8", "str"]),
        ((slot, "bash", None), ["request 9", "NoneType"]),
        ((slot, "bash", ["command", "true"]), ["request 10", "list"]),
        ((fake, "bash", {"command": "true"}), ["fake_slot_9"]),
        ((slot, "nope", {}), ["'nope'"]),
        ((slot, "bash", {"command": "true", "bogus": 1}), ["'bogus'"]),
        ((slot, "bash", {"command": "echo x", "timeout": -1}), ["timeout", "-1"]),
    ]
    requests: list[Any] = [(slot, "bash", {"command": "echo first"})]
    requests += [b for b, _ in bad]
    requests += [(other, "bash", {"command": "echo other"}), (slot, "bash", {"command": 'echo "$PWD $KEEP"'})]
    results = await backend.execute_batch(requests)
    assert len(results) == len(requests)
    assert results[0].output == "first\n"
    for i, (_req, words) in enumerate(bad, start=1):
        failed_naming(results[i], *words)
    assert results[-2].output == "other\n"
    assert results[-1].output == f"{slot.workspace_dir}/d 1\n", results[-1]
    r = await backend.execute_batch([(slot, "read_file", {"path": "f.txt"})])
    assert r[0].output == "f\n"


async def test_list_requests_are_accepted_like_tuples(backend: ToolBackend, slot: Slot) -> None:
    [r] = await backend.execute_batch([[slot, "bash", {"command": "echo list"}]])
    assert r.output == "list\n"


async def test_non_json_args_fail_alone_and_later_batches_are_clean(backend: ToolBackend, slot: Slot) -> None:
    """An argument JSON cannot carry must fail its own request; the other requests of
    the batch still run, and nothing queued by the broken batch leaks into the next."""
    other = await backend.acquire("other")
    try:
        results = await backend.execute_batch([(other, "bash", {"command": "echo ran >> log"}),
                                               (slot, "bash", {"command": b"echo bytes"})])
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"execute_batch raised {type(exc).__name__}: {exc}")
    assert results[0].success
    failed_naming(results[1], "command")
    [log] = await backend.execute_batch([(other, "bash", {"command": "cat log"})])
    assert log.output == "ran\n"


@pytest.mark.parametrize("timeout", [10**400, 10**30])
async def test_enormous_int_bash_timeout_fails_alone(backend: ToolBackend, slot: Slot, timeout: int) -> None:
    try:
        results = await backend.execute_batch([(slot, "bash", {"command": "echo a"}),
                                               (slot, "bash", {"command": "echo b", "timeout": timeout})])
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"execute_batch raised {type(exc).__name__}: {exc}")
    assert results[0].output == "a\n"
    failed_naming(results[1], "timeout")


@pytest.mark.parametrize("timeout_s", [0, -5, math.nan, -math.inf, "10", True, None.__class__])
async def test_bad_timeout_s_names_it(backend: ToolBackend, slot: Slot, timeout_s: Any) -> None:
    with pytest.raises(UsageError, match="timeout_s"):
        await backend.execute_batch([(slot, "bash", {"command": "true"})], timeout_s=timeout_s)
    r = await bash(backend, slot, "echo alive")
    assert r.output == "alive\n"


async def test_execute_after_stop_is_backend_closed(make_backend: BackendFactory) -> None:
    from hermes_modal_tool import BackendClosedError

    backend = await make_backend()
    slot = await backend.acquire("x")
    make_backend.note(backend)
    await backend.stop()
    with pytest.raises(BackendClosedError):
        await backend.execute_batch([(slot, "bash", {"command": "true"})])
    with pytest.raises(BackendClosedError):
        await backend.acquire("y")
