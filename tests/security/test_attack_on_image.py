"""The attack suite's slot-isolation checks, re-run on an image profile: slots whose root
is a busybox image (no bash: the host's static bash runs their shell) instead of the host's.

The tests are the suite's own functions; only ``backend`` (and so ``slot``, ``two_slots``)
changes. Not re-run here: checks that need python3 (ptrace, double-fork escapes), that
name the shell ``bash`` by its command line (here ``/run/hmt-bash``), or that link to a
host canary directory (the image has none: the link dangles).
"""

from __future__ import annotations

import os

import pytest
from image_builder import build_images, missing_tools

from .test_attack_filesystem import (  # noqa: F401  (collected here, on the image)
    host_canary,
    test_fifo_and_special_files_do_not_hang_the_agent,
    test_hard_links_to_foreign_files,
    test_mount_bind_and_namespace_tricks,
    test_other_slot_by_absolute_dotdot_and_proc_paths,
    test_symlinks_pointing_out_via_file_tools,
)
from .test_attack_processes import (  # noqa: F401
    test_slot_cannot_kill_its_own_sandbox,
)
from .test_attack_round_two import (  # noqa: F401
    test_control_files_are_not_the_slots_to_change_or_others_to_read,
)


@pytest.fixture(scope="module")
def busybox_image(tmp_path_factory) -> str:
    if os.geteuid() != 0:
        pytest.skip("images are the lower layer of a slot's layered root: that needs root")
    missing = missing_tools()
    assert not missing, f"run 'bash scripts/setup.sh dev' as root: it installs {missing}"
    return build_images(tmp_path_factory.mktemp("images"))["plain"]


@pytest.fixture
async def backend(make_backend, busybox_image, tmp_path, monkeypatch):
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_CACHE", str(tmp_path / "cache"))
    backend = await make_backend(image=busybox_image)
    assert backend.get_status()["drivers"]["local"]["images"]["cached"] == 1
    return backend
