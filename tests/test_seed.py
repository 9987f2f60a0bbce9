"""The seed document's Atropos examples run unchanged, except ``driver="local"``.

(One more difference: the host has ``python3`` but no ``python``, so ``step.py`` is
run with ``python3``; the seed's image ``python:3.11`` has both.)
"""

from __future__ import annotations

import logging
import secrets
import time

from hermes_modal_tool import ModalSandboxConfig, ModalToolBackend


async def test_configuration_and_batched_execution(make_backend):
    config = ModalSandboxConfig(
        name="default",
        image="python:3.11",
        cpu=1.0,
        memory=2048,
        slots_per_sandbox=10,  # 10 trajectories per container
        min_sandboxes=1,
        max_sandboxes=5,
        driver="local",
    )
    backend = ModalToolBackend(config.with_app_name("my-training"))
    await make_backend.adopt(backend)
    assert backend.profiles["default"].app_name == "my-training-default"

    # Acquire slots for multiple trajectories
    slots = [await backend.acquire(f"traj-{i}") for i in range(50)]
    assert backend.get_status()["sandboxes"] == 5
    assert {s.workspace_dir for s in slots} == {f"/data/slot_{n}" for n in range(10)}

    # Each trajectory's step script, in its own workspace.
    written = await backend.execute_batch([
        (slot, "write_file", {"path": "step.py", "content": f"print('step', {i})\n"})
        for i, slot in enumerate(slots)
    ])
    assert all(r.success for r in written)

    # Execute batch across all slots in parallel
    start = time.monotonic()
    results = await backend.execute_batch([
        (slot, "bash", {"command": "python3 step.py"})
        for slot in slots
    ])
    elapsed = time.monotonic() - start
    assert [r.output for r in results] == [f"step {i}\n" for i in range(50)]
    assert all(r.success and r.metadata["returncode"] == 0 for r in results)
    assert elapsed < 20

    # Release slots
    for slot in slots:
        await backend.release(slot)
    status = backend.get_status()
    assert status["acquired_slots"] == 0
    assert status["total_slots"] == 50 and status["slots_per_sandbox"] == 10


async def test_multi_profile_support(make_backend):
    backend = ModalToolBackend.with_profiles(
        app_name="rl-training",
        profiles={
            "default": ModalSandboxConfig(
                name="default",
                cpu=1.0,
                memory=2048,
                driver="local",
            ),
            "pytorch-gpu": ModalSandboxConfig(
                name="pytorch-gpu",
                image="pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime",
                gpu="T4",
                memory=16384,
                driver="local",
            ),
        }
    )
    await make_backend.adopt(backend)
    assert set(backend.list_profiles()) == {"default", "pytorch-gpu"}
    assert backend.profiles["pytorch-gpu"].app_name == "rl-training-pytorch-gpu"

    # CPU task
    slot1 = await backend.acquire("traj-1", profile="default")
    # GPU task
    slot2 = await backend.acquire("traj-2", profile="pytorch-gpu")

    assert slot1.profile == "default" and slot2.profile == "pytorch-gpu"
    r1, r2 = await backend.execute_batch([
        (slot1, "bash", {"command": "echo cpu"}),
        (slot2, "bash", {"command": "echo gpu"}),
    ])
    assert (r1.output, r2.output) == ("cpu\n", "gpu\n")
    status = backend.get_status()
    assert set(status["pools"]) == {"default", "pytorch-gpu"}
    assert status["sandboxes"] == 2
    await backend.release(slot1)
    await backend.release(slot2)


async def test_local_driver_warns_that_the_image_is_not_used(make_backend, caplog):
    image = f"example.invalid/custom-{secrets.token_hex(4)}:latest"
    with caplog.at_level(logging.WARNING):
        backend = await make_backend(image=image)
        await backend.acquire("t")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(image in w for w in warnings), warnings


async def test_local_driver_warns_once_that_the_gpu_is_ignored(make_backend, caplog):
    # The suite runs with HERMES_MODAL_TOOL_GPU=ignore (conftest: no GPU here); without
    # it such a profile fails to start (tests/test_gpu_slots.py).
    gpu = f"A100-{secrets.token_hex(2)}"  # a value no other test warned about in this process
    with caplog.at_level(logging.WARNING):
        backend = await make_backend(gpu=gpu, max_sandboxes=2, slots_per_sandbox=1)
        await backend.acquire("t1")
        await backend.acquire("t2")  # a second sandbox of the same profile: no second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    about_gpu = [w for w in warnings if gpu in w]
    assert len(about_gpu) == 1, warnings
    assert "HERMES_MODAL_TOOL_GPU=ignore" in about_gpu[0] and "without a GPU" in about_gpu[0]
    assert "image" not in about_gpu[0]  # the default image is not named
