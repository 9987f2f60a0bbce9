"""``SlotSandbox`` passes LangChain's standard Deep Agents sandbox suite.

One slot serves the whole suite (as one Deep Agents task would use it). The
suite's files live under ``/tmp/test_sandbox_ops`` (the slot's private ``/tmp``),
so uploads and downloads outside the workspace are covered too.

Two settings differ from the defaults, for what the suite expects of a sandbox
image: the profile's ``output_limit`` is raised (the suite prints 500 KiB and wants
it uncut; the default cap is 50,000 characters), and ``python`` is put on the
slot's ``PATH`` (the local driver runs the host's root filesystem, which only has
``python3``; the suite's commands call ``python``).

Seven tests of langchain-tests 1.1.9 expect what Deep Agents 0.7 changed in
``BaseSandbox`` itself, so every ``BaseSandbox`` fails them (a plain subprocess
``BaseSandbox`` was checked: the same seven fail): ``glob`` now returns absolute
paths of regular files only, and ``write`` overwrites an existing file (the
protocol says "creating it or overwriting it"). They are strict xfails: when the
suite catches up they pass, fail as XPASS, and these marks should go.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_helpers import portal_backend
from langchain_tests.integration_tests import SandboxIntegrationTests

GLOB_SKEW = "deepagents 0.7 BaseSandbox.glob returns absolute paths of regular files only"
WRITE_SKEW = "deepagents 0.7 BaseSandbox.write overwrites existing files (protocol: 'or overwriting it')"


class TestSlotSandboxStandard(SandboxIntegrationTests):
    @pytest.fixture(scope="class")
    @classmethod
    def sandbox(cls) -> Iterator[Any]:
        from hermes_modal_tool.adapters.langchain import SlotSandbox

        with portal_backend(output_limit=2_000_000, execution_timeout_s=60.0) as backend:
            sandbox = SlotSandbox(backend, "standard-sandbox-suite")
            setup = sandbox.execute('mkdir -p "$HOME/.bin" && ln -sf "$(command -v python3)" '
                                    '"$HOME/.bin/python" && export PATH="$HOME/.bin:$PATH" '
                                    "&& python --version")
            assert setup.exit_code == 0, setup.output
            try:
                yield sandbox
            finally:
                sandbox.close()

    @pytest.fixture(scope="class")
    @classmethod
    def sandbox_backend(cls, sandbox: Any) -> Any:
        return sandbox  # the base fixture, as a classmethod (pytest deprecates instance ones)

    @pytest.mark.xfail(reason=WRITE_SKEW, strict=True)
    def test_write_existing_file_fails(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_write_existing_file_fails(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=True)
    def test_glob(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=True)
    def test_glob_basic_pattern(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_basic_pattern(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=True)
    def test_glob_with_directories(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_with_directories(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=True)
    def test_glob_hidden_files_explicitly(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_hidden_files_explicitly(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=True)
    def test_glob_with_character_class(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_with_character_class(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=True)
    def test_glob_with_question_mark(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_with_question_mark(sandbox_backend, sandbox_test_root)
