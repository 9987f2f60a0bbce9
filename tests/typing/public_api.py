"""The public API as a typed caller uses it: checked with ``mypy --strict`` (scripts/test.sh,
``[tool.mypy]`` in pyproject.toml), never run. Every name of ``hermes_modal_tool.__all__``
appears here (tests/test_public_api.py checks that), so a public signature that loses its
types, or a type a caller relies on that changes, fails the type check.
"""

from __future__ import annotations

import warnings

from hermes_modal_tool import (
    BackendClosedError,
    CommandTimeoutError,
    ConfigError,
    ConfigWarning,
    CredentialsError,
    ExecutionResult,
    GpuMismatchError,
    GpuUnavailableError,
    HermesModalToolError,
    ImageError,
    IsolationUnavailableError,
    ModalSandboxConfig,
    ModalToolBackend,
    OutputEvent,
    PoolTimeoutError,
    SandboxConfig,
    SandboxDiedError,
    SandboxError,
    SandboxStartError,
    SecretNotFoundError,
    SetupError,
    Slot,
    SlotProcess,
    SlotSnapshot,
    SlotState,
    SnapshotError,
    ToolBackend,
    ToolResult,
    Transfer,
    TransferError,
    Usage,
    UsageError,
    load_profiles,
)

ERRORS: tuple[type[HermesModalToolError], ...] = (
    BackendClosedError, CommandTimeoutError, ConfigError, CredentialsError, ImageError,
    IsolationUnavailableError, PoolTimeoutError, SandboxDiedError, SandboxError,
    SandboxStartError, SecretNotFoundError, SetupError, SnapshotError, UsageError,
    GpuUnavailableError, GpuMismatchError, TransferError)


def configs() -> list[SandboxConfig]:
    local = SandboxConfig(name="default", slots_per_sandbox=4, max_sandboxes=2)
    modal: ModalSandboxConfig = ModalSandboxConfig(name="gpu", gpu="T4").with_app_name("my-app")
    loaded, default = load_profiles("modal_profiles.yaml")
    memory: int = loaded[default].memory
    warnings.simplefilter("error", ConfigWarning)
    return [local, modal, SandboxConfig(memory=memory)]


async def rollout(backend: ToolBackend) -> int | None:
    await backend.start()
    slot: Slot = await backend.acquire("traj-1")
    state: SlotState = slot.state
    ids: tuple[str, str, int] = (slot.slot_id, slot.lease_id, slot.index)
    seen: list[str] = []

    def on_output(event: OutputEvent) -> None:
        seen.append(event.data if isinstance(event.data, str) else event.data.decode())

    results: list[ExecutionResult] = await backend.execute_batch(
        [(slot, "bash", {"command": "echo hi"}), (slot, "read_file", {"path": "a.txt"})],
        timeout_s=30.0, on_output=on_output)
    first = results[0]
    code: int | None = first.returncode
    tool: ToolResult = first.to_tool_result()
    snap: SlotSnapshot = await backend.snapshot(slot)
    forks: list[Slot] = await backend.fork(snap, 2)
    proc: SlotProcess = await backend.start_process(slot, "python3 -i")
    await proc.write("print(1)\n")
    out: bytes = await proc.read_until(b">>>")
    exit_code: int | None = await proc.wait(5.0)
    status: dict[str, object] = backend.get_status()
    sent: Transfer = await backend.upload(slot, b"data", "in.bin")
    got: Transfer = await backend.download(slot, "in.bin", "out.bin")
    used: Usage = await backend.usage(slot)
    cpu: float | None = used.cpu_user_s
    for fork in forks:
        await backend.release(fork)
    ledger: Usage | None = await backend.release(slot, reset_workspace=True)
    await backend.stop()
    del state, ids, tool, out, status, exit_code, sent, got, cpu, ledger
    return code


def modal_backend() -> ToolBackend:
    backend: ToolBackend = ModalToolBackend(ModalSandboxConfig(name="default"))
    return ToolBackend.with_profiles(app_name="rl", profiles={"default": SandboxConfig()}) or backend
