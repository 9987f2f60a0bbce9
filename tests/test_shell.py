"""One slot's shell and file tools, as an agent sees them through execute_batch."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import time

from support import bash, eventually

from hermes_modal_tool import ExecutionResult, SlotState


async def call(backend, slot, tool, **args) -> ExecutionResult:
    [result] = await backend.execute_batch([(slot, tool, args)])
    return result


# -- the persistent session -----------------------------------------------------------

async def test_fresh_slot_starts_in_its_workspace(backend, slot):
    assert slot.workspace_dir.startswith("/data/slot_")
    assert slot.state is SlotState.ACQUIRED and slot.trajectory_id == "traj-test"
    r = await bash(backend, slot, "pwd; ls -A | wc -l")
    assert r.success and r.error is None and r.returncode == 0
    assert r.output.split() == [slot.workspace_dir, "0"]


async def test_cd_export_and_functions_persist(backend, slot):
    r = await bash(backend, slot, "mkdir -p a/b && cd a/b && export GREETING=hello "
                                  "&& shout() { echo \"$1!\"; } && alias ll='echo aliased'")
    assert r.success, r.error
    r = await bash(backend, slot, "pwd; echo $GREETING; shout hey; ll")
    assert r.output.splitlines() == [f"{slot.workspace_dir}/a/b", "hello", "hey!", "aliased"]


async def test_env_argument_applies_to_one_call(backend, slot):
    r = await bash(backend, slot, 'echo "$ONLY_NOW $OTHER"', env={"ONLY_NOW": "yes", "OTHER": "a b'c"})
    assert r.output == "yes a b'c\n"
    r = await bash(backend, slot, 'echo "${ONLY_NOW-unset}"')
    assert r.output == "unset\n"


async def test_env_argument_with_a_bad_name_fails_cleanly(backend, slot):
    r = await bash(backend, slot, "echo hi", env={"NOT A NAME": "x"})
    assert not r.success and "env" in r.error
    assert (await bash(backend, slot, "echo still-here")).output == "still-here\n"


async def test_stdin_argument(backend, slot):
    r = await bash(backend, slot, "tr a-z A-Z", stdin="hello\nworld\n")
    assert r.output == "HELLO\nWORLD\n"
    # Without stdin a reading command gets EOF at once (it does not hang).
    r = await bash(backend, slot, "cat; echo done", timeout=5)
    assert r.output == "done\n" and not r.metadata["timed_out"]


async def test_large_stdin(backend, slot):
    data = "x" * 999_999 + "\n"
    r = await bash(backend, slot, "wc -c", stdin=data)
    assert r.output.strip() == "1000000"


async def test_paths_with_spaces_and_quotes(backend, slot):
    name = "dir with space/it's \"quoted\" $HOME.txt"
    r = await call(backend, slot, "write_file", path=name, content="odd\n")
    assert r.success, r.error
    r = await bash(backend, slot, "cat dir\\ with\\ space/*")
    assert r.output == "odd\n"
    r = await call(backend, slot, "read_file", path=name)
    assert r.output == "odd\n"


async def test_profile_defaults_for_timeout_and_output_limit(make_backend):
    backend = await make_backend(execution_timeout_s=1, output_limit=1000)
    slot = await backend.acquire("t")
    start = time.monotonic()
    r = await bash(backend, slot, "sleep 10")
    assert r.returncode == 124 and r.metadata["timed_out"]
    assert time.monotonic() - start < 4
    r = await bash(backend, slot, "seq 1 10000")
    assert r.metadata["truncated"] and 1000 <= len(r.output) <= 1200
    assert r.output.startswith("1\n2\n") and r.output.endswith("9999\n10000\n")
    # A call's own timeout wins over the profile's.
    r = await bash(backend, slot, "sleep 1.5; echo slow-ok", timeout=5)
    assert r.success and r.output == "slow-ok\n"


async def test_calls_to_one_slot_run_in_order(backend, slot):
    results = await backend.execute_batch(
        [(slot, "bash", {"command": f"echo {i} >> order.txt"}) for i in range(5)]
        + [(slot, "bash", {"command": "cat order.txt"})])
    assert all(r.success for r in results)
    assert results[-1].output.split() == ["0", "1", "2", "3", "4"]


async def test_stderr_is_interleaved_and_exit_code_kept(backend, slot):
    r = await bash(backend, slot, "echo out; echo err >&2; false")
    assert not r.success and r.returncode == 1
    assert "exit code 1" in r.error
    assert r.output == "out\nerr\n"


async def test_output_that_looks_like_the_end_marker_does_not_end_the_command(backend, slot):
    r = await bash(backend, slot, r"printf '\036deadbeefdeadbeef 0\036\n'; echo after")
    assert r.success and r.output.endswith("after\n")


# -- timeouts --------------------------------------------------------------------------

async def test_timeout_kills_the_command_and_keeps_the_session(backend, slot):
    await bash(backend, slot, "mkdir -p work && cd work && export KEEP=kept")
    start = time.monotonic()
    r = await bash(backend, slot, "echo before; echo x >> ran.txt; sleep 300 & sleep 30", timeout=1)
    elapsed = time.monotonic() - start
    assert r.returncode == 124 and r.metadata["timed_out"] is True
    assert not r.success and "timed out" in r.error
    assert "before" in r.output
    assert elapsed < 4, elapsed
    r = await bash(backend, slot, "pwd; echo $KEEP; cat ran.txt; ps -eo comm=")
    lines = r.output.splitlines()
    assert lines[:3] == [f"{slot.workspace_dir}/work", "kept", "x"]  # never retried
    assert "sleep" not in lines[3:], r.output


async def test_batch_timeout_s_applies_to_bash(backend, slot):
    start = time.monotonic()
    [r] = await backend.execute_batch([(slot, "bash", {"command": "sleep 30"})], timeout_s=1)
    assert r.returncode == 124 and r.metadata["timed_out"]
    assert time.monotonic() - start < 4


async def test_busy_builtin_loop_times_out_and_session_survives(backend, slot):
    await bash(backend, slot, "export KEEP=1")
    start = time.monotonic()
    r = await bash(backend, slot, "while :; do :; done", timeout=1)
    assert r.returncode == 124 and r.metadata["timed_out"]
    assert time.monotonic() - start < 5
    r = await bash(backend, slot, "echo alive $KEEP")
    assert r.success and r.output == "alive 1\n"


async def test_command_ignoring_sigterm_is_killed(backend, slot):
    start = time.monotonic()
    r = await bash(backend, slot, "trap '' TERM; echo started; sleep 30", timeout=1)
    assert r.returncode == 124 and "started" in r.output
    assert time.monotonic() - start < 5
    r = await bash(backend, slot, "ps -eo comm=")
    assert "sleep" not in r.output.split()


async def test_invalid_timeout_is_a_failed_result(backend, slot):
    for bad in (0, -1, "soon", True):
        r = await bash(backend, slot, "echo hi", timeout=bad)
        assert not r.success and "timeout" in r.error
    assert (await bash(backend, slot, "echo ok")).success


# -- output ----------------------------------------------------------------------------

async def test_output_cap_keeps_head_and_tail(backend, slot):
    r = await bash(backend, slot, "printf HEAD; head -c 200000 /dev/zero | tr '\\0' a; printf TAIL")
    assert r.success
    assert r.metadata["truncated"] is True
    assert 50_000 <= len(r.output) <= 50_500
    assert r.output.startswith("HEAD" + "a" * 100)
    assert r.output.endswith("a" * 100 + "TAIL")
    assert "truncated" in r.output


async def test_huge_output_does_not_break_the_session(backend, slot):
    r = await bash(backend, slot, "head -c 30000000 /dev/zero | tr '\\0' b; echo; echo END", timeout=20)
    assert r.success and r.metadata["truncated"] and r.output.endswith("END\n")
    assert len(r.output) < 51_000
    assert (await bash(backend, slot, "echo next")).output == "next\n"


async def test_invalid_utf8_and_binary_output_are_replaced(backend, slot):
    r = await bash(backend, slot, r"printf 'ok \xff\xfe end\n'")
    assert r.success and r.output == "ok \ufffd\ufffd end\n"
    r = await bash(backend, slot, "head -c 4000 /dev/urandom; echo; echo tail-ok")
    assert r.success and isinstance(r.output, str) and r.output.endswith("tail-ok\n")


async def test_unicode_round_trips(backend, slot):
    r = await bash(backend, slot, "echo 'héllo → 世界 🎉'")
    assert r.output == "héllo → 世界 🎉\n"


# -- the shell ending ------------------------------------------------------------------

async def test_exit_gives_a_fresh_shell_next_time(backend, slot):
    await bash(backend, slot, "export GONE=1; mkdir d; cd d")
    r = await bash(backend, slot, 'pwd; echo "${GONE-unset}"')
    assert r.output.splitlines() == [slot.workspace_dir + "/d", "1"]  # the state existed
    r = await bash(backend, slot, "exit 3")
    assert r.returncode == 3 and not r.success and r.error
    r = await bash(backend, slot, 'pwd; echo "${GONE-unset}"')
    assert r.success
    assert r.output.splitlines() == [slot.workspace_dir, "unset"]


async def test_shell_killing_itself_is_reported_and_recovered(backend, slot):
    r = await bash(backend, slot, "kill -9 $$")
    assert not r.success and r.returncode == 137 and "killed by signal 9" in r.error, r
    assert (await bash(backend, slot, "echo back")).output == "back\n"


async def test_shell_exit_above_128_is_an_exit_not_a_signal(backend, slot):
    """bwrap reports its child's death by signal N as 128+N, but only N up to 64 is a
    signal: a shell's own ``exit 200`` (or bash's 254 when it cannot fork) is an exit
    code (once reported as "killed by signal 72")."""
    r = await bash(backend, slot, "exit 200")
    assert not r.success and r.returncode == 200, r
    assert "exited" in r.error and "signal" not in r.error, r.error
    assert (await bash(backend, slot, "echo back")).output == "back\n"


# -- background jobs -------------------------------------------------------------------

async def test_background_returns_at_once_with_a_handle(backend, slot):
    start = time.monotonic()
    r = await bash(backend, slot, "echo bg-start; sleep 1.5; echo bg-end", background=True)
    assert time.monotonic() - start < 1.0
    assert r.success, r.error
    info = r.metadata["background"]
    assert isinstance(info["job"], int) and isinstance(info["pid"], int)
    assert info["log"].startswith(slot.workspace_dir + "/")

    async def log_text():
        return (await call(backend, slot, "read_file", path=info["log"])).output

    assert await eventually(log_text, lambda t: "bg-end" in t) == "bg-start\nbg-end\n"
    r = await bash(backend, slot, f"cat {info['log']}")
    assert r.output == "bg-start\nbg-end\n"


async def test_background_job_survives_a_timed_out_command(backend, slot):
    r = await bash(backend, slot, "sleep 60", background=True)
    assert r.success
    r = await bash(backend, slot, "sleep 30", timeout=1)
    assert r.returncode == 124
    r = await bash(backend, slot, "ps -eo args=")
    assert "sleep 60" in r.output  # the background job was not the timed-out command
    assert "sleep 30" not in r.output


async def test_background_pid_is_the_job(backend, slot):
    r = await bash(backend, slot, "exec sleep 60", background=True)
    pid = r.metadata["background"]["pid"]

    async def args_of_pid():
        return (await bash(backend, slot, f"ps -o args= -p {pid}")).output.strip()

    # The job's pid is the process that becomes the job (its launcher execs it; under load
    # `ps` can still catch the launcher first).
    assert await eventually(args_of_pid, lambda a: a == "sleep 60") == "sleep 60"


async def test_background_with_env(backend, slot):
    r = await bash(backend, slot, "echo $JOBVAR", background=True, env={"JOBVAR": "from-env"})
    log = r.metadata["background"]["log"]

    async def log_text():
        return (await call(backend, slot, "read_file", path=log)).output

    out = await eventually(log_text, lambda t: "from-env" in t)
    assert out == "from-env\n"


# -- tools -----------------------------------------------------------------------------

async def test_unknown_tool_is_a_failed_result_naming_it(backend, slot):
    r = await call(backend, slot, "frobnicate", x=1)
    assert not r.success
    assert "frobnicate" in r.error
    for known in ("bash", "read_file", "write_file"):
        assert known in r.error


async def test_bash_without_command(backend, slot):
    r = await call(backend, slot, "bash")
    assert not r.success and "command" in r.error


async def test_write_and_read_file(backend, slot):
    r = await call(backend, slot, "write_file", path="notes/a.txt", content="one\ntwo\nthree\n")
    assert r.success, r.error
    assert r.metadata["path"] == f"{slot.workspace_dir}/notes/a.txt"
    r = await call(backend, slot, "read_file", path="notes/a.txt")
    assert r.output == "one\ntwo\nthree\n"
    r = await call(backend, slot, "read_file", path=f"{slot.workspace_dir}/notes/a.txt",
                   offset=1, limit=1)
    assert r.output == "two\n"
    r = await call(backend, slot, "write_file", path="notes/a.txt", content="four\n", append=True)
    assert r.success
    r = await bash(backend, slot, "cat notes/a.txt; stat -c %u notes/a.txt; id -u")
    lines = r.output.splitlines()
    assert lines[:4] == ["one", "two", "three", "four"]
    assert lines[4] == lines[5]  # the slot owns what the file tool wrote


async def test_files_written_by_the_shell_are_readable(backend, slot):
    await bash(backend, slot, "cat > q.txt <<'EOF'\nquote ' and $dollar\nEOF")
    r = await call(backend, slot, "read_file", path="q.txt")
    assert r.output == "quote ' and $dollar\n"


async def test_write_file_content_is_not_interpreted(backend, slot):
    tricky = "$(touch pwned) `id` '\"\\ %s %n\n" * 3 + "x" * 300_000
    r = await call(backend, slot, "write_file", path="t.txt", content=tricky)
    assert r.success and r.metadata["bytes"] == len(tricky.encode())
    art = await backend.read_artifact(slot, "t.txt", max_bytes=1_000_000)
    assert art["content"] == tricky
    capped = await backend.read_artifact(slot, "t.txt")  # by default: the output cap, in bytes
    assert capped["truncated"] and capped["content"] == tricky[:50_000]
    assert (await call(backend, slot, "list_files")).output.splitlines() == ["t.txt"]


async def read_pages(backend, slot, path, **args):
    """Page through ``path`` the way a caller is told to: each next read from the
    ``next_offset`` (and ``next_byte_offset``) of the last; ``(text, results)``."""
    results = []
    while True:
        r = await call(backend, slot, "read_file", path=path, **args)
        assert r.success, r.error
        results.append(r)
        if not r.metadata["truncated"]:
            return "".join(x.output for x in results), results
        assert len(results) < 100, r.metadata
        args = dict(args, offset=r.metadata["next_offset"])
        args.pop("byte_offset", None)
        if r.metadata.get("next_byte_offset"):
            args["byte_offset"] = r.metadata["next_byte_offset"]


async def test_read_file_pages_say_where_to_go_on_and_return_the_whole_file(backend, slot):
    """A 200 kB file of short lines and one with a 120 kB line: every partial page says
    truncated, the size, the line count and where to go on; paging returns the file exactly,
    also with a line ``limit``; the model reads a note saying how to go on."""
    from hermes_modal_tool.adapters.openai import format_result

    lines = "".join(f"line {i} " + "x" * (i % 90) + "\n" for i in range(3700))
    long = "head\n" + "é€b" * 20_000 + "\ntail"  # 120 kB of one line, multibyte characters
    for name, text in (("lines.txt", lines), ("long.txt", long)):
        size = len(text.encode())
        assert (await call(backend, slot, "write_file", path=name, content=text)).success
        got, pages = await read_pages(backend, slot, name)
        assert got == text and len(pages) >= 3, (name, len(pages))
        for r in pages[:-1]:
            md = r.metadata
            assert md["truncated"] and md["size"] == size and md["total_lines"] == len(text.splitlines())
            assert md["next_offset"] is not None and len(r.output) <= 50_000
            assert f"offset={md['next_offset']}" in format_result("read_file", r)
        assert pages[-1].metadata["next_offset"] is None
        assert "the file goes on" not in format_result("read_file", pages[-1])
    assert any("next_byte_offset" in r.metadata for r in pages)  # the long line took several pages
    # A line limit shorter than the file is a partial result too.
    r = await call(backend, slot, "read_file", path="lines.txt", limit=10)
    assert r.output == "".join(lines.splitlines(True)[:10])
    assert r.metadata["truncated"] and r.metadata["next_offset"] == 10 and r.metadata["total_lines"] == 3700
    got, pages = await read_pages(backend, slot, "lines.txt", limit=1000)
    assert got == lines and len(pages) >= 4
    # A base64 read says where the next bytes start.
    await bash(backend, slot, "head -c 100000 /dev/urandom > big.bin")
    r = await call(backend, slot, "read_file", path="big.bin", encoding="base64")
    data = base64.b64decode(r.output, validate=True)
    assert len(data) == r.metadata["bytes"] and r.metadata["next_offset"] == len(data) < 100_000
    whole = await backend.read_artifact(slot, "big.bin", encoding="base64", max_bytes=200_000)
    _, pages = await read_pages(backend, slot, "big.bin", encoding="base64")
    assert len(pages) == 3 and data == base64.b64decode(pages[0].output)
    assert b"".join(base64.b64decode(x.output) for x in pages) == base64.b64decode(whole["content"])


async def test_base64_round_trip(backend, slot):
    blob = bytes(range(256)) * 4
    r = await call(backend, slot, "write_file", path="bin/blob", content=base64.b64encode(blob).decode(),
                   encoding="base64")
    assert r.success and r.metadata["bytes"] == len(blob)
    r = await call(backend, slot, "read_file", path="bin/blob", encoding="base64")
    assert base64.b64decode(r.output) == blob
    r = await call(backend, slot, "read_file", path="bin/blob", encoding="base64", offset=10, limit=5)
    assert base64.b64decode(r.output) == blob[10:15]
    r = await bash(backend, slot, "sha256sum bin/blob | cut -d' ' -f1")
    assert r.output.strip() == hashlib.sha256(blob).hexdigest()


async def test_file_tool_errors_are_failed_results(backend, slot):
    cases = [
        ("read_file", {"path": "missing.txt"}, "missing.txt"),
        ("read_file", {}, "path"),
        ("write_file", {"path": "x"}, "content"),
        ("write_file", {"path": "x", "content": "%%%", "encoding": "base64"}, "base64"),
        ("read_file", {"path": "x", "encoding": "rot13"}, "encoding"),
    ]
    results = await backend.execute_batch([(slot, tool, args) for tool, args, _ in cases])
    for (tool, _, word), r in zip(cases, results, strict=True):
        assert not r.success, tool
        assert word in r.error, (tool, r.error)


async def test_list_files(backend, slot):
    await bash(backend, slot, "mkdir -p src/pkg && touch src/pkg/m.py README.md && echo hi > src/a.txt")
    r = await call(backend, slot, "list_files")
    assert r.success and r.output.splitlines() == ["README.md", "src/"]
    r = await call(backend, slot, "list_files", path="src", recursive=True)
    assert r.output.splitlines() == ["a.txt", "pkg/", "pkg/m.py"]
    entries = {e["path"]: e for e in r.metadata["entries"]}
    assert entries["a.txt"]["type"] == "file" and entries["a.txt"]["size"] == 3


async def test_artifacts(backend, slot):
    await bash(backend, slot, "mkdir -p out/sub && echo result > out/r.txt && echo deep > out/sub/d.txt "
                              "&& ln -s r.txt out/link")
    art = await backend.read_artifact(slot, "out/r.txt", include_sha256=True)
    assert art["success"] and art["content"] == "result\n" and art["size"] == 7
    assert art["sha256"] == hashlib.sha256(b"result\n").hexdigest()
    art = await backend.read_artifact(slot, "out/r.txt", encoding="base64", max_bytes=3)
    assert base64.b64decode(art["content"]) == b"res" and art["truncated"] is True
    missing = await backend.read_artifact(slot, "nope.txt")
    assert not missing["success"] and "nope.txt" in missing["error"]

    listing = await backend.list_artifacts(slot, "out", recursive=True)
    assert listing["success"]
    assert sorted(listing["entries"]) == ["link", "r.txt", "sub/d.txt"]

    archive = await backend.archive_artifacts(slot, "out")
    assert archive["success"] and archive["format"] == "tar.gz"
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(archive["archive_base64"])),
                      mode="r:gz") as tf:
        members = {m.name: m for m in tf.getmembers()}
        assert set(members) == {"r.txt", "sub", "sub/d.txt", "link"}
        assert tf.extractfile("sub/d.txt").read() == b"deep\n"
        assert members["link"].issym() and members["link"].linkname == "r.txt"
