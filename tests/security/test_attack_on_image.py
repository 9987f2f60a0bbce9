"""The attack suite's slot-isolation checks, re-run on image profiles instead of the
host's root: a busybox image (no bash: the host's static bash runs the slots' shell) and
a Debian image (built once with mmdebstrap, see ``hermes_modal_tool.testing.images``).

The tests are the suite's own functions; only ``backend`` (and so ``slot``, ``two_slots``)
changes. Checks that need python3 (ptrace, double-fork escapes) or name the shell
``bash`` by its command line run on the Debian image only. Not re-run: the symlink test
that links to a host canary directory (an image has none: the link dangles) and checks
about host files (``/etc/shadow`` is the image's own here).
"""

from __future__ import annotations

import pytest
from image_builder import images_for_tests, skip_without

from hermes_modal_tool.testing.images import debian_image

from .helpers import bash
from .test_attack_filesystem import (  # noqa: F401  (collected here, on the images)
    hidden_canary,
    host_canary,
    test_fifo_and_special_files_do_not_hang_the_agent,
    test_hard_links_to_foreign_files,
    test_mount_bind_and_namespace_tricks,
    test_other_slot_by_absolute_dotdot_and_proc_paths,
    test_symlinks_pointing_out_via_file_tools,
)
from .test_attack_processes import (  # noqa: F401
    test_cannot_see_signal_or_trace_other_slots_or_the_agent,
    test_escapes_do_not_survive_a_timeout_or_release,
    test_slot_cannot_kill_its_own_sandbox,
)
from .test_attack_round_two import (  # noqa: F401
    test_control_files_are_not_the_slots_to_change_or_others_to_read,
)

NEEDS_DEBIAN = {"test_cannot_see_signal_or_trace_other_slots_or_the_agent",
                "test_escapes_do_not_survive_a_timeout_or_release"}


@pytest.fixture(scope="module")
def built_images(tmp_path_factory) -> dict[str, str]:
    return {"busybox": images_for_tests(tmp_path_factory)["plain"]}


def pytest_generate_tests(metafunc):
    if "image_name" in metafunc.fixturenames:
        names = ["debian"] if metafunc.function.__name__ in NEEDS_DEBIAN else ["busybox", "debian"]
        metafunc.parametrize("image_name", names, scope="module")


@pytest.fixture(scope="module")
def image(image_name, built_images) -> str:
    if image_name == "debian":
        skip_without("mmdebstrap", "umoci")
        return debian_image()
    return built_images[image_name]


@pytest.fixture
async def backend(make_backend, image, tmp_path, monkeypatch):
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_CACHE", str(tmp_path / "cache"))
    backend = await make_backend(image=image)
    assert backend.get_status()["drivers"]["local"]["images"]["cached"] == 1
    return backend


@pytest.fixture
async def fs_two_slots(backend):
    """The file-tool attacks' two slots (``a`` holds a secret, ``b`` attacks), on the image."""
    a = await backend.acquire("victim")
    b = await backend.acquire("attacker")
    r = await bash(backend, a, "echo victim-secret > secret.txt; mkdir d; echo x > d/f")
    assert r.success, r.error
    return backend, a, b
