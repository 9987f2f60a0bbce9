"""The host matrix: the project on other kernels and cgroup layouts, in VMs, and a table.

    sudo .venv/bin/python -m tests.hosts.run [--cells host,v2-root,...] [--quick[=CELLS]]

Cells (each but ``host`` boots Debian 12's stock kernel, 6.1, with cgroup v2 only, on
this host's own ``/``: :mod:`tests.hosts.vm`):

- ``host``: this machine as it is (no VM), as root;
- ``v2-root``: cgroup v2, the backend as root;
- ``v2-user``: cgroup v2, the backend as an unprivileged user (uid 1000) with no
  delegated cgroup and no systemd: the rlimit fallback, with its reason;
- ``v2-user-nouserns``: that user where user namespaces cannot be made
  (``user.max_user_namespaces=0``; Ubuntu 24.04's AppArmor restriction refuses them to
  unprivileged users alike): the backend refuses to start, saying how to enable them;
- ``v2-user-systemd``: the VM boots systemd; the same user runs the cell as a service
  of its own user manager, and the local driver starts each agent with
  ``systemd-run --user --scope -p Delegate=yes`` (a delegated cgroup of its own);
- ``d13-root``: cgroup v2 as root (the same kernel) on a Debian 13 (trixie) root
  filesystem instead of this host's (:mod:`tests.hosts.rootfs`): trixie's Python 3.13
  runs the project from the wheel built from this checkout (installed into a virtual
  environment there); slots' commands run trixie's programs. The checkout is shared
  read-only; the cell copies ``tests/`` and ``examples/`` out of it, so that
  ``hermes_modal_tool`` is imported from the wheel.

In each: :mod:`tests.hosts.probe` (limit mode, caps, a slot past its ``slot_memory``
next to a running neighbour, a slot's memory total, the CPU cap), the main job
(``hermes-modal-tool batch --strict examples/coding_rollouts.jsonl``, as
``scripts/main.sh`` runs it), and :data:`TESTS` (the
isolation and limit tests). ``--quick``: the probe only (in the cells listed, or all).
Prints one table row per cell;
exits 1 when a cell fails.

Without ``/dev/kvm``'s stock-kernel support the VM runs under TCG (emulation, about ten
times slower: see :func:`tests.hosts.vm.accel`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.hosts import rootfs, vm

REPO = Path(__file__).resolve().parents[2]
#: The isolation and resource-limit tests each full cell runs: the pids limit, a slot
#: past its memory limit, timeouts, kill on release, slot uids and what a slot sees. A
#: subset: under emulation (TCG) each test takes minutes.
TESTS = " ".join((
    "tests/security/test_attack_resources.py::test_fork_bomb_hits_the_pids_limit",
    "tests/security/test_attack_resources.py::test_memory_bomb_hits_the_slot_memory_limit",
    "tests/security/test_attack_resources.py::test_busy_loops_stop_at_the_timeout",
    "tests/security/test_attack_processes.py::test_escapes_do_not_survive_a_timeout_or_release",
    "tests/security/test_attack_processes.py::test_cannot_see_signal_or_trace_other_slots_or_the_agent",
    "tests/test_isolation.py::test_slots_run_as_different_users",
    "tests/test_isolation.py::test_slot_cannot_read_another_slots_files",
    "tests/test_isolation.py::test_slot_sees_only_its_own_processes",
))
MAIN = "examples/coding_rollouts.jsonl"
USER = 1000

CELL = r"""
set -u
{setup}
cd {repo}
# Under emulation (TCG) a sandbox start takes minutes and a command seconds: the main job's
# per-call timeout (30 s, the profile default) is scaled like the tests' (a call's own
# timeout, the scenarios that must time out, stays as written). Unscaled, 154 of its 544
# calls timed out in the v2-root cell and all 64 trajectories failed. Emulated, the main job
# also runs 16 trajectories at a time, not 64 (two sandboxes of 8 slots): the agent's own fixed waits (15 s for
# a process's helper to connect, 60 s for a shell to start) are not scaled, and with 64 at
# once on the VM's two emulated CPUs 20 of 64 trajectories of the Debian 13 cell ran past them.
export HERMES_MODAL_TOOL_START_TIMEOUT_S={start_s} HMT_TEST_TIME_SCALE={scale}
echo "HOSTS-KERNEL $(uname -r) $(stat -fc %T /sys/fs/cgroup)"
echo "HOSTS-PYTHON $({py} -c 'import platform, hermes_modal_tool as m; print(platform.python_version(), m.__file__)')"
{prepare}
# Under emulation every stat over 9p is slow: read the metadata the first sandbox start
# scans (drivers/_rootmask.py) once, so that no sandbox start passes its timeout.
start=$(date +%s)
find /etc /var /opt /srv /boot /usr/local -xdev > /dev/null 2>&1
echo "HOSTS-WARM $(( $(date +%s) - start ))s"
{run} {py} -m tests.hosts.probe 2>/tmp/probe.err
echo "HOSTS-PROBE-RC $?"
tail -n 5 /tmp/probe.err
if [ -z "{quick}" ]; then
  start=$(date +%s)
  {run} {py} -m hermes_modal_tool batch --strict --timeout {call_s} {width} {main} -o /tmp/results.jsonl > /tmp/main.log 2>&1
  echo "HOSTS-MAIN-RC $? $(( $(date +%s) - start ))s"
  echo "HOSTS-MAIN-TRAJECTORIES $(wc -l < /tmp/results.jsonl)"
  tail -n 4 /tmp/main.log
  cp /tmp/results.jsonl /hmt-out/results.jsonl 2>/dev/null
  cp /tmp/main.log /hmt-out/main.log 2>/dev/null
  echo "HOSTS-MAIN-SPACE $(df -m --output=avail /tmp | tail -n 1) MiB free in /tmp, $(free -m | awk '/Mem:/ {{print $7}}') MiB available"
  {py} -c 'import json, sys
bad = [json.loads(line) for line in open("/tmp/results.jsonl") if not json.loads(line).get("ok")]
for r in bad[:8]:
    print("HOSTS-MAIN-BAD", r.get("id"), r.get("error"), [
        (i, s.get("expectation_met"), s["tool"], s["returncode"], s["timed_out"], s["duration_s"],
         s["error"], str(s["output"])[-160:]) for i, s in enumerate(r.get("steps") or [])])'

  start=$(date +%s)
  {run} {py} -m pytest -q -p no:cacheprovider -o timeout={test_s} {tests} > /tmp/tests.log 2>&1
  echo "HOSTS-TESTS-RC $? $(( $(date +%s) - start ))s"
  tail -n 25 /tmp/tests.log
  cp /tmp/tests.log /hmt-out/tests.log 2>/dev/null  # kept whole under --logs DIR/CELL
fi
echo "HOSTS-LEFT $(find /sys/fs/cgroup -name 'hermes-modal-tool*' | head -n 3)"
"""

USER_PREPARE = r"""
chmod 755 /root  # (in the VM's copy) the venv's Python is under /root/.pyenv here
mkdir -p /tmp/home-{uid} && chown {uid}:{uid} /tmp/home-{uid}
"""


SYSTEMD_PREPARE = r"""
systemctl start user@{uid}.service
systemctl --no-pager status user@{uid}.service | head -n 5
"""


#: The d13-root cell: the checkout (9p tag ``repo``) mounted read-only, and what the cell
#: runs from it copied to a directory without the package's source.
D13_SETUP = r"""
mkdir -p /hmt-repo /tmp/hmt-work
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000 repo /hmt-repo || echo "HOSTS-NO-REPO"
cp -r /hmt-repo/tests /hmt-repo/examples /hmt-repo/pyproject.toml /tmp/hmt-work/
echo "HOSTS-ROOT $(. /etc/os-release; echo $PRETTY_NAME), $(python3 --version)"
"""


#: The Python that runs each cell's probe, main job and tests: the project's ``.venv``
#: where there is one (the README's set-up), else this interpreter (an installed wheel).
PY = ".venv/bin/python" if (REPO / ".venv/bin/python").exists() else sys.executable


def cell_script(cell: str, quick: bool) -> str:
    run, prepare, setup, repo, py = "", "", "", REPO, PY
    emulated = cell != "host" and "tcg" in vm.accel()[1]
    scale = 10 if emulated else 1
    start_s = 120 * scale
    user = f"setpriv --reuid={USER} --regid={USER} --clear-groups env HOME=/tmp/home-{USER} USER=user{USER}"
    if cell.endswith("-user") or cell.endswith("-user-nouserns"):
        run = user
        prepare = USER_PREPARE.format(uid=USER)
        if cell.endswith("-nouserns"):  # as Ubuntu 24.04's AppArmor rule does to users
            prepare += "sysctl -w user.max_user_namespaces=0\n"
    elif cell.endswith("-user-systemd"):
        # A service of the user's own manager (as a desktop or ssh session's commands
        # are in the user's slices), which then starts each agent in a delegated scope.
        run = (f"{user} XDG_RUNTIME_DIR=/run/user/{USER} systemd-run --user --wait --pipe "
               f"--quiet --collect --same-dir -E HOME=/tmp/home-{USER} "
               f"-E HERMES_MODAL_TOOL_START_TIMEOUT_S={start_s} -E HMT_TEST_TIME_SCALE={scale} --")
        prepare = USER_PREPARE.format(uid=USER) + SYSTEMD_PREPARE.format(uid=USER)
    elif cell == "d13-root":
        setup, repo, py = D13_SETUP, "/tmp/hmt-work", f"{rootfs.VENV}/bin/python"
    width = "--slots-per-sandbox 8 --max-sandboxes 2" if emulated else ""
    return CELL.format(width=width, repo=repo, prepare=prepare, run=run, quick="1" if quick else "",
                       setup=setup, main=MAIN, tests=TESTS, py=py, scale=scale, start_s=start_s, test_s=300 * scale,
                       call_s=30 * scale)


def run_cell(cell: str, quick: bool, timeout_s: float, keep: str | None = None) -> dict:
    """Run one cell; return its row (the probe's fields, the main job's and the tests'
    exit codes and tails, the seconds it took). ``keep``: a directory where a VM cell's
    files (its main job's ``results.jsonl`` and log) are copied, under the cell's name."""
    script = cell_script(cell, quick)
    start = time.monotonic()
    if cell == "host":
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                              timeout=timeout_s, cwd=REPO)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    else:
        root, shares = Path("/"), None
        if cell == "d13-root":
            root, shares = rootfs.tree(), {"repo": REPO}
            rootfs.install_wheel(root, REPO)
        rc, out, _ = vm.run(script, timeout_s=timeout_s, systemd=cell.endswith("-systemd"),
                            keep=Path(keep, cell) if keep else None, root=root, shares=shares)
    row = {"cell": cell, "seconds": round(time.monotonic() - start), "vm_rc": rc, "log": out}
    for key, pattern in (("kernel", r"HOSTS-KERNEL (\S+) (\S+)"), ("probe_rc", r"HOSTS-PROBE-RC (\d+)"),
                         ("main", r"HOSTS-MAIN-RC (\d+) (\d+s)"), ("tests", r"HOSTS-TESTS-RC (\d+) (\d+s)"),
                         ("python", r"HOSTS-PYTHON (\S+) (\S+)")):
        m = re.search(pattern, out)
        row[key] = m.groups() if m else None
    m = re.search(r"HOSTS-PROBE (\{.*\})", out)
    row["probe"] = json.loads(m.group(1)) if m else None
    m = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", out, re.M)
    row["tests_summary"] = m[-1] if m else None
    m = re.search(r"HOSTS-MAIN-TRAJECTORIES (\d+)", out)
    bad = re.search(r"(\d+) trajectories did not meet", out)
    row["main_summary"] = (f"{int(m.group(1)) - int(bad.group(1) if bad else 0)}/{m.group(1)} ok"
                           if m else None)
    row["ok"] = verdict(row)
    return row


#: The limit mode each VM cell must report (``host``: whatever this machine has).
EXPECTED_LIMITS = {"v2-root": "cgroup-v2", "v2-user-systemd": "cgroup-v2", "v2-user": "rlimit",
                   "d13-root": "cgroup-v2"}


def verdict(row: dict) -> bool:
    """A cell passes when the probe ran, reported the cell's limit mode
    (:data:`EXPECTED_LIMITS`) and its limits behave as that mode promises, and the main job
    and the tests (where run) exited 0."""
    p = row["probe"]
    if p is None:
        return False
    if "start_error" in p:  # expected only where user namespaces are off
        return row["cell"].endswith("-nouserns") and "user namespace" in p["start_error"]
    want = EXPECTED_LIMITS.get(row["cell"])
    if want is not None and p["limits"] != want:
        return False
    oom = p["oom"]
    if not (oom["neighbour_started"] and oom["neighbour_alive"] and oom["slot_usable_after"]):
        return False
    if p["limits"].startswith("cgroup"):
        cpu = p["cpu_s_in_2s"]
        if not (oom["reported"] and p["memory_total"]["killed"] and "per slot" in p["memory_enforced"]
                and isinstance(cpu, float) and cpu <= 1.3):
            return False
    elif not p["limits_note"]:  # the fallback says why
        return False
    return all(r is None or r[0] == "0" for r in (row["main"], row["tests"]))


def table(rows: list[dict]) -> str:
    head = ("cell", "kernel", "cgroupfs", "python", "limits", "caps.memory.enforced", "OOM: bomb / neighbour",
            "slot total", "cpu s/2s", "main job", "tests", "time", "result")
    lines = [head]
    for r in rows:
        p = r["probe"] or {}
        oom = p.get("oom") or {}
        if "start_error" in p:
            p = {"limits": "-", "memory_enforced": "start refused: " + p["start_error"][:80]}
        lines.append((
            r["cell"], (r["kernel"] or ("?", "?"))[0], (r["kernel"] or ("?", "?"))[1],
            (r.get("python") or ("?",))[0],
            p.get("limits", "?"), (p.get("memory_enforced") or "?")[:60],
            ("killed+reported" if oom.get("reported") else "not reported") + " / "
            + ("running" if oom.get("neighbour_alive") else "NOT running"),
            "killed" if (p.get("memory_total") or {}).get("killed") else "not capped",
            str(p.get("cpu_s_in_2s", "?")),
            "skipped" if r["main"] is None else
            f"rc={r['main'][0]} {r['main_summary'] or ''} {r['main'][1]}",
            "skipped" if r["tests"] is None else f"rc={r['tests'][0]} {r['tests_summary'] or ''} {r['tests'][1]}",
            f"{r['seconds']}s", "PASS" if r["ok"] else "FAIL"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join(" | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="host,v2-root,v2-user,v2-user-nouserns,v2-user-systemd,d13-root")
    ap.add_argument("--quick", nargs="?", const="all", default="",
                    help="the probe only: in every cell, or in those listed (a,b)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per cell")
    ap.add_argument("--logs", help="directory to write each cell's log to")
    args = ap.parse_args(argv)
    cells = args.cells.split(",")
    why = vm.missing()
    if why and any(c != "host" for c in cells):
        print(f"host matrix: VM cells skipped: {why}", file=sys.stderr)
        cells = [c for c in cells if c == "host"]
    why = rootfs.missing()
    if why and "d13-root" in cells:
        print(f"host matrix: d13-root skipped: {why}", file=sys.stderr)
        cells.remove("d13-root")
    rows = []
    for cell in cells:
        print(f"host matrix: running {cell} ...", file=sys.stderr, flush=True)
        quick = args.quick == "all" or cell in args.quick.split(",")
        row = run_cell(cell, quick, args.timeout, keep=args.logs)
        rows.append(row)
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            Path(args.logs, f"{cell}.log").write_text(row["log"])
            Path(args.logs, f"{cell}.json").write_text(json.dumps(
                {k: v for k, v in row.items() if k != "log"}, indent=1))
        if not row["ok"]:
            print(row["log"][-3000:], file=sys.stderr)
    print(table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
