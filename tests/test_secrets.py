"""Secrets: a profile's named secrets reach that profile's slots and nothing else.

On the local driver a secret ``name`` is the dotenv file ``{name}.env`` in
``HERMES_MODAL_TOOL_SECRETS_DIR``. Its values never appear in status, logs or
error messages.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
from support import SMALL, bash

from hermes_modal_tool import ConfigError, SandboxConfig, SecretNotFoundError


@pytest.fixture
def secret_value() -> str:
    return "sk-test-" + secrets.token_hex(12)


@pytest.fixture
def secrets_dir(monkeypatch, secret_value):
    """A secrets directory outside /tmp (which slots never see anyway), so hiding it is
    what keeps the files out of a slot's view."""
    base = next((d for d in ("/opt", "/srv", "/var/lib") if Path(d).is_dir()), None)
    path = Path(tempfile.mkdtemp(prefix="hmt-secrets-", dir=base))
    (path / "my-api-key.env").write_text(f"API_KEY={secret_value}\nAPI_URL=https://example.invalid\n")
    (path / "other.env").write_text("OTHER_TOKEN=other-" + secrets.token_hex(6) + "\n")
    monkeypatch.setenv("HERMES_MODAL_TOOL_SECRETS_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def profile(name: str, **fields) -> SandboxConfig:
    return SandboxConfig(**{**SMALL, "name": name, **fields})


async def test_secret_reaches_only_its_profiles_slots(make_backend, secrets_dir, secret_value):
    backend = await make_backend(profiles={
        "with-secret": profile("with-secret", secrets=["my-api-key"], env_vars={"DEBUG": "1"}),
        "plain": profile("plain", min_sandboxes=0),
    }, default_profile="with-secret")
    s1 = await backend.acquire("needs-key", profile="with-secret")
    s2 = await backend.acquire("no-key", profile="plain")
    r1, r2 = await backend.execute_batch([
        (s1, "bash", {"command": 'echo "$API_KEY|$API_URL|$DEBUG"'}),
        (s2, "bash", {"command": "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'"}),
    ])
    assert r1.output == f"{secret_value}|https://example.invalid|1\n"
    assert r2.success
    assert secret_value not in r2.output and "API_KEY" not in r2.output


async def test_secret_files_are_hidden_from_slots(make_backend, secrets_dir, secret_value):
    backend = await make_backend(secrets=["my-api-key"])
    slot = await backend.acquire("t")
    r = await bash(backend, slot, f"cat {secrets_dir}/*.env 2>&1; ls -A {secrets_dir} 2>&1")
    assert secret_value not in r.output
    assert "my-api-key.env" not in r.output.replace(f"{secrets_dir}/*.env", "")


async def test_secret_value_is_not_in_status_logs_errors_or_command_lines(
        make_backend, secrets_dir, secret_value, caplog):
    caplog.set_level(logging.DEBUG)
    backend = await make_backend(secrets=["my-api-key"], image="not-the-default:latest")
    slot = await backend.acquire("t")
    results = await backend.execute_batch([
        (slot, "bash", {"command": "test -n \"$API_KEY\" && exit 7"}),
        (slot, "bash", {"command": "sleep 5", "timeout": 0.5}),
        (slot, "read_file", {"path": "/etc/passwd"}),
        (slot, "bash", {"command": "exit 0"}),
    ])
    assert results[0].returncode == 7
    texts = [json.dumps(backend.get_status(), default=str),
             json.dumps(backend.list_profiles(), default=str),
             *(r.error or "" for r in results),
             *(json.dumps(r.metadata, default=str) for r in results),
             *(rec.getMessage() for rec in caplog.records)]
    for text in texts:
        assert secret_value not in text
    for p in make_backend.leftovers.processes():  # every agent and bwrap of this backend
        assert secret_value.encode() not in p.cmdline, p.comm
    assert "my-api-key" in json.dumps(backend.list_profiles())  # names may be shown


async def test_missing_secret_names_it_and_where_it_looked(make_backend, secrets_dir, secret_value):
    backend = await make_backend(secrets=["my-api-key", "does-not-exist"], start=False)
    with pytest.raises(SecretNotFoundError) as exc:
        await backend.start()
    msg = str(exc.value)
    assert isinstance(exc.value, ConfigError)
    assert "does-not-exist" in msg
    assert str(secrets_dir / "does-not-exist.env") in msg
    assert secret_value not in msg
    assert backend.get_status()["sandboxes"] == 0


async def test_missing_secret_on_acquire_of_a_lazy_profile(make_backend, secrets_dir):
    backend = await make_backend(profiles={
        "default": profile("default"),
        "needs": profile("needs", secrets=["nope"]),
    }, default_profile="default")
    with pytest.raises(SecretNotFoundError) as exc:
        await backend.acquire("t", profile="needs")
    assert "nope" in str(exc.value) and "needs" in str(exc.value)
    # The other profile is unaffected.
    slot = await backend.acquire("t2")
    assert (await bash(backend, slot, "echo ok")).output == "ok\n"


async def test_secret_line_without_a_value(make_backend, secrets_dir, secret_value):
    (secrets_dir / "broken.env").write_text(f"GOOD={secret_value}\nNO_VALUE\n")
    backend = await make_backend(secrets=["broken"], start=False)
    with pytest.raises(SecretNotFoundError) as exc:
        await backend.start()
    msg = str(exc.value)
    assert "broken" in msg and "NO_VALUE" in msg
    assert secret_value not in msg
