"""Test helpers that notebooks and downstream projects can import too.

Nothing is imported here: each module is loaded only when used, so this package
costs nothing (and needs no optional dependency) until then.

:mod:`hermes_modal_tool.testing.openai_server` is a scripted stand-in for the
OpenAI API on 127.0.0.1, for exercising the OpenAI adapter without a network
(stdlib only).

:mod:`hermes_modal_tool.testing.modal_server` is a local Modal control plane:
the real ``modal`` SDK talks gRPC to it (``MODAL_SERVER_URL=http://127.0.0.1:PORT``)
and its sandboxes are bubblewrap containers on this machine, with fault injection
and RPC counters for tests and benchmarks. It needs the ``modal`` extra (``modal``,
``grpclib``); ``python -m hermes_modal_tool.testing.modal_server`` serves one until
Ctrl-C.

:mod:`hermes_modal_tool.testing.fakenet` is a fake internet for network tests: a
network namespace with documentation addresses serving HTTP, HTTPS (a test CA), TCP
echo, DNS and a package index, reached through veth pairs and routed nowhere else
(root, ``ip``/``unshare``/``nsenter``; ``dnslib`` and ``cryptography``).
"""
