"""Drivers: how a sandbox is started and how its agent's stdio is reached."""

from __future__ import annotations

from ..errors import ConfigError, install_hint
from .base import Driver, SandboxHandle

__all__ = ["Driver", "SandboxHandle", "make_driver"]


def make_driver(name: str, **options) -> Driver:
    """Return a new driver by name: ``"local"``, ``"modal"`` (needs the ``modal`` extra) or
    ``"ray"`` (needs the ``ray`` extra).

    ``options`` are the driver's keyword arguments (see ``LocalDriver``, ``ModalDriver`` and
    ``RayDriver``).

    Raises:
        ConfigError: the name is unknown, its extra is not installed, or an option is bad.
    """
    if name == "local":
        from .local import LocalDriver as cls
    elif name == "modal":
        try:
            from .modal import ModalDriver as cls
        except ImportError as exc:
            raise ConfigError(f"driver 'modal' needs the Modal SDK ({exc}); "
                              f"{install_hint('modal')}, or use driver='local'") from None
    elif name == "ray":
        try:
            from .ray import RayDriver as cls
        except ImportError as exc:
            raise ConfigError(f"driver 'ray' needs Ray ({exc}); {install_hint('ray')}, "
                              f"or use driver='local'") from None
    else:
        raise ConfigError(f"unknown driver {name!r}; known drivers: local, modal, ray")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"driver {name!r}: bad driver_options {sorted(options)}: {exc}") from None
