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
  exec .venv/bin/python -m pytest -q --durations=20 --ignore-glob='tests/adapters/test_openai_agents*.py'
fi
exec .venv/bin/python -m pytest -q "$@"
