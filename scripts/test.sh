#!/usr/bin/env bash
# The test command: set up .venv (and .venv-agents) if needed, then run the whole suite:
# first the OpenAI Agents SDK tests in .venv-agents, then everything else in .venv.
# With arguments, only `pytest ARGS` in .venv runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev    # everything the tests need
.venv/bin/ruff check hermes_modal_tool adapters tests benchmarks
.venv/bin/mypy  # the public API, typed as a caller uses it ([tool.mypy] in pyproject.toml)
if [ $# -eq 0 ]; then
  bash scripts/setup.sh agents  # the OpenAI Agents SDK's own environment
  .venv-agents/bin/python -m pytest -q -p no:cacheprovider tests/adapters/test_openai_agents*.py
  # They ran above; without the SDK .venv would only skip them (an error under CI=true).
  # Two workers (pytest-xdist): most tests wait on sandboxes, not on the CPU. loadfile keeps
  # each file on one worker (a module-scoped fixture is made once), and tests/conftest.py
  # hands out the slowest files first (SLOW_FIRST); HMT_TEST_WORKERS=0 runs in one process.
  # The timing-bound tests (marker "alone", conftest ALONE) run after, in one process.
  rc=0
  .venv/bin/python -m pytest -q -n "${HMT_TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder --durations=20 -m "not alone" \
    --ignore-glob='tests/adapters/test_openai_agents*.py' || rc=$?
  .venv/bin/python -m pytest -q -p no:cacheprovider --durations=5 -m alone \
    --ignore-glob='tests/adapters/test_openai_agents*.py' || rc=$?
  exit "$rc"
fi
exec .venv/bin/python -m pytest -q "$@"
