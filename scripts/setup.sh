#!/usr/bin/env bash
# Create .venv with Python >= 3.10 and install the package with its dev extras, and
# .venv-agents with the OpenAI Agents SDK (openai>=3; hermes-agent pins openai 2, so
# the two cannot share one environment).
# Idempotent; used by scripts/main.sh and scripts/test.sh (and so by .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.13 python3.10 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
      PY="$cand"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: need Python >= 3.10 on PATH" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[dev]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
if [ ! -x .venv-agents/bin/python ]; then
  "$PY" -m venv .venv-agents
fi
if [ ! -f ".venv-agents/$(basename "$stamp")" ]; then
  .venv-agents/bin/python -m pip install --quiet --upgrade pip
  .venv-agents/bin/python -m pip install --quiet -e ".[agents-dev]"
  rm -f .venv-agents/.installed-*
  touch ".venv-agents/$(basename "$stamp")"
fi
