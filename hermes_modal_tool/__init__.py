"""hermes_modal_tool: isolated shell workspaces (slots) for agent trajectories, pooled.

The generic names (:class:`SandboxConfig`, :class:`ToolBackend`) are the primary
API; :class:`ModalSandboxConfig` and :class:`ModalToolBackend` are the same classes
with ``driver="modal"`` as the default, kept so code written for the original
Atropos Modal backend works by changing only the import.
"""

from ._version import __version__ as __version__
from .backend import ModalToolBackend, ToolBackend
from .config import ModalSandboxConfig, SandboxConfig, load_profiles
from .errors import (
    BackendClosedError,
    CommandTimeoutError,
    ConfigError,
    ConfigWarning,
    CredentialsError,
    GpuMismatchError,
    GpuUnavailableError,
    HermesModalToolError,
    ImageError,
    IsolationUnavailableError,
    PoolTimeoutError,
    SandboxDiedError,
    SandboxError,
    SandboxStartError,
    SecretNotFoundError,
    SetupError,
    SnapshotError,
    TransferError,
    UsageError,
)
from .filetransfer import Transfer
from .processes import SlotProcess
from .slots import ExecutionResult, OutputEvent, Slot, SlotState, ToolResult
from .snapshots import SlotSnapshot
from .usage import Usage

__all__ = [
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
