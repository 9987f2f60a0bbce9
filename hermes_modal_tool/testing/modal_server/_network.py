"""A sandbox's outbound allow-list (``NetworkAccess`` of type ``ALLOWLIST``), enforced
the way Modal does: outside the container, for all its processes.

The SDK sends ``outbound_cidr_allowlist`` / ``outbound_domain_allowlist`` (and the
deprecated ``cidr_allowlist``) as ``SandboxCreate(V2)``'s ``definition.network_access``:
``network_access_type`` ``ALLOWLIST`` with ``allowed_cidrs`` and ``allowed_domains``;
``BLOCKED`` (or ``block_network``) is a container with loopback only (bwrap
``--unshare-net``, as before). For an allow-list the server gives the sandbox what the
agent gives an ``egress`` slot (:class:`hermes_modal_tool.agent.net.slotnet.SandboxNet`):
a *router* namespace owned by the server, one namespace for the container behind a veth
pair, the allow-list as an nftables table in the router (the container's root, a test
double with full capabilities in its own namespace, has no rule to flush there) and a
resolver that answers only the allowed domains; every exec's bwrap starts in the
container's namespace (``nsenter --net``). Whatever is not allowed is refused at once
(TCP reset); names not allowed answer NXDOMAIN. Unlike Modal the double also refuses
the host's own addresses, loopback, link-local and private ranges unless a CIDR allows
them (the agent's defaults; Modal's network has none of this machine's services).

The router reaches the network through ``slirp4netns`` by default (the host's sockets;
no rule in the host's namespace), or, when the server was given ``network_attach``,
through what that callable attaches to the router (``network_attach(router_path)``;
tests: :meth:`hermes_modal_tool.testing.fakenet.FakeInternet.attach`). Domains are
resolved through ``network_dns`` (``"address[:port]"``), default the host's first
nameserver. Needs root, bwrap containers, ``ip``, ``nft`` and ``nsenter``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import TYPE_CHECKING, Any

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from hermes_modal_tool.agent.net.policy import EgressPolicy, PolicyError
from hermes_modal_tool.agent.net.slotnet import NetError, SandboxNet

if TYPE_CHECKING:
    from ._processes import _Sandbox

ALLOWLIST = api_pb2.NetworkAccess.NetworkAccessType.ALLOWLIST


def access_of(definition: Any, isolation: str) -> tuple[bool, list[str] | None]:
    """``(blocked, allow)`` of a sandbox definition: ``allow`` is the CIDRs and domains
    of an ``ALLOWLIST`` (None for open access).

    Raises:
        GRPCError: INVALID_ARGUMENT for a malformed entry, FAILED_PRECONDITION for an
            allow-list on a server without bwrap containers.
    """
    access = definition.network_access
    blocked = definition.block_network or access.network_access_type == (
        api_pb2.NetworkAccess.NetworkAccessType.BLOCKED)
    if blocked or access.network_access_type != ALLOWLIST:
        return blocked, None
    allow = list(access.allowed_cidrs) + list(access.allowed_domains)
    try:
        EgressPolicy(allow, where="network_access")
    except PolicyError as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    if isolation != "bwrap":
        raise GRPCError(Status.FAILED_PRECONDITION, "the local Modal server enforces an outbound "
                        "allow-list only with bwrap containers (root and bubblewrap)")
    return False, allow


class _Networks:
    """A part of :class:`LocalModalServer` (a mixin): the allow-listed sandboxes' namespaces."""

    network_attach: Any
    network_dns: str | None

    async def _open_network(self, sb: _Sandbox) -> None:
        """Give an allow-listed sandbox its router and namespace (before any process)."""
        attach = self.network_attach
        options = {"allow": sb.record.allowed, "dns": self.network_dns,
                   "upstream": "none" if attach else "slirp4netns"}

        def make() -> SandboxNet:
            net = SandboxNet(options, where=f"sandbox {sb.record.sandbox_id}").start()
            try:
                net.acquire(0)
                if attach is not None:
                    attach(net.router_path)
            except BaseException:
                net.close()
                raise
            return net

        sb.net = await asyncio.to_thread(make)

    def _netns_argv(self, sb: _Sandbox) -> list[str]:
        """``nsenter`` into the sandbox's namespace, before its bwrap ([] when open)."""
        net = getattr(sb, "net", None)
        if net is None:
            return []
        fd = net.slots[0].fd
        return [shutil.which("nsenter") or "nsenter", f"--net=/proc/{os.getpid()}/fd/{fd}", "--"]

    async def _close_network(self, sb: _Sandbox) -> None:
        net, sb.net = getattr(sb, "net", None), None
        if net is not None:
            await asyncio.to_thread(net.close)


__all__ = ["NetError", "access_of"]
