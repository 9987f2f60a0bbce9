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
