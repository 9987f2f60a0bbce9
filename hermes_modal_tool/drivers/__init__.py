"""Drivers: how a sandbox is started and how its agent's stdio is reached."""

from __future__ import annotations

from ..errors import ConfigError
from .base import Driver, SandboxHandle

__all__ = ["Driver", "SandboxHandle", "make_driver"]


def make_driver(name: str, **options) -> Driver:
    """Return a new driver by name (``"local"``; ``"modal"`` once its extra is installed).

    Raises:
        ConfigError: the name is unknown or its extra is not installed.
    """
    if name == "local":
        from .local import LocalDriver

        return LocalDriver(**options)
    if name == "modal":
        from importlib.util import find_spec

        if find_spec(f"{__name__}.modal") is None:
            raise ConfigError(
                "driver 'modal' is not part of this version of hermes-modal-tool yet; "
                "use driver='local' (e.g. ModalSandboxConfig(..., driver='local'))")
        try:
            from .modal import ModalDriver  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ConfigError(f"driver 'modal' needs the Modal SDK ({exc}); "
                              "install 'hermes-modal-tool[modal]' or use driver='local'") from None
        return ModalDriver(**options)
    raise ConfigError(f"unknown driver {name!r}; known drivers: local, modal")
