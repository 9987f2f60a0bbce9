"""What one host-matrix cell measures with the project itself (run inside the VM, or on
any host: ``python -m tests.hosts.probe``): the limit mode and caps the local driver
reports, and the per-slot memory limit seen from the host.

Prints one JSON line, ``HOSTS-PROBE {...}`` (``{"start_error": ...}`` where the backend
could not start):

- ``limits``, ``limits_note``, ``memory_enforced``, ``pids_enforced``, ``cpu_enforced``:
  from ``get_status()``;
- ``oom``: a slot (``slot_memory=128``) allocating 400 MiB while its neighbour runs a
  loop: whether the allocating command failed with the memory limit in its error, and
  whether the neighbour's loop (started before, checked after) was still running and
  answered; ``slot_cgroup``: the bomb's slot's ``memory.max`` as read on the host (v2);
- ``memory_total``: three processes of 60 MiB at once in one slot (each under its 128
  MiB, together past it): ``killed`` where the limit is a slot total;
- ``cpu_s_in_2s``: CPU seconds a busy loop got in 2 s of wall time with ``cpu=0.5``
  (about 1.0 where the sandbox's CPU is capped; up to 2.0 where not and a core is free).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from hermes_modal_tool import SandboxConfig, ToolBackend

BOMB = "python3 -c \"b = bytearray(400 << 20); print('allocated', len(b))\""
#: Three processes of 60 MiB each, holding it at once: each under slot_memory (128 MiB),
#: together past it. Each says "held" once the three have allocated, "alone" once one of
#: them died (killed while allocating, say).
HOLD = """import os, time
me = os.getpid()
open("/tmp/hold/s%d" % me, "w").close()
b = b"x" * (60 << 20)
open("/tmp/hold/a%d" % me, "w").close()
def dead(pid):
    try:
        with open("/proc/%s/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True
end = time.time() + 60
while time.time() < end:
    names = os.listdir("/tmp/hold")
    if sum(n[0] == "a" for n in names) >= 3:
        print("held")
        break
    if any(dead(n[1:]) for n in names if n[0] == "s"):
        print("alone")
        break
    time.sleep(0.05)
"""
TOTAL = ("rm -rf /tmp/hold; mkdir /tmp/hold; cat > /tmp/hold.py <<'PY'\n" + HOLD + "PY\n"
         "for i in 1 2 3; do python3 /tmp/hold.py & done; wait")
#: CPU seconds a busy loop gets in 2 s of wall time (the sandbox has cpu=0.5).
SPIN = ("python3 -c \"import os, time\nt0 = os.times()\nend = time.time() + 2\n"
        "while time.time() < end: pass\n"
        "t = os.times(); print(round(t.user + t.system - t0.user - t0.system, 2))\"")


def _slot_cgroup_memory_max(status: dict) -> str | None:
    """``memory.max`` of a slot cgroup of this host's agents (cgroup v2), if any."""
    note = status.get("limits_note") or ""
    if status.get("limits") != "cgroup-v2":
        return None
    for top, _dirs, _files in os.walk("/sys/fs/cgroup"):
        if os.path.basename(top).startswith("slot_") and "hermes-modal-tool" in top:
            try:
                with open(os.path.join(top, "memory.max")) as fh:
                    return "{}={} ({})".format(top, fh.read().strip(), note.split(":")[0])
            except OSError:
                return None
    return None


async def main() -> dict:
    backend = ToolBackend(SandboxConfig(slots_per_sandbox=2, min_sandboxes=1, max_sandboxes=1,
                                        slot_memory=128, memory=512, pids_limit=64, cpu=0.5))
    try:
        await backend.start()
    except Exception as exc:  # noqa: BLE001 - reported: a host without user namespaces, say
        return {"start_error": f"{type(exc).__name__}: {exc}"}
    try:
        pool = backend.get_status()["pools"][backend.default_profile]
        caps = pool["caps"]
        out = {"limits": pool["limits"], "limits_note": pool.get("limits_note"),
               "memory_enforced": caps["memory"]["enforced"],
               "pids_enforced": caps["pids"]["enforced"],
               "cpu_enforced": caps.get("cpu", {}).get("enforced")}
        bomb, neighbour = await backend.acquire("probe-bomb"), await backend.acquire("probe-n")
        started = await backend.execute(neighbour, "bash",
                                        {"command": "(while :; do sleep 0.2; done) & echo $! > /tmp/loop; echo up"})
        out["slot_cgroup"] = _slot_cgroup_memory_max(pool)
        r = await backend.execute(bomb, "bash", {"command": BOMB}, timeout_s=120)
        alive = await backend.execute(neighbour, "bash",
                                      {"command": "kill -0 $(cat /tmp/loop) && echo still-running"})
        again = await backend.execute(bomb, "bash", {"command": "echo fresh"})
        out["oom"] = {
            "bomb_success": r.success, "bomb_error": r.error, "bomb_output": r.output[-200:],
            "reported": (not r.success) and "memory limit" in (r.error or ""),
            "neighbour_started": started.output.strip() == "up",
            "neighbour_alive": alive.output.strip() == "still-running",
            "slot_usable_after": again.output.strip() == "fresh",
        }
        total = await backend.execute(bomb, "bash", {"command": TOTAL}, timeout_s=120)
        out["memory_total"] = {"held": total.output.count("held"), "error": total.error,
                               "output": total.output[-300:],
                               "killed": total.output.count("held") < 3}
        spin = await backend.execute(neighbour, "bash", {"command": SPIN}, timeout_s=60)
        try:
            out["cpu_s_in_2s"] = float(spin.output.split()[-1])
        except (ValueError, IndexError):
            out["cpu_s_in_2s"] = spin.output + (spin.error or "")
        await backend.release(bomb)
        await backend.release(neighbour)
        return out
    finally:
        await backend.stop()


if __name__ == "__main__":
    result = asyncio.run(main())
    print("HOSTS-PROBE " + json.dumps(result), flush=True)
    if "start_error" in result:
        sys.exit(2)
    oom = result["oom"]
    sys.exit(0 if oom["reported"] and oom["neighbour_started"] and oom["neighbour_alive"] else 1)
