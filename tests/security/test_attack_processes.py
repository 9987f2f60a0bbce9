"""Process attacks from inside a slot: seeing, signalling or tracing another slot's
processes or the agent, and escaping the slot's lifetime (``setsid``, ``nohup``,
double fork, ``disown``, a daemon). Checked from the host through ``/proc``.
"""

from __future__ import annotations

import os

from support import agent_processes, bash, processes, settle

from .helpers import call, fresh_shell_only, none_alive, slot_owner

PTRACE = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
for pid in map(int, sys.argv[1:]):
    rc = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
    print(pid, rc, ctypes.get_errno())
"""


async def test_cannot_see_signal_or_trace_other_slots_or_the_agent(backend, two_slots):
    a, b = two_slots
    r = await bash(backend, a, "sleep 300", background=True)
    assert r.success
    owner_a = await slot_owner(backend, a)
    victims = await settle(lambda: [p.pid for p in processes().values()
                                    if p.pid in owner_a.pids() and p.comm == "sleep"])
    agents = list(agent_processes())
    assert victims and agents
    host_pids = " ".join(map(str, victims + agents + [os.getpid()]))
    r = await bash(backend, b, "ps -eo pid=,user=,args=; ls /proc | grep -c '^[0-9]'")
    assert "sleep 300" not in r.output and "hermes_modal_tool" not in r.output
    attacks = [
        f"kill -9 {host_pids}", f"kill -STOP {host_pids}", "kill -9 -1", "kill -9 1; kill -9 0",
        "pkill -9 sleep; pkill -9 -f hermes_modal_tool; pkill -9 python3",
        f"for p in {host_pids}; do cat /proc/$p/environ /proc/$p/cmdline; ls /proc/$p/root/; done",
    ]
    for cmd in attacks:
        r = await bash(backend, b, cmd + " 2>&1")
        assert "sleep 300" not in r.output and "HMT_TEST_TOKEN" not in r.output, cmd
    await call(backend, b, "write_file", path="pt.py", content=PTRACE)
    r = await bash(backend, b, f"python3 pt.py {host_pids} 2>&1")
    lines = r.output.splitlines()
    assert r.success and len(lines) == len(host_pids.split()), r.output  # every pid was tried
    for line in lines:
        pid, rc, err = map(int, line.split())
        assert rc == -1 and err in (1, 3), line  # EPERM or ESRCH: never attached
    # Positive control: the same script does attach to a process of the slot's own.
    r = await bash(backend, b, "sleep 30 & p=$!; python3 pt.py $p; kill -9 $p")
    assert r.output.split()[1:] == ["0", "0"], r.output
    # The victim's job, the agent and the test process are untouched.
    procs = processes()
    assert all(p in procs and procs[p].comm == "sleep" for p in victims)
    assert all(p in procs for p in agents)
    assert (await bash(backend, a, "echo alive; cat secret.txt")).output == "alive\nvictim-secret\n"


ESCAPES = (
    "setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 & (sleep 1003 &) ; "
    "sleep 1004 & disown; "
    "python3 -c 'import os,time\nif os.fork(): os._exit(0)\nos.setsid()\nif os.fork(): os._exit(0)\n"
    "os.closerange(0, 256); time.sleep(1005)' ; "
    "trap '' TERM HUP; (trap '' TERM HUP INT; exec -a hmt-stubborn sleep 1006) & "
)


async def test_escapes_do_not_survive_a_timeout_or_release(backend, two_slots):
    """Detached processes started by a command that times out are killed with it;
    a ``background=True`` job survives the timeout by design; after ``release()``
    nothing of the slot is left on the host."""
    a, b = two_slots
    owner = await slot_owner(backend, b)
    bg = await bash(backend, b, "sleep 1000", background=True)
    assert bg.success
    r = await bash(backend, b, ESCAPES + "sleep 100", timeout=1.5)
    assert r.metadata["timed_out"] and "timed out" in r.error

    def escaped() -> list:
        procs = processes()
        return [procs[p] for p in owner.pids() if p in procs and procs[p].comm != "bwrap"
                and procs[p].cmdline not in (b"sleep\x001000\x00", b"bash\x00--noprofile\x00--norc\x00")
                and b"bg_1.sh" not in procs[p].cmdline
                # the background job as a process of the slot: its helper and its script
                and b"/run/hmt/ptyhelper.py" not in procs[p].cmdline
                and b"/run/hmt/proc_" not in procs[p].cmdline]

    assert await settle(lambda: not escaped()), escaped()
    r = await bash(backend, b, "ps -eo args=")
    # ps's lines (stdout); bash may add its notice of a job the timeout killed on stderr.
    assert "sleep 1000" in r.stdout  # the background job survived the timeout
    assert not any(f"sleep {n}" in r.stdout for n in range(1001, 1007)), r.output
    assert "hmt-stubborn" not in r.stdout and "sleep 100\n" not in r.stdout, r.output
    # Now the escapes again, in a command that ends normally (they outlive it) ...
    r = await bash(backend, b, ESCAPES + "echo started")
    assert r.output.endswith("started\n")
    before = owner.pids()
    assert len(before) >= 5
    await backend.release(b, reset_workspace=True)
    # ... and release leaves nothing of the slot running on the host (a reset may
    # pre-start a fresh idle shell for the next holder).
    assert await settle(lambda: none_alive(before)), [processes().get(p) for p in before]
    assert await settle(lambda: fresh_shell_only(owner)), [processes().get(p) for p in owner.pids()]
    assert (await bash(backend, a, "echo still-fine")).output == "still-fine\n"


async def test_slot_cannot_kill_its_own_sandbox(backend, two_slots):
    """Killing everything it can see (its init, its shell) ends only its own shell; the
    next command gets a fresh one and the other slot is untouched."""
    a, b = two_slots
    r = await bash(backend, b, "kill -9 -1; kill -9 $$; kill -9 1")
    assert not r.success
    assert (await bash(backend, b, "echo back")).output == "back\n"
    assert (await bash(backend, a, "cat secret.txt")).output == "victim-secret\n"
    assert len(agent_processes()) >= 1
