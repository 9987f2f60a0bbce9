"""Exceptions raised by hermes_modal_tool.

One root; timeouts of different kinds are different classes; programmer misuse is
kept apart from runtime failures. Errors of dependencies (pydantic, PyYAML, the
Modal SDK, bubblewrap) are translated here, so callers never import theirs::

    HermesModalToolError
    ├── ConfigError                  bad config value, profile or profiles file
    │   └── SecretNotFoundError      a profile names a secret no source has
    ├── SandboxError                 a sandbox could not be used
    │   ├── SandboxStartError        a sandbox failed to start
    │   │   ├── IsolationUnavailableError   bubblewrap / user namespaces missing
    │   │   ├── GpuUnavailableError  a gpu profile on a machine without its GPUs
    │   │   │   └── GpuMismatchError GPUs, but not of the type (or number) asked
    │   │   └── CredentialsError     Modal found or accepted no credentials
    │   └── SandboxDiedError         a sandbox's agent exited or was killed
    ├── PoolTimeoutError             no slot became free within acquire_timeout_s
    ├── CommandTimeoutError          (only raised by helpers that raise; tool calls
    │                                 report a timeout as exit code 124 instead)
    ├── TransferError                an upload or download failed or its checksum differs
    └── UsageError                   the API was used wrongly (also a ValueError)
        └── BackendClosedError       the backend was used after stop()

A tool call never raises these: a failed command comes back as an
``ExecutionResult`` with ``success=False``.

One warning category, :class:`ConfigWarning` (a ``UserWarning``), is issued through
:mod:`warnings` when a setting of the original implementation is accepted but
means nothing here, or when a default is chosen for the user; it names the
variable or key.
"""

from __future__ import annotations


class HermesModalToolError(Exception):
    """Root of every error this package raises."""


class ConfigError(HermesModalToolError, ValueError):
    """Raised when a config value, a profile or a profiles file is invalid.

    The message names the source (file or environment variable), the profile and
    the key.
    """

    def __init__(self, message: str, *, errors: list | None = None) -> None:
        super().__init__(message)
        self._errors = errors or []

    def errors(self) -> list:
        """The underlying validation errors (pydantic's shape), if any."""
        return self._errors


class ConfigWarning(UserWarning):
    """Warned when a setting is accepted but has no effect here (it names the
    variable or key), or when a default is picked on the user's behalf."""


class SecretNotFoundError(ConfigError):
    """Raised when a profile names a secret that no configured source provides."""


class SandboxError(HermesModalToolError):
    """Raised when a sandbox cannot be used."""


class SandboxStartError(SandboxError):
    """Raised when a sandbox fails to start (driver error, agent did not answer)."""


class IsolationUnavailableError(SandboxStartError):
    """Raised when bubblewrap or user namespaces are unavailable on this machine."""


class GpuUnavailableError(SandboxStartError):
    """Raised when a sandbox of a ``gpu`` profile starts on a machine without a usable
    NVIDIA GPU (the message names the profile and what it asked; the setting
    ``HERMES_MODAL_TOOL_GPU=ignore`` runs such profiles without GPUs on purpose)."""


class GpuMismatchError(GpuUnavailableError):
    """Raised when the machine's GPUs are not of the type a profile's ``gpu`` names, or
    fewer than its count (names the profile, the type asked and the GPUs found)."""


class ImageError(SandboxStartError):
    """Raised when a profile's image cannot be read, pulled or unpacked (names the image)."""


class CredentialsError(SandboxStartError):
    """Raised when the Modal driver finds no credentials or Modal rejects them.

    The message says which source was read (environment variables or a
    ``~/.modal.toml`` profile), never the secret itself.
    """


class SandboxDiedError(SandboxError):
    """Raised when a sandbox's agent exits or is killed while in use."""


class PoolTimeoutError(HermesModalToolError, TimeoutError):
    """Raised when no slot becomes free within ``acquire_timeout_s``."""


class CommandTimeoutError(HermesModalToolError, TimeoutError):
    """Raised by helpers that turn a timed-out tool call into an exception."""


class TransferError(HermesModalToolError):
    """Raised when an upload or download fails: a chunk's tool call failed, the remote file
    is not what a resume expects, or the checksums of the two ends differ."""


class UsageError(HermesModalToolError, ValueError):
    """Raised when the API is used wrongly (bad argument, slot not held, ...)."""


class BackendClosedError(UsageError):
    """Raised when a backend is used after ``stop()``."""


class SnapshotError(HermesModalToolError):
    """Raised when a snapshot, fork, export or import fails (the message says why)."""


class SetupError(SnapshotError):
    """Raised to every waiter when a shared setup fails; ``output`` is what it printed."""

    def __init__(self, message: str, output: str = "", returncode: int | None = None) -> None:
        super().__init__(message)
        self.output = output
        self.returncode = returncode


def install_hint(extra: str) -> str:
    """How to install the optional ``extra`` (``"mcp"``, ``"modal"``, ...): the released
    package's command and a checkout's, e.g. ``pip install 'hermes-modal-tool[mcp]' (in a
    checkout: pip install -e '.[mcp]')``; every "extra is not installed" message ends so."""
    return f"pip install 'hermes-modal-tool[{extra}]' (in a checkout: pip install -e '.[{extra}]')"
