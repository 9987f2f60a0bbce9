"""Round three of the attack suite: the agent never trusts what a slot prints (pids it
would signal as root), checked on the victim's side: a neighbour's shell still runs,
with its state, after the attacker's release; and one slot's processes cannot grow the
agent's memory (checked on the host: the agent's resident memory)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest
from support import SMALL, bash, processes

from hermes_modal_tool import SandboxError

from .helpers import killed
from .test_attack_round_two import agent_pids

# A helper of the attacker's own that connects to the process's socket (setsid's third
# argument: `setsid python3 HELPER SOCKET ...`) and claims the victim's pid as its process.
FAKE_HELPER = ("setsid() { python3 -c 'import socket,struct,sys,time\n"
               "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); p=sys.argv[2].encode()\n"
               "s.sendall(b\"p\"+struct.pack(\">I\",len(p))+p); time.sleep(30)' \"$3\" VICTIM; }")
ATTACKS = {
    # The launcher's `echo $!` prints the victim's pid (background job through a helper).
    "echo": ("echo() { builtin printf '%s\\n' VICTIM; }", "bg"),
    # The same, on the path for slots without python3 (`command -v python3` says none).
    "echo-no-python3": ("command() { return 1; }; echo() { builtin printf '%s\\n' VICTIM; }", "bg"),
    # A process (start_process) whose "helper" claims the victim's pid as its child.
    "fake-helper": (FAKE_HELPER, "process"),
}


async def neighbour(backend, slot) -> str:
    return (await bash(backend, slot, 'echo "$MARK $PWD $$"; cat ../secret.txt')).output


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_a_slot_cannot_name_a_neighbours_shell_as_its_own_process(mode_backend, attack):
    """The attacker makes its shell (or its process's helper) report the victim's shell's
    pid as its background job's; at its release the agent (root) killed that session
    on the Modal driver without bwrap. Pids come from the kernel now (agent/shells/owned.py)."""
    backend = await mode_backend(**{**SMALL, "max_sandboxes": 1})
    victim, attacker = await backend.acquire("victim"), await backend.acquire("attacker")
    assert victim.sandbox_id == attacker.sandbox_id
    r = await bash(backend, victim, "echo victim-secret > secret.txt; mkdir d; cd d; export MARK=kept; echo $$")
    victim_pid = int(r.output.split()[-1])
    before = await neighbour(backend, victim)
    assert before.split()[0] == "kept" and before.split()[1].endswith("/d") and "victim-secret" in before

    redefine, how = ATTACKS[attack]
    tag = str(3_000_000 + secrets.randbelow(900_000))  # this test's own sleeper
    r = await bash(backend, attacker, redefine.replace("VICTIM", str(victim_pid)) + "\ntype echo setsid 2>&1")
    assert "function" in r.output, r.output  # the redefinition is in the attacker's shell
    if how == "bg":
        r = await bash(backend, attacker, f"exec sleep {tag}", background=True)
        assert r.success, r.error
        assert r.metadata["background"]["pid"] != victim_pid  # the job's own pid, not the one printed
    else:
        with pytest.raises(Exception, match="no process of this slot|its helper"):
            await backend.start_process(attacker, f"exec sleep {tag}")
        assert (await bash(backend, attacker, f"unset -f setsid; (setsid sleep {tag} &)")).success

    def sleepers():
        return [p for p, info in processes().items() if info.cmdline == f"sleep\0{tag}\0".encode()]

    for _ in range(100):  # the attacker's own sleeper runs (in every mode a host process)
        if sleepers():
            break
        await asyncio.sleep(0.05)
    mine = sleepers()
    assert mine, "the attacker's own job never ran"

    await backend.release(attacker, reset_workspace=True)
    for _ in range(200):  # positive control: the release kills the attacker's own job
        if killed(mine):
            break
        await asyncio.sleep(0.05)
    assert killed(mine), f"the attacker's job {mine} outlived its release"
    after = await neighbour(backend, victim)
    assert after == before, f"the neighbour's shell was killed or changed: {before!r} -> {after!r}"


def agent_rss_kib() -> int:
    """Resident memory now (VmRSS, KiB) of this test's one agent, read on the host."""
    [pid] = agent_pids()
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


async def test_a_slot_cannot_grow_the_agents_memory_with_processes(mode_backend):
    """80 processes of one slot, each keeping 1 MiB of output, took the agent from 17 to
    112 MiB. Now a slot has at most ``slot_processes`` running (one more is refused,
    naming the cap, as a failed result) and they keep ``slot_process_output`` MiB together:
    the agent's resident memory (host side) stays put while the slot tries for 24, and the
    neighbour still starts its own."""
    backend = await mode_backend(**{**SMALL, "max_sandboxes": 1, "slot_processes": 4, "slot_process_output": 1})
    victim, attacker = await backend.acquire("victim"), await backend.acquire("attacker")
    noisy = "head -c 3000000 /dev/zero | tr '\\0' x; echo; echo printed; touch printed; exec sleep 300"
    first = await backend.start_process(attacker, noisy, pty=False)
    r = await bash(backend, attacker, "until [ -e printed ]; do sleep 0.05; done; rm printed", timeout=60)
    assert r.success, r
    kept = await first.read()  # it keeps its share of the slot's 1 MiB (a quarter), the last of it
    assert kept.endswith(b"x\nprinted\n") and 200_000 < len(kept) <= 270_000, len(kept)
    before = agent_rss_kib()
    refused = []
    for _ in range(24):
        try:
            proc = await backend.start_process(attacker, noisy, pty=False)
        except SandboxError as exc:
            refused.append(str(exc))
            continue
        await proc.read_until(b"printed", timeout_s=30)
    assert len(refused) == 21 and "slot_processes: 4" in refused[0], refused[:1]
    r = await bash(backend, attacker, "sleep 1", background=True)  # a background job is one too
    assert not r.success and "slot_processes: 4" in r.error, r
    grown_mib = (agent_rss_kib() - before) / 1024
    assert grown_mib < 8, f"the agent grew by {grown_mib:.1f} MiB for one slot's processes"
    ours = await backend.start_process(victim, "echo neighbour-ok; exec sleep 300", pty=False)
    assert b"neighbour-ok" in await ours.read_until(b"neighbour-ok", timeout_s=30)
    await first.signal("SIGKILL")
    assert await first.wait(timeout_s=20) is not None
    again = await backend.start_process(attacker, "echo room-again", pty=False)  # an ended one made room
    assert b"room-again" in await again.read_until(b"room-again", timeout_s=30)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (IPv4, hex as in /proc/net/tcp) with a socket listening on ``port``."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.rpartition(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


def test_the_test_servers_listen_on_loopback_only(modal_server):
    """The local Modal control plane and the scripted OpenAI API are test tools with no
    real authentication: they listen on 127.0.0.1 only (read in /proc/net/tcp, host side)."""
    from hermes_modal_tool.testing.openai_server import FakeOpenAIServer

    modal_port = int(modal_server.url.rsplit(":", 1)[1])
    assert listening_addresses(modal_port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    fake = FakeOpenAIServer([]).start()
    try:
        openai_port = int(fake.base_url.rsplit(":", 1)[1].split("/")[0])
        assert listening_addresses(openai_port) == {"0100007F"}
    finally:
        fake.stop()
