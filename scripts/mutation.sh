#!/usr/bin/env bash
# Mutation testing, on demand (not in CI): installs the `mutation` extra (cosmic-ray) into
# .venv, then runs scripts/mutation.py (see its docstring). CPU-heavy: one mutant at a time.
#   bash scripts/mutation.sh --targets files --phases after --max-mutants 40
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/python -m pip install --quiet -c scripts/constraints.txt -e ".[mutation]"
exec .venv/bin/python scripts/mutation.py "$@"
