"""How the daemon's process asks glibc's malloc to treat freed memory.

A prefetch from Redis or Redis Cluster receives one reply object per page (64 KiB and
more each, some MiB per prompt); a fetch frees them all once copied into the host pool.
With glibc's defaults (trim threshold 128 KiB, adaptive) a worker thread's arena then
hands that memory back to the kernel, and the next fetch faults every 4 KiB of it in
again: measured here, ~2k minor faults and 30-40% of the daemon's CPU per 2k-token
prompt of 64 KiB pages. Keeping freed heap up to a bound lets the next batch reuse
warm memory. The cost is resident memory: up to that bound per malloc arena stays
mapped after a burst.
"""

import ctypes
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameter (malloc.h)


def keep_freed_heap(nbytes: int) -> bool:
    """Let malloc keep up to `nbytes` of freed memory at the top of each heap instead of
    returning it to the kernel (mallopt M_TRIM_THRESHOLD; also fixes the mmap threshold
    at its default). 0 changes nothing. True when applied, False where the C library is
    not glibc or refused; ValueError for a negative or oversized `nbytes`."""
    if not 0 <= nbytes < 1 << 31:
        raise ValueError(f"malloc trim threshold must be 0..2GiB, got {nbytes}")
    if nbytes == 0:
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return mallopt is not None and mallopt(M_TRIM_THRESHOLD, nbytes) == 1
