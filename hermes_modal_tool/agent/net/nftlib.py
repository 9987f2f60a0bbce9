"""nftables commands in-process, through ``libnftables`` (what the ``nft`` program runs).

Stdlib-only, Python 3.8 (``ctypes``). An ``nft`` process costs 10 to 25 ms; the library
call about a millisecond, which is what a slot's namespace set-up, its release and
every name its resolver lets through (one rule update each) pay. A context is made,
and every command run, with the calling thread inside the router's namespace
(:func:`.netns.entered`, which checks it first): the library's netlink socket is
opened there and acts on that namespace only. Where the library cannot be loaded,
:func:`open_nft` returns None and the caller runs the ``nft`` program instead.
"""

import ctypes
import ctypes.util
import socket
import threading

NFT_CTX_DEFAULT = 0
NFT_CTX_OUTPUT_JSON = 1 << 4
NETLINK_NETFILTER = 12

_LIB = []


def _lib():
    if not _LIB:
        lib = None
        for name in ("libnftables.so.1", ctypes.util.find_library("nftables")):
            if not name:
                continue
            try:
                lib = ctypes.CDLL(name, use_errno=True)
                break
            except OSError:
                continue
        if lib is not None:
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            for fn in (lib.nft_ctx_buffer_output, lib.nft_ctx_buffer_error):
                fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_int
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
            for fn in (lib.nft_ctx_get_output_buffer, lib.nft_ctx_get_error_buffer):
                fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_char_p
        _LIB.append(lib)
    return _LIB[0]


class Nft:
    """One ``libnftables`` context; made and used only inside the namespace it acts on.

    Thread-safe (one command at a time)."""

    def __init__(self, lib):
        self._lib = lib
        self._lock = threading.Lock()
        self._ctx = lib.nft_ctx_new(NFT_CTX_DEFAULT)
        if not self._ctx:
            raise OSError("nft_ctx_new failed")
        lib.nft_ctx_buffer_output(self._ctx)
        lib.nft_ctx_buffer_error(self._ctx)

    def run(self, text, json=False):
        """Run ``text`` (what ``nft -f -`` reads; with ``json``, output as ``nft -j``);
        returns the output.

        Raises:
            RuntimeError: nftables refused it (its error text).
        """
        with self._lock:
            if self._ctx is None:
                raise RuntimeError("the nftables context is closed")
            self._lib.nft_ctx_output_set_flags(self._ctx, NFT_CTX_OUTPUT_JSON if json else 0)
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, text.encode())
            out = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode("utf-8", "replace")
            err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode("utf-8", "replace")
            if rc != 0:
                raise RuntimeError(err.strip()[-500:] or "nft failed (%d)" % rc)
            return out

    def close(self):
        with self._lock:
            if self._ctx is not None:
                self._lib.nft_ctx_free(self._ctx)
                self._ctx = None


def kernel_check():
    """Raise ``OSError`` (naming the cause) where the kernel has no nftables netlink
    (``nfnetlink`` not loaded and not loadable: a minimal VM kernel without its modules).

    Called before :func:`open_nft`: ``libnftables`` 1.0 calls ``exit(3)`` from
    ``nft_ctx_new`` when it cannot open that socket, which would end the whole agent.
    """
    try:
        probe = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
    except OSError as exc:
        raise OSError(exc.errno, "the kernel has no nftables netlink (NETLINK_NETFILTER: %s; "
                                 "the nf_tables module is not loaded)" % exc.strerror) from None
    probe.close()


def open_nft():
    """A :class:`Nft` context in the calling thread's namespace, or None where
    ``libnftables`` is not installed. Call :func:`kernel_check` first."""
    lib = _lib()
    return Nft(lib) if lib is not None else None
