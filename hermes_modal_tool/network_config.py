"""A profile's ``network`` and ``egress`` settings (part of :mod:`hermes_modal_tool.config`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

#: ``network`` values (bools and their spellings in variables) kept as aliases.
NETWORK_ALIASES = {True: "egress", False: "none", "true": "egress", "false": "none", "1": "egress",
                   "0": "none", "yes": "egress", "no": "none", "on": "egress", "off": "none"}
_TRUE_NOTED = []  # the one-time note on ``network: true`` (once per process)


def network_mode(value: Any) -> Any:
    """The ``network`` mode ``value`` names: ``"none"``, ``"egress"`` or ``"host"``; the
    aliases of :data:`NETWORK_ALIASES` (``true`` = ``"egress"``, ``false`` = ``"none"``)
    are mapped; the first ``true`` of the process issues one :class:`ConfigWarning`
    saying that it no longer means the host's network. Raises ValueError naming a bad
    value (the profile and key are added by :class:`ConfigError`)."""
    if isinstance(value, str) and value.strip().lower() in ("none", "egress", "host"):
        return value.strip().lower()
    key = value.strip().lower() if isinstance(value, str) else value
    if isinstance(key, (bool, str)) and key in NETWORK_ALIASES:
        mode = NETWORK_ALIASES[key]
        if mode == "egress" and not _TRUE_NOTED:
            import warnings

            from .errors import ConfigWarning

            _TRUE_NOTED.append(True)
            warnings.warn(f"network: {value!r} means 'egress' (a network namespace of the slot's "
                          "own, no reach into the host; see the README's Network section); it "
                          "was the host's network before: write network: host for that",
                          ConfigWarning, stacklevel=2)
        return mode
    raise ValueError("network must be 'none', 'egress' or 'host' (or true/false)")


class EgressOptions(BaseModel):
    """A profile's ``egress`` options (used with ``network: egress``).

    ``allow``/``deny``: CIDRs (``"198.51.100.0/24"``) and domain names, ``*.``-wildcards
    allowed (``"*.example.com"``); deny wins. Without ``allow`` every public destination
    is allowed; the defaults (loopback, the host's own addresses, link-local with the
    metadata endpoint, RFC 1918, CGNAT, ULA) are refused unless a CIDR in ``allow``
    covers them. ``dns``: the resolver allowed names are asked of, ``"address"`` or
    ``"address:port"`` (IPv4); default: the first nameserver of the host's
    ``/etc/resolv.conf``. ``upstream``: how the sandbox's router namespace reaches the
    network: ``"slirp4netns"`` (user-mode, through the host's sockets; the host's loopback
    not mapped) or ``"none"`` (attached by the caller; tests). ``proxy``: ``true`` sends
    the slots' HTTP(S) through the agent's forward proxy (``HTTP_PROXY``/``HTTPS_PROXY``
    set; the proxy applies ``allow``/``deny``) and refuses every direct connection
    (:mod:`hermes_modal_tool.agent.net.proxy`). Checked by :class:`hermes_modal_tool.agent.net.policy.EgressPolicy`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    dns: str | None = None
    upstream: Literal["slirp4netns", "none"] = "slirp4netns"
    proxy: StrictBool = False

    @model_validator(mode="after")
    def _lists(self) -> EgressOptions:
        from .agent.net.policy import EgressPolicy, PolicyError

        try:
            EgressPolicy(self.allow, self.deny, where="egress")
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        if self.dns is not None:
            import ipaddress

            host, _, port = self.dns.partition(":")
            try:
                ipaddress.IPv4Address(host)
                if port and not 0 < int(port) < 65536:
                    raise ValueError
            except ValueError:
                raise ValueError(f"egress.dns must be 'IPv4 address[:port]', got {self.dns!r:.80}") from None
        return self
