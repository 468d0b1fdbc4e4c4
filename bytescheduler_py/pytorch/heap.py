"""Keep glibc from handing gradient memory back to the kernel after every iteration.

glibc's malloc adapts two thresholds as a program runs: blocks above the *mmap
threshold* get pages of their own, and free memory at the top of the heap above the
*trim threshold* is returned to the kernel. Both start small (128 KiB) and rise when a
large mmapped block is freed (to its size, and twice its size; at most 32 MiB and
64 MiB on 64-bit systems).

The cross-iteration overlap frees each iteration's gradients while the next forward
runs, so ~the whole gradient size becomes free at the top of the heap at once. When the
largest block freed so far was small (an 8 MiB layer), that exceeds the trim threshold:
glibc shrinks the heap, and the next backward faults every gradient page in afresh
(thousands of page faults per iteration for a model of a few tens of MiB, slower than DDP
on loopback). DDP escapes by accident: its first iteration's single large bucket is
freed once, which raises both thresholds for the rest of the process.

:func:`raise_malloc_thresholds` does the same on purpose: it allocates and frees one
block just below 32 MiB with libc's own ``malloc``, which sets the thresholds to their
ceiling. Nothing is touched (the block's pages are never written), the thresholds only
ever rise, and a user's own choice wins: glibc ignores this when ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_`` or ``mallopt`` fixed the thresholds, and under another
allocator (jemalloc, tcmalloc) it is a harmless malloc and free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems; a freed mmapped block raises the
# thresholds only when it is at most this large.
_CEILING = 32 * 1024**2
_done = False


def raise_malloc_thresholds() -> bool:
    """Raise glibc's mmap and trim thresholds to their ceiling, once per process.

    Returns True when the block was allocated and freed (glibc on Linux), False when
    there is nothing to do (another C library, or already done).
    """
    global _done
    if _done or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(_CEILING - 64 * 1024)  # below the ceiling once glibc adds its header
    if not block:
        return False
    libc.free(block)
    _done = True
    return True
