"""A slot's saved state: snapshots, forks, and snapshots as tar streams.

Owns: freezing a slot's writable layer and forking from it (``snapshots``); exporting
and importing a frozen layer chain (``transfer``); the router of their messages, on
top of both (``ops``).

May import: :mod:`..limits`, :mod:`..fs` and the standard library. Stdlib-only,
Python 3.8.
"""
