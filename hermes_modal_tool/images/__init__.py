"""OCI images for the local driver: read, pull, unpack and cache them.

The local driver makes a profile's ``image`` the read-only lower layer of every slot's
root (see :mod:`hermes_modal_tool.agent.fs.rootfs`). :class:`ImageCache` turns an ``image``
string into an unpacked root filesystem, cached by digest for the whole machine.
"""

from .cache import ImageCache, UnpackedImage, default_cache_dir
from .limits import ImageLimits
from .pull import docker_ref
from .sources import LOCAL_PREFIXES, is_local_source, parse_source

__all__ = ["LOCAL_PREFIXES", "ImageCache", "ImageLimits", "UnpackedImage", "default_cache_dir",
           "docker_ref", "is_local_source", "parse_source"]
