"""``SlotSandbox`` passes LangChain's standard Deep Agents sandbox suite.

One slot serves the whole suite (as one Deep Agents task would use it). The
suite's files live under ``/tmp/test_sandbox_ops`` (the slot's private ``/tmp``),
so uploads and downloads outside the workspace are covered too.

The profile is the default one (``output_limit`` 50,000 characters): the suite
prints 500 KiB through ``execute`` and wants it uncut, which ``SlotSandbox`` does by
reading a big output whole from the slot (see its ``max_output_bytes``). One
setting is for the suite's image: ``python`` is put on the slot's ``PATH`` (the
local driver runs the host's root filesystem, which only has ``python3``; the
suite's commands call ``python``).

Seven tests of langchain-tests 1.1.9 assert the contract Deep Agents had before
0.7.7, which changed ``BaseSandbox`` itself: ``write`` creates or overwrites
(the protocol: "creating it or overwriting it") and ``glob`` returns absolute
paths of files. Every ``BaseSandbox`` fails them (a plain subprocess
``BaseSandbox`` was checked: the same seven fail). We follow Deep Agents;
upstream's change realigning the suite is langchain PR #40283 (issue #39948).
They are non-strict xfails, so the run stays green whichever release of the
suite is installed; drop the marks once a release with that change is required.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_helpers import portal_backend
from langchain_tests.integration_tests import SandboxIntegrationTests

UPSTREAM = "langchain-tests asserts the pre-0.7.7 contract; realigned by langchain PR #40283 (issue #39948)"
GLOB_SKEW = "deepagents>=0.7.7 BaseSandbox.glob returns absolute paths of files; " + UPSTREAM
WRITE_SKEW = "deepagents>=0.7.7 BaseSandbox.write creates or overwrites; " + UPSTREAM


class TestSlotSandboxStandard(SandboxIntegrationTests):
    @pytest.fixture(scope="class")
    @classmethod
    def sandbox(cls) -> Iterator[Any]:
        from hermes_modal_tool.adapters.langchain import SlotSandbox

        with portal_backend(execution_timeout_s=60.0) as backend:
            assert backend.profile().output_limit == 50_000  # the default cap, not raised
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

    @pytest.mark.xfail(reason=WRITE_SKEW, strict=False)
    def test_write_existing_file_fails(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_write_existing_file_fails(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=False)
    def test_glob(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=False)
    def test_glob_basic_pattern(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_basic_pattern(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=False)
    def test_glob_with_directories(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_with_directories(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=False)
    def test_glob_hidden_files_explicitly(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_hidden_files_explicitly(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=False)
    def test_glob_with_character_class(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_with_character_class(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=GLOB_SKEW, strict=False)
    def test_glob_with_question_mark(self, sandbox_backend: Any, sandbox_test_root: str) -> None:
        super().test_glob_with_question_mark(sandbox_backend, sandbox_test_root)


def test_big_output_is_whole_and_leaves_no_file_behind() -> None:
    """Output over the profile's cap comes back whole; `cd` and `export` still persist; a
    timed-out command keeps what it printed; nothing is left in the workspace."""
    from hermes_modal_tool.adapters.langchain import SlotSandbox

    with portal_backend(output_limit=1000) as backend:
        sandbox = SlotSandbox(backend, "big-output")
        try:
            big = sandbox.execute("mkdir -p d && cd d && export X=kept && seq 1 20000; echo err >&2; exit_code=3; (exit 3)")
            lines = big.output.splitlines()
            assert lines[:3] == ["1", "2", "3"] and "20000" in lines and "err" in lines
            assert big.exit_code == 3 and not big.truncated
            small = sandbox.execute('echo "$PWD $X"')
            assert small.output.strip().endswith("/d kept") and small.exit_code == 0
            late = sandbox.execute("seq 1 3000; sleep 30", timeout=1)
            assert late.exit_code == 124 and late.output.startswith("1\n2\n") and "3000" in late.output
            broken = sandbox.execute("echo never; if then")  # bash refuses the line: its message is the output
            assert broken.exit_code == 2 and "syntax error" in broken.output and not broken.output.startswith("never")
            binary = sandbox.execute("printf 'a\\0b\\n'")
            assert binary.output == "a\x00b\n"
            left = sandbox.execute("ls -A ..")  # the workspace (the shell is in d)
            assert left.output.split() == ["d"], left.output
            capped = SlotSandbox(backend, "big-output", sessions=sandbox.sessions, max_output_bytes=100)
            cut = capped.execute("seq 1 5000")
            assert cut.truncated and len(cut.output) == 100
        finally:
            sandbox.close()
