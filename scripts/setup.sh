#!/usr/bin/env bash
# Create a virtual environment with Python >= 3.10 and install the package into it.
#   bash scripts/setup.sh core     .venv: the package and its runtime dependencies only (scripts/main.sh)
#   bash scripts/setup.sh dev      .venv: that plus every dev extra: adapters, Modal SDK, MCP, test
#                                  tools (scripts/test.sh, and so .ci/run); the default
#   bash scripts/setup.sh agents   .venv-agents: the OpenAI Agents SDK and the test tools (its
#                                  openai>=3 cannot share .venv with hermes-agent's openai 2 pin)
# Idempotent: a stamp per level and pyproject.toml; a dev install also satisfies core.
set -euo pipefail
cd "$(dirname "$0")/.."
level="${1:-dev}"
venv=.venv
# Every install is pinned to the versions the suite last passed with (a constraints file
# per environment; regenerate with `pip freeze --exclude-editable` after an upgrade): an
# unpinned install resolves against today's index, and a new release can leave pip
# backtracking for many minutes (langchain-core 1.8 against hermes-agent's exact pins).
constraints=scripts/constraints.txt
case "$level" in
  core) spec="." ;;
  dev) spec=".[dev]" ;;
  agents) spec=".[agents-dev]"; venv=.venv-agents; constraints=scripts/constraints-agents.txt ;;
  *) echo "setup: unknown level '$level' (use core, dev or agents)" >&2; exit 2 ;;
esac
# network: egress, the default (README, "Network"): the agent sets each slot's namespace
# up with rtnetlink and libnftables (nftables), the router reaches out through
# slirp4netns. Installed when missing and running as root on Debian/Ubuntu, whatever the
# level; without them (or without root) the default becomes network: none, said in status.
apt_updated=""
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=""
  for pair in slirp4netns:slirp4netns nft:nftables ip:iproute2; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing="$missing ${pair#*:}"
  done
  if [ -n "$missing" ]; then
    echo "setup: installing$missing (apt-get, for network: egress)" >&2
    apt-get update -q >/dev/null
    apt_updated=1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >/dev/null
  fi
fi
# The image tests (tests/test_images.py) build images with umoci and skopeo from Debian's
# busybox-static, and a Debian image with mmdebstrap (built once, outside the repo: see
# hermes_modal_tool/testing/images.py); slots on an image without bash run the host's
# bash-static. Installed when missing and running as root on Debian/Ubuntu (apt-get
# update once, first).
if [ "$level" = dev ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=""
  # The network benchmark (benchmarks/network.py) compares slirp4netns and passt's pasta
  # with a veth pair as a slot's egress path; the host matrix's d13-root cell builds its
  # Debian 13 root filesystem with debootstrap (tests/hosts/rootfs.py).
  for pair in skopeo:skopeo umoci:umoci busybox:busybox-static bash-static:bash-static \
      mmdebstrap:mmdebstrap pasta:passt debootstrap:debootstrap; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing="$missing ${pair#*:}"
  done
  if [ -n "$missing" ]; then
    echo "setup: installing$missing (apt-get, for the image tests)" >&2
    [ -n "$apt_updated" ] || apt-get update -q >/dev/null
    apt_updated=1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null
  fi
  # The host matrix (tests/hosts/run.py) boots Debian's kernel in qemu; the kernel package
  # itself is downloaded (apt-get download) into its cache, not installed.
  if ! command -v qemu-system-x86_64 >/dev/null 2>&1 && [ "$(uname -m)" = x86_64 ]; then
    echo "setup: installing qemu-system-x86 (apt-get, for the host matrix)" >&2
    [ -n "$apt_updated" ] || apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      qemu-system-x86 >/dev/null
  fi
fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.13 python3.10 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
      PY="$cand"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: need Python >= 3.10 on PATH" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv"
fi
hash=$(cat pyproject.toml "$constraints" | sha256sum | cut -c1-16)
if [ -f "$venv/.installed-dev-$hash" ] || [ -f "$venv/.installed-$level-$hash" ]; then
  exit 0
fi
echo "setup: installing the package ($level) into $venv (first run only)" >&2
if [ "$level" != core ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
"$venv/bin/python" -m pip install --quiet -c "$constraints" -e "$spec"
rm -f "$venv"/.installed-*
touch "$venv/.installed-$level-$hash"
