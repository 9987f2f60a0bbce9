"""A slot's network policy, enforced from outside the slot (issue 37).

Stdlib-only, Python 3.8, like the rest of the agent. Not yet in the agent's bundle
(``_MODULES``) nor wired into the spawner:

- :mod:`.policy`: :class:`.policy.EgressPolicy`, allow/deny CIDRs and domain names,
  the default-denied ranges, resolved addresses, refusal counts;
- :mod:`.resolver`: :class:`.resolver.DnsResolver`, the only DNS a slot sees;
- :mod:`.nftrules`: a slot's policy as one nftables table in the agent's namespace
  (the enforcement point: outside the slot's user namespace);
- :mod:`.proxy`: :class:`.proxy.ForwardProxy`, the sandbox's forward proxy for
  ``egress.proxy: true`` (HTTP(S) only through it, under each slot's policy);
- :mod:`.dnswire`: the DNS wire format, bounded parsing;
- :mod:`.hostaddrs`: the host's own addresses, refused by default.
"""
