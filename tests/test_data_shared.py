"""Data in, data out, and what it cost, on both drivers (Modal: the local control plane):
a file uploaded into a slot and downloaded back is the same bytes, each move is an
``upload``/``download`` span, and the release's usage counts the trajectory's calls."""

from __future__ import annotations

import hashlib
import os

from support import bash
from test_tracing import spans  # noqa: F401  (the in-memory span exporter fixture)


async def test_transfer_spans_and_usage_on_each_driver(driver_backend, spans, tmp_path):  # noqa: F811
    data = os.urandom(1_500_000)  # several chunks
    (tmp_path / "in.bin").write_bytes(data)
    backend = await driver_backend(slots_per_sandbox=2)
    slot = await backend.acquire("traj-data")
    up = await backend.upload(slot, str(tmp_path / "in.bin"), "in.bin")
    r = await bash(backend, slot, "sha256sum in.bin | cut -c1-64; cp in.bin out.bin")
    assert r.output.strip() == hashlib.sha256(data).hexdigest() == up.sha256, r  # the slot's verdict
    down = await backend.download(slot, "out.bin", str(tmp_path / "out.bin"))
    assert (tmp_path / "out.bin").read_bytes() == data and down.bytes == len(data)
    used = await backend.release(slot)
    assert used.calls.get("bash") == 1 and used.wall_s > 0, used
    names = {s.name: s for s in spans.get_finished_spans()}
    upload, download = names["hermes_modal_tool.upload"], names["hermes_modal_tool.download"]
    assert upload.attributes["hmt.bytes"] == len(data) and upload.attributes["hmt.slot_id"] == slot.slot_id
    assert download.attributes["hmt.sha256"] == up.sha256
