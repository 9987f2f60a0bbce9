"""The snapshot messages' router: snapshots and forks (:mod:`.snapshots`), and snapshots
as tar streams (:mod:`.transfer`).

Stdlib-only, Python 3.8. On top of both (``transfer`` uses ``snapshots``' store; neither
imports this module), so the two stay one-way.
"""

from . import snapshots, transfer

#: Messages handled here.
OPS = ("snapshot", "fork", "release_snapshot", "snapshots", "export_snapshot", "import_snapshot")


def dispatch(agent, msg):
    """Serve one of :data:`OPS` (answered with ``{"id", "ok", "result"|"error"}``)."""
    agent.own(_serve(agent, msg))


async def _serve(agent, msg):
    op = msg.get("op")
    mid = msg.get("id")
    try:
        if op == "snapshot":
            result = await snapshots.snapshot(agent, msg)
        elif op == "fork":
            result = await snapshots.fork(agent, msg)
        elif op == "release_snapshot":
            result = {"freed": snapshots.store(agent).release(snapshots.store(agent).get(msg.get("snapshot")))}
        elif op == "snapshots":
            st = snapshots.store(agent)
            result = {"snapshots": [f.describe() for f in st.frozen.values()],
                      "total_bytes": st.total_bytes()}
        else:
            result = await transfer.serve(agent, msg)
    except snapshots.SnapshotError as exc:
        agent.send({"id": mid, "ok": False, "error": str(exc)})
    except Exception as exc:  # noqa: BLE001 - reported, the agent goes on
        agent.send({"id": mid, "ok": False, "error": "%s failed: %s: %s" % (op, type(exc).__name__, exc)})
    else:
        agent.send({"id": mid, "ok": True, "result": result})
