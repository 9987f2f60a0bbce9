"""Limits and isolation: what each slot may use, and how it is kept apart.

Owns: the bubblewrap namespaces, uids and rlimits a slot is started with
(``isolation``); kernel scopes beyond namespaces (``scopes``); cgroups v1/v2
(``cgroups``, ``cgroupv2``); admission of commands (``admission``); waiting for a quiet
CPU (``quiet``); System V IPC cleanup (``sysvipc``); the watched limits (``diskwatch``,
``shmwatch``); a tenant's usage (``usage``); the caps shown in status (``caps``); GPU
devices given to slots (``gpu``).

May import: :mod:`..fs` and the standard library. Stdlib-only, Python 3.8.
"""
