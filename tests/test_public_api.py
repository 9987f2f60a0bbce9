"""The public surface: names, defaults of the two config spellings, docstrings."""

from __future__ import annotations

import inspect

import hermes_modal_tool
from hermes_modal_tool import (
    BackendClosedError,
    ConfigError,
    HermesModalToolError,
    ModalSandboxConfig,
    ModalToolBackend,
    PoolTimeoutError,
    SandboxConfig,
    SecretNotFoundError,
    ToolBackend,
    UsageError,
)

EXPECTED_ALL = [
    "BackendClosedError",
    "CommandTimeoutError",
    "ConfigError",
    "ConfigWarning",
    "CredentialsError",
    "ExecutionResult",
    "GpuMismatchError",
    "GpuUnavailableError",
    "HermesModalToolError",
    "ImageError",
    "IsolationUnavailableError",
    "ModalSandboxConfig",
    "ModalToolBackend",
    "OutputEvent",
    "PoolTimeoutError",
    "SandboxConfig",
    "SandboxDiedError",
    "SandboxError",
    "SandboxStartError",
    "SecretNotFoundError",
    "SetupError",
    "Slot",
    "SlotProcess",
    "SlotSnapshot",
    "SlotState",
    "SnapshotError",
    "ToolBackend",
    "ToolResult",
    "Transfer",
    "TransferError",
    "Usage",
    "UsageError",
    "load_profiles",
]


def test_all_is_pinned_and_sorted():
    assert hermes_modal_tool.__all__ == EXPECTED_ALL
    assert sorted(hermes_modal_tool.__all__) == hermes_modal_tool.__all__


def test_every_name_in_all_exists():
    for name in hermes_modal_tool.__all__:
        assert hasattr(hermes_modal_tool, name), name


def test_default_drivers():
    assert ModalSandboxConfig().driver == "modal"
    assert SandboxConfig().driver == "local"


def test_modal_names_are_the_generic_classes():
    assert issubclass(ModalSandboxConfig, SandboxConfig)
    assert issubclass(ModalToolBackend, ToolBackend)


def test_with_app_name():
    assert SandboxConfig().with_app_name("x").app_name == "x-default"
    assert ModalSandboxConfig(name="gpu").with_app_name("rl").app_name == "rl-gpu"
    # A copy: the original is unchanged.
    cfg = SandboxConfig(name="p")
    cfg.with_app_name("x")
    assert cfg.app_name is None


def test_every_public_class_and_function_has_a_docstring():
    for name in hermes_modal_tool.__all__:
        obj = getattr(hermes_modal_tool, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"
            # Inherited docstrings do not count: each class says what it is.
            assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring of its own"


def test_public_methods_and_properties_have_docstrings():
    missing = []
    for name in hermes_modal_tool.__all__:
        cls = getattr(hermes_modal_tool, name)
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        for attr, member in vars(cls).items():
            if attr.startswith("_"):
                continue
            func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(func) and not inspect.getdoc(func):
                missing.append(f"{name}.{attr}")
    assert not missing, f"public members without a docstring: {missing}"


def test_exception_tree():
    for exc in (ConfigError, PoolTimeoutError, UsageError, BackendClosedError, SecretNotFoundError):
        assert issubclass(exc, HermesModalToolError)
    assert issubclass(SecretNotFoundError, ConfigError)
    assert issubclass(BackendClosedError, UsageError)
    assert issubclass(PoolTimeoutError, TimeoutError)
    assert issubclass(ConfigError, ValueError)


def test_the_type_check_covers_every_public_name_and_the_marker_ships():
    """scripts/test.sh runs mypy --strict on tests/typing/public_api.py ([tool.mypy]): it must
    use every public name; py.typed (PEP 561) is in the package and in its package data."""
    import re
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parent.parent
    typed = (root / "tests" / "typing" / "public_api.py").read_text()
    body = typed.split(")\n", 1)[1]  # after the import list: each name must be used
    assert [n for n in hermes_modal_tool.__all__ if not re.search(rf"\b{n}\b", body)] == []
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["tool"]["mypy"]["strict"] is True
    assert "tests/typing/public_api.py" in project["tool"]["mypy"]["files"]
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["hermes_modal_tool"]
    assert (Path(hermes_modal_tool.__file__).parent / "py.typed").is_file()
