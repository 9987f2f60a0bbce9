#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev    # everything the tests need
.venv/bin/ruff check hermes_modal_tool adapters tests benchmarks
exec .venv/bin/python -m pytest -q "$@"
