"""A slot that builds a very deep directory tree must still be wiped and stopped cleanly.

Run in a child process: when the engine leaks its agent here, the leak must not
spill into the other tests' leftover checks (this file sorts last for the same reason).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from support import processes

SCRIPT = textwrap.dedent("""
    import asyncio, json, os
    from hermes_modal_tool import SandboxConfig, ToolBackend

    async def main():
        b = ToolBackend(SandboxConfig(name="deep", slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1,
                                      memory=1024, acquire_timeout_s=5, execution_timeout_s=10))
        await b.start()
        slot = await b.acquire("deep")
        [w] = await b.execute_batch([(slot, "write_file", {"path": "/".join(["d"] * DEPTH) + "/f",
                                                           "content": "z"})])
        report = {"write": [w.success, w.error]}
        try:
            await b.release(slot, reset_workspace=True)
            report["release"] = "ok"
        except Exception as exc:
            report["release"] = f"{type(exc).__name__}: {exc}"
        again = await b.acquire("after")
        [ls] = await b.execute_batch([(again, "bash", {"command": "ls -A | wc -l"})])
        report["after"] = ls.output.strip()
        roots = [d.get("state_root") for d in b.get_status()["drivers"].values()]
        agents = []
        for e in os.listdir("/proc"):
            try:
                with open(f"/proc/{e}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{e}/cmdline", "rb") as fh:
                    if ppid == os.getpid() and b"hermes_modal_tool.agent.main" in fh.read():
                        agents.append(int(e))
            except (OSError, ValueError, IndexError):
                pass
        report["agents"] = agents
        print(json.dumps(report), flush=True)
        await asyncio.wait_for(b.stop(), 20)
        report["roots_left"] = [r for r in roots if r and os.path.exists(r)]
        print(json.dumps(report), flush=True)

    asyncio.run(main())
""")


def _descendants(pid: int) -> list[int]:
    procs = processes()
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p.pid for p in procs.values() if p.ppid == parent]
        out += kids
        todo += kids
    return out


def test_a_3000_level_tree_is_wiped_on_release_and_nothing_is_left(tmp_path: Path) -> None:
    script = tmp_path / "deep.py"
    script.write_text(SCRIPT.replace("DEPTH", "3000"))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=40)
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
        kids = _descendants(proc.pid)
        for pid in [proc.pid, *kids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
    assert not hung, f"the engine hung (stdout {out!r}; stderr tail {err[-800:]!r})"
    assert proc.returncode == 0, err[-1500:]
    reports = [json.loads(line) for line in out.strip().splitlines() if line.startswith("{")]
    # Clean up what the engine leaked (our own child's agents and state), then judge.
    leaked = sorted({pid for r in reports for pid in r.get("agents", []) if pid in processes()})
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    for r in reports:
        for root in r.get("roots_left", []):
            subprocess.run(["rm", "-rf", "--", root], check=False)  # shutil.rmtree recurses too deep
    report = {k: v for r in reports for k, v in r.items()}
    assert not leaked, f"agent processes still running after stop(): {leaked} ({report})"
    assert report["release"] == "ok", report
    assert report["after"] == "0", f"the next holder saw old files: {report}"
    assert report["roots_left"] == [], report
