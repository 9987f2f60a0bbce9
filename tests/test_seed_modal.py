"""The seed document's snippets, unchanged, on the Modal driver (its default).

They run through the real ``modal`` SDK against the package's local Modal control
plane (``modal_server`` fixture): ``ModalSandboxConfig`` defaults to
``driver="modal"``, so no line of the seed is edited. The server records what each
sandbox asked for (image, GPU, memory, secrets), which is what Modal would be given.
"""

from __future__ import annotations

import json

from conftest import running_sandboxes

from hermes_modal_tool import ModalSandboxConfig, ModalToolBackend


async def test_configuration_and_batched_execution(make_backend, modal_server):
    config = ModalSandboxConfig(
        name="default",
        image="python:3.11",
        cpu=1.0,
        memory=2048,
        slots_per_sandbox=10,  # 10 trajectories per container
        min_sandboxes=1,
        max_sandboxes=5,
    )
    backend = ModalToolBackend(config.with_app_name("my-training"))
    await make_backend.adopt(backend)

    # Acquire slots for multiple trajectories
    slots = [await backend.acquire(f"traj-{i}") for i in range(50)]
    # Execute batch across all slots in parallel
    results = await backend.execute_batch([
        (slot, "bash", {"command": "python3 -c 'print(1)'"})
        for slot in slots
    ])
    # Release slots
    for slot in slots:
        await backend.release(slot)

    assert [r.output for r in results] == ["1\n"] * 50
    assert {s.workspace_dir for s in slots} == {f"/data/slot_{n}" for n in range(10)}
    records = running_sandboxes(modal_server, "default")
    assert len(records) == 5
    assert {(r.app_name, r.image_tag, r.cpu, r.memory_mib) for r in records} == {
        ("my-training-default", "python:3.11", 1.0, 2048)}
    status = backend.get_status()
    assert status["sandboxes"] == 5 and status["total_slots"] == 50 and status["acquired_slots"] == 0
    await backend.stop()
    assert running_sandboxes(modal_server, "default") == []


async def test_multi_profile_support_with_a_gpu_profile(make_backend, modal_server):
    backend = ModalToolBackend.with_profiles(
        app_name="rl-training",
        profiles={
            "default": ModalSandboxConfig(name="default", cpu=1.0, memory=2048),
            "pytorch-gpu": ModalSandboxConfig(
                name="pytorch-gpu",
                image="pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime",
                gpu="T4",
                memory=16384,
            ),
        }
    )
    await make_backend.adopt(backend)
    # CPU task
    slot1 = await backend.acquire("traj-1", profile="default")
    # GPU task
    slot2 = await backend.acquire("traj-2", profile="pytorch-gpu")

    r1, r2 = await backend.execute_batch([
        (slot1, "bash", {"command": "echo cpu"}), (slot2, "bash", {"command": "echo gpu"})])
    assert (r1.output, r2.output) == ("cpu\n", "gpu\n")
    [gpu] = running_sandboxes(modal_server, "pytorch-gpu")
    assert (gpu.gpu, gpu.memory_mib, gpu.app_name) == ("T4", 16384, "rl-training-pytorch-gpu")
    assert gpu.image_tag == "pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime"
    [cpu] = running_sandboxes(modal_server, "default")
    assert cpu.gpu is None
    await backend.stop()


async def test_credentials_from_a_modal_secret(make_backend, modal_server):
    # modal secret create my-api-key API_KEY=sk-xxx
    modal_server.add_secret("my-api-key", {"API_KEY": "sk-xxx"})
    # Reference in config
    config = ModalSandboxConfig(
        secrets=["my-api-key"],  # Modal secret names
        env_vars={"DEBUG": "1"},  # Additional env vars
    )
    backend = ModalToolBackend(config)
    await make_backend.adopt(backend, start=True)
    slot = await backend.acquire("uses-the-key")
    [r] = await backend.execute_batch([(slot, "bash", {"command": 'echo "$API_KEY $DEBUG"'})])
    assert r.output == "sk-xxx 1\n"
    [record] = running_sandboxes(modal_server, "default")
    assert record.secret_names == ["my-api-key"]
    await backend.stop()


def test_terminal_tool_with_terminal_env_modal_and_a_gpu_profile(modal_server, monkeypatch, tmp_path):
    from hermes_modal_tool.adapters.hermes import (
        cleanup_all_environments,
        cleanup_vm,
        terminal_tool,
    )

    monkeypatch.setenv("TERMINAL_ENV", "modal")
    monkeypatch.setenv("TERMINAL_MODAL_IMAGE", "python:3.11")
    monkeypatch.setenv("TERMINAL_MODAL_APP_NAME", "hermes-sandbox")
    profiles = tmp_path / "modal_profiles.yaml"
    profiles.write_text(
        "profiles:\n"
        "  default:\n    image: python:3.11\n    cpu: 1.0\n    memory: 2048\n"
        "    min_pool: 1\n    max_pool: 5\n    idle_timeout: 120\n"
        "  gpu:\n    image: pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime\n    gpu: T4\n"
        "    memory: 16384\n    min_pool: 0\n    max_pool: 2\n")
    monkeypatch.setenv("TERMINAL_MODAL_PROFILES_FILE", str(profiles))
    cleanup_all_environments()
    try:
        # Simple command
        output = terminal_tool("echo hello", task_id="my-task")
        assert json.loads(output) == {"output": "hello\n", "exit_code": 0, "error": None}
        # With profile selection
        output = terminal_tool("python train.py", task_id="training", profile="gpu")
        result = json.loads(output)
        assert result["exit_code"] not in (0, -1, None)  # ran: there is no train.py here
        [gpu] = running_sandboxes(modal_server, "gpu")
        assert gpu.gpu == "T4" and gpu.app_name == "hermes-sandbox"
        # Cleanup when done
        assert cleanup_vm("my-task") is True
    finally:
        cleanup_all_environments()
    assert running_sandboxes(modal_server, "default") == []
    assert running_sandboxes(modal_server, "gpu") == []
