"""Secrets, environment and network attacks.

Network checks never send traffic off the machine: they read interfaces, or connect
to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from support import SMALL, bash

from hermes_modal_tool import SandboxConfig

from .helpers import call


def leak_cmds(value: str) -> list[str]:
    """Commands that dump what a slot could see; the grep pattern cannot match itself."""
    pattern = f"{value[:3]}[{value[3]}]{value[4:]}"
    return ["env", "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", "set", "declare -x",
            "cat /proc/1/environ | tr '\\0' '\\n'",
            f"grep -ras '{pattern}' /proc/*/environ /proc/*/cmdline /run /tmp /dev/shm"]


async def test_host_env_var_is_invisible(make_backend, monkeypatch):
    value = "sk-canary-" + secrets.token_hex(8)
    monkeypatch.setenv("OPENAI_API_KEY", value)
    backend = await make_backend()
    slot = await backend.acquire("t")
    for cmd in leak_cmds(value):
        r = await bash(backend, slot, cmd)
        assert value not in r.output and "OPENAI_API_KEY" not in r.output, cmd
    r = await call(backend, slot, "read_file", path="/proc/self/environ")
    assert not r.success and value not in r.output
    r = await bash(backend, slot, "echo \"[$OPENAI_API_KEY]\"")
    assert r.output == "[]\n"


@pytest.fixture
def secrets_dir(monkeypatch):
    base = next((d for d in ("/opt", "/srv", "/var/lib") if Path(d).is_dir()), None)
    path = Path(tempfile.mkdtemp(prefix="hmt-secrets-", dir=base))
    value = "sk-profile-" + secrets.token_hex(10)
    (path / "api.env").write_text(f"API_KEY={value}\n")
    monkeypatch.setenv("HERMES_MODAL_TOOL_SECRETS_DIR", str(path))
    yield value
    shutil.rmtree(path, ignore_errors=True)


async def test_profile_secret_only_in_its_slots_and_never_in_logs_status_or_errors(
        make_backend, secrets_dir, caplog):
    value = secrets_dir
    caplog.set_level(logging.DEBUG)
    backend = await make_backend(profiles={
        "keyed": SandboxConfig(**{**SMALL, "name": "keyed", "secrets": ["api"], "slot_memory": 128,
                                  "pids_limit": 32}),
        "plain": SandboxConfig(**{**SMALL, "name": "plain", "min_sandboxes": 0}),
    }, default_profile="keyed")
    k = await backend.acquire("k", profile="keyed")
    p = await backend.acquire("p", profile="plain")
    assert (await bash(backend, k, "echo $API_KEY")).output == value + "\n"
    for cmd in leak_cmds(value):
        r = await bash(backend, p, cmd)
        assert value not in r.output and "API_KEY" not in r.output, cmd
    # Failures of every kind in the keyed slot: the value never reaches an error text.
    failing = [
        (k, "bash", {"command": "exit 3"}), (k, "bash", {"command": "sleep 5", "timeout": 0.5}),
        (k, "bash", {"command": "python3 -c 'x=bytearray(512<<20)'"}),
        (k, "bash", {"command": "for i in $(seq 64); do sleep 5 & done; exit 1"}),
        (k, "bash", {"command": "kill -9 $$"}), (k, "read_file", {"path": "/proc/self/environ"}),
        (k, "write_file", {"path": "/", "content": "$API_KEY"}),
        (k, "bash", {"command": "echo hi", "env": {"BAD NAME": "x"}}),
        (k, "nope", {"path": "x"}),
    ]
    results = await backend.execute_batch(failing, timeout_s=20)
    texts = [json.dumps(backend.get_status(), default=str), json.dumps(backend.list_profiles())]
    texts += [r.error or "" for r in results] + [json.dumps(r.metadata, default=str) for r in results]
    texts += [rec.getMessage() for rec in caplog.records]
    assert all(not r.success for r in results)
    for text in texts:
        assert value not in text


async def test_network_false_has_only_loopback_and_loopback_works(make_backend):
    backend = await make_backend(network=False)
    a = await backend.acquire("a")
    b = await backend.acquire("b")
    r = await bash(backend, a, "ls /sys/class/net 2>/dev/null; tail -n +3 /proc/net/dev | cut -d: -f1")
    assert r.output.split() == ["lo"]
    server = ("import socket\ns=socket.socket(); s.bind(('127.0.0.1', 47613)); s.listen()\n"
              "while True:\n c,_=s.accept(); c.sendall(b'hello-from-slot'); c.close()\n")
    await call(backend, a, "write_file", path="srv.py", content=server)
    assert (await bash(backend, a, "python3 srv.py", background=True)).success
    client = ("import socket,sys,time\n"
              "for _ in range(50):\n"
              " try:\n  c=socket.create_connection(('127.0.0.1', 47613), timeout=1); "
              "print(c.recv(100).decode()); break\n"
              " except OSError as e:\n  err=e; time.sleep(0.1)\n"
              "else: print('refused', err.errno)\n")
    for s in (a, b):
        await call(backend, s, "write_file", path="cli.py", content=client)
    r = await bash(backend, a, "python3 cli.py")
    assert r.output == "hello-from-slot\n"  # loopback inside the slot works
    r = await bash(backend, b, "python3 cli.py", timeout=15)
    assert r.output.startswith("refused")  # each slot has its own loopback
    # The host cannot reach the slot's listener either.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", 47613), timeout=1).close()


async def test_network_host_shares_the_hosts_network(make_backend):
    """Documented behaviour: with ``network: host`` (asked for; the default is ``egress``,
    tests/net/test_network_default.py) a slot shares the host's network namespace, so it
    reaches a service listening on the host's loopback."""
    backend = await make_backend(network="host")
    slot = await backend.acquire("host-network")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        r = await bash(backend, slot, f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), "
                                      f"timeout=2); print('reached-host')\"")
        assert r.output == "reached-host\n"
    finally:
        listener.close()


# A client and a server for abstract UNIX sockets, run in a slot with python3.
ABSTRACT_CONNECT = ("python3 -c 'import socket,sys\ns=socket.socket(socket.AF_UNIX)\ntry:\n"
                    "    s.connect(\"\\0\"+sys.argv[1]); s.sendall(b\"hello\"); print(\"connected\")\n"
                    "except OSError as e:\n    print(\"refused\", e.errno)' {name}")
ABSTRACT_SERVE = ("python3 -c 'import socket,sys\ns=socket.socket(socket.AF_UNIX)\n"
                  "s.bind(\"\\0\"+sys.argv[1]); s.listen(); s.settimeout(8)\ntry:\n"
                  "    c,_=s.accept(); print(\"accepted\", c.recv(10).decode())\n"
                  "except OSError:\n    print(\"nobody\")' {name} > {log} 2>&1 &")


async def test_abstract_unix_sockets_of_the_host_and_of_other_slots_are_out_of_reach(mode_backend):
    """With ``network: host`` slots share the host's network namespace, and with it the
    abstract UNIX socket namespace. Each slot's shell runs in its own Landlock domain
    scoped for abstract sockets: it reaches its own, never the host's or a neighbour's."""
    backend = await mode_backend(**SMALL, network="host")
    attacker, neighbour = await backend.acquire("attacker"), await backend.acquire("neighbour")
    pool = backend.get_status()["pools"][backend.default_profile]
    assert pool["abstract_sockets"].startswith("scoped"), pool
    host_name = "hmt-host-" + secrets.token_hex(6)
    host = socket.socket(socket.AF_UNIX)
    host.bind("\0" + host_name)
    host.listen()
    host.setblocking(False)
    try:
        r = await bash(backend, attacker, ABSTRACT_CONNECT.format(name=host_name))
        assert r.output.startswith("refused"), r.output
        with pytest.raises(BlockingIOError):  # the victim's side: nothing came in
            host.accept()
    finally:
        host.close()
    slot_name = "hmt-slot-" + secrets.token_hex(6)
    assert (await bash(backend, neighbour, ABSTRACT_SERVE.format(name=slot_name, log="serve.log"))).success
    r = await bash(backend, attacker, f"sleep 1; {ABSTRACT_CONNECT.format(name=slot_name)}")
    assert r.output.startswith("refused"), r.output
    assert (await bash(backend, neighbour, "wait; cat serve.log")).output == "nobody\n"
    # Not over-restricted: a slot's own processes still talk over abstract sockets.
    own = "hmt-own-" + secrets.token_hex(6)
    assert (await bash(backend, attacker, ABSTRACT_SERVE.format(name=own, log="own.log"))).success
    r = await bash(backend, attacker, f"sleep 1; {ABSTRACT_CONNECT.format(name=own)}; wait; cat own.log")
    assert r.output == "connected\naccepted hello\n", r.output
