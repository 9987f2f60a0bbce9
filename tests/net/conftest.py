"""The fake internet (hermes_modal_tool.testing.fakenet), once per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hermes_modal_tool.testing.fakenet import FakeInternet, fake_internet


def require_root() -> None:
    """Skip (an error under ``CI=true``) where the fake internet cannot be built: it
    needs root for its network namespaces and veth pairs."""
    if os.geteuid() == 0:
        return
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("CI=true and not root: the fake internet needs root")
    pytest.skip("the fake internet needs root (network namespaces, veth pairs)")


@pytest.fixture(scope="session")
def fakenet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInternet]:
    require_root()
    yield from fake_internet(tmp_path_factory.mktemp("fakenet"))
