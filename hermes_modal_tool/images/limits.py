"""Bounds on what one image may take on the host, checked while it is unpacked.

An image is untrusted: a 20 KiB archive of sparse members can ask for gigabytes, a
manifest for thousands of layers, a layer for millions of entries. Each bound is a field
of :class:`ImageLimits` (``ImageCache(limits=...)``), else its environment variable, else
its default:

=================  ===========================================  ==================
field              environment variable                         default
=================  ===========================================  ==================
``max_bytes``      ``HERMES_MODAL_TOOL_IMAGE_MAX_BYTES``        16 GiB
``max_layers``     ``HERMES_MODAL_TOOL_IMAGE_MAX_LAYERS``       256
``max_files``      ``HERMES_MODAL_TOOL_IMAGE_MAX_FILES``        2,000,000
=================  ===========================================  ==================

``max_bytes`` counts the apparent size of every regular file (a sparse member by the
size it claims, as it would be written), over all layers, before the file is written;
``max_files`` counts entries of all layers (whiteouts included). Sizes take a suffix:
``K``, ``M``, ``G``, ``T`` (powers of 1024).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ImageError

ENV_MAX_BYTES = "HERMES_MODAL_TOOL_IMAGE_MAX_BYTES"
ENV_MAX_LAYERS = "HERMES_MODAL_TOOL_IMAGE_MAX_LAYERS"
ENV_MAX_FILES = "HERMES_MODAL_TOOL_IMAGE_MAX_FILES"
DEFAULT_MAX_BYTES = 16 << 30
DEFAULT_MAX_LAYERS = 256
DEFAULT_MAX_FILES = 2_000_000
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _number(text: str, where: str, sizes: bool) -> int:
    raw = text.strip().upper().removesuffix("IB").removesuffix("B") if sizes else text.strip()
    unit = raw[-1:] if sizes and raw[-1:] in _SUFFIX else ""
    try:
        value = int(raw[:len(raw) - len(unit)].replace("_", "")) * _SUFFIX[unit]
    except ValueError:
        value = -1
    if value < 1:
        what = "a size in bytes (a positive integer, or with K, M, G, T)" if sizes \
            else "a positive integer"
        raise ImageError(f"{where}={text!r} is not {what}")
    return value


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on one image (see the module doc): ``max_bytes`` (apparent bytes of its
    files), ``max_layers``, ``max_files`` (entries over all layers)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_layers: int = DEFAULT_MAX_LAYERS
    max_files: int = DEFAULT_MAX_FILES

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ImageLimits:
        """The limits the environment sets (defaults for the variables not set).

        Raises:
            ImageError: a variable that is not a positive number (named in the message).
        """
        env = os.environ if env is None else env
        values = {}
        for field, var, sizes in (("max_bytes", ENV_MAX_BYTES, True),
                                  ("max_layers", ENV_MAX_LAYERS, False),
                                  ("max_files", ENV_MAX_FILES, False)):
            if env.get(var, "").strip():
                values[field] = _number(env[var], var, sizes)
        return cls(**values)


class Budget:
    """What one image's unpack has used of its :class:`ImageLimits` (all layers)."""

    def __init__(self, image: str, limits: ImageLimits) -> None:
        self.image = image
        self.limits = limits
        self.bytes = 0
        self.files = 0

    def layers(self, n: int) -> None:
        """Raises ImageError when the image has more than ``max_layers`` layers."""
        if n > self.limits.max_layers:
            raise ImageError(f"image {self.image!r} has {n} layers, over the limit of "
                             f"{self.limits.max_layers} (ImageLimits.max_layers, "
                             f"{ENV_MAX_LAYERS})")

    def entry(self, size: int) -> None:
        """Charge one entry of ``size`` apparent bytes, before it is written.

        Raises:
            ImageError: the image would pass ``max_files`` or ``max_bytes`` (the message
                names the limit; the caller adds the image and layer).
        """
        self.files += 1
        if self.files > self.limits.max_files:
            raise ImageError(f"over its entry limit: more than {self.limits.max_files} entries "
                             f"(ImageLimits.max_files, {ENV_MAX_FILES})")
        self.bytes += max(0, size)
        if self.bytes > self.limits.max_bytes:
            raise ImageError(f"over its unpacked-size limit: more than {self.limits.max_bytes} "
                             f"bytes ({_human(self.limits.max_bytes)}) of files "
                             f"(ImageLimits.max_bytes, {ENV_MAX_BYTES}); sparse files count by "
                             "their apparent size")


def _human(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
