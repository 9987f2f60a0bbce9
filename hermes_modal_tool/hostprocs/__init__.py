"""Host processes: one ``ToolBackend`` spread over K processes (``host_processes=K``).

``router.py`` is the caller's side (the methods that reach sandboxes, routed by who holds
the slot or snapshot), ``_router_data.py`` its snapshots, transfers, previews and merged
status, ``host.py`` its handle on one process, ``worker.py`` the process itself and
``wire.py`` what they say to each other.
"""
