"""The status view: ``print(status_table(backend.get_status()))`` shows a table whose
headers say what each number counts."""

from __future__ import annotations

from rich.console import Console

from hermes_modal_tool.status import status_rows, status_table


async def test_print_shows_the_status_table_with_headers_that_explain_it(backend, capsys, monkeypatch):
    # The table fills the terminal's width (120 columns without one): give it 120, whatever
    # runs the suite (an 80-column terminal, an xdist worker) squeezes the headers otherwise.
    monkeypatch.setenv("COLUMNS", "120")
    slot = await backend.acquire("t1")
    await backend.execute_batch([(slot, "bash", {"command": "true"}), (slot, "bash", {"command": "false"})])
    status = backend.get_status()
    print(status_table(status))
    text = capsys.readouterr().out
    assert "<rich.table.Table object" not in text
    lines = text.splitlines()
    assert lines[0].startswith("pools") and lines[1].startswith("┏")
    header = "\n".join(lines[1:5])
    for words in ("sandboxes", "healthy/all", "slots", "used/all", "waiting", "acquires", "calls/s",
                  "(10 s)", "failures", "timeouts", "isolation"):
        assert words in header, (words, header)
    assert "last error" not in header  # shown only when a pool has one
    [row] = status_rows(status)
    body = next(line for line in lines if line.startswith("│ " + backend.default_profile))
    cells = [c.strip() for c in body.strip("│").split("│")]
    assert cells[:4] == [row["profile"], row["driver"], row["sandboxes"], row["slots in use"]]
    assert cells[6:8] == ["2", "1"]  # calls, failures
    assert "\x1b[" not in text  # plain text: no colour codes in print()


def test_a_rich_console_still_renders_it(capsys):
    status = {"default_profile": "p", "pools": {"p": {
        "driver": "local", "healthy_sandboxes": 1, "sandboxes": 2, "acquired_slots": 3,
        "total_slots": 8, "waiting_acquires": 0, "calls_per_second": 1.5, "calls": 30,
        "failures": 2, "timeouts": 1, "isolation": "bwrap", "limits": "rlimit",
        "last_error": "sandbox p-1 died: killed"}}}
    Console(width=160, color_system=None).print(status_table(status, title="t"))
    text = capsys.readouterr().out
    assert "1/2" in text and "3/8" in text and "last error" in text and "p-1 died" in text
