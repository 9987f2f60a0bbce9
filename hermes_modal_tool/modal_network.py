"""A profile's ``network`` on the Modal driver: what Modal is asked to enforce, and where.

Modal enforces a sandbox's outbound network itself, per sandbox (all its slots alike),
outside the container (``modal.Sandbox.create``, SDK 1.6):

- ``network: none`` -> ``block_network=True`` (the container has no network);
- ``network: egress`` -> ``outbound_cidr_allowlist`` (the ``allow`` CIDRs) and
  ``outbound_domain_allowlist`` (the ``allow`` names, with ``*.`` wildcards, which
  Modal's list takes as they are); the SDK sends them as ``NetworkAccess`` of type
  ``ALLOWLIST`` (``allowed_cidrs``, ``allowed_domains``), whatever is not listed is
  refused. ``egress`` without an ``allow`` list (any public destination) becomes the
  IPv4 complement of the default-denied ranges (:data:`.agent.net.policy.DEFAULT_DENY`)
  as a CIDR allow-list, with no domain list;
- ``network: host`` -> neither (Modal's default: open).

What has no Modal equivalent is refused when the profile loads (:func:`check`):
``deny`` (Modal has allow-lists only), ``dns`` (Modal's resolver answers),
``upstream: none`` and ``proxy``. Inside the container the slots share the container's network
(the agent is started with ``network: host``): a namespace per slot behind the agent's
router needs ``/dev/net/tun`` for ``slirp4netns`` and nftables, which neither Modal's
container runtime (gVisor) promises nor the local control plane's containers have.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from .agent.net.policy import DEFAULT_DENY

#: Where each mode is enforced on the Modal driver (``get_status()`` and the driver's
#: ``describe()`` say it per profile).
ENFORCED_BY = {
    "none": "Modal: block_network=True, per sandbox (no network in the container); with "
            "isolation bwrap also a loopback-only namespace per slot",
    "egress": "Modal: outbound_cidr_allowlist / outbound_domain_allowlist, per sandbox, outside "
              "the container (all slots of a sandbox share the policy; no per-slot namespace, "
              "no deny list, Modal's resolver, no refusal counts)",
    "host": "nothing: the container's network (Modal's default, open)",
}


def _is_cidr(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
    return True


def open_allowlist() -> list[str]:
    """Every public IPv4 destination as CIDRs: 0.0.0.0/0 less the IPv4 ranges of
    :data:`DEFAULT_DENY` (what ``egress`` without ``allow`` means locally, less the host's
    own addresses, which are not Modal's)."""
    nets = [ipaddress.IPv4Network("0.0.0.0/0")]
    for deny in (n for n in DEFAULT_DENY if n.version == 4):
        out: list[ipaddress.IPv4Network] = []
        for net in nets:
            if net.overlaps(deny):
                if deny.supernet_of(net):  # type: ignore[arg-type]
                    continue
                out.extend(net.address_exclude(deny))  # type: ignore[arg-type]
            else:
                out.append(net)
        nets = out
    return [str(n) for n in sorted(nets)]


def check(egress: Any, profile: str) -> None:
    """Refuse ``egress`` options (a ``config.EgressOptions``; not imported: config imports
    this module) that Modal cannot enforce (profile ``profile``).

    Raises:
        ValueError: naming the profile, the key and why (``deny``, ``dns``, ``upstream``).
    """
    why = {"deny": (bool(egress.deny), "Modal has allow-lists only (outbound_cidr_allowlist, "
                    "outbound_domain_allowlist); list what is allowed instead"),
           "dns": (egress.dns is not None, "Modal's own resolver answers in its containers"),
           "upstream": (egress.upstream != "slirp4netns", "Modal's network is the upstream"),
           "proxy": (egress.proxy, "the forward proxy runs in the agent's router namespace, "
                     "which Modal containers do not get")}
    for key, (bad, reason) in why.items():
        if bad:
            raise ValueError(f"profile {profile!r}: egress.{key} has no equivalent on the modal "
                             f"driver ({reason})")


def create_kwargs(config: Any) -> dict[str, Any]:
    """The network arguments of ``modal.Sandbox.create`` for profile ``config`` (a
    ``SandboxConfig``):
    ``{"block_network": True}``, ``{"outbound_cidr_allowlist": [...],
    "outbound_domain_allowlist": [...] or None}`` or ``{}`` (open)."""
    if config.network == "none":
        return {"block_network": True}
    if config.network != "egress":
        return {}
    cidrs = [e for e in config.egress.allow if _is_cidr(e)]
    names = [e for e in config.egress.allow if not _is_cidr(e)]
    if not config.egress.allow:
        cidrs = open_allowlist()
    return {"outbound_cidr_allowlist": cidrs, "outbound_domain_allowlist": names or None}


def describe(config: Any) -> dict[str, Any]:
    """What ``get_status()`` shows of profile ``config``'s network on Modal: the mode,
    what Modal was asked (``create_kwargs``) and ``enforced_by``."""
    return {"mode": config.network, "modal": create_kwargs(config),
            "enforced_by": ENFORCED_BY[config.network]}
