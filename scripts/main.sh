#!/usr/bin/env bash
# The example: 64 scripted coding rollouts (examples/coding_rollouts.jsonl), each in
# its own slot, all at once, on local bubblewrap sandboxes. Writes results.jsonl and
# prints a summary; exits 0 when every rollout ended as designed. --strict: every
# expectation on a command's output also names its exit code, and every test run how
# many tests must run (see hermes_modal_tool/cli/_expect.py).
# Extra arguments go to `hermes-modal-tool batch` (e.g. --max-sandboxes 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh core   # the package and its runtime dependencies only
exec .venv/bin/hermes-modal-tool batch --strict examples/coding_rollouts.jsonl -o results.jsonl "$@"
