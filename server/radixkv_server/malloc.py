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

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the most glibc's adaptive threshold reaches on 64-bit


def keep_freed_heap(nbytes: int) -> bool:
    """Let malloc keep up to `nbytes` of freed memory at the top of each heap instead of
    returning it to the kernel (mallopt M_TRIM_THRESHOLD). Setting it stops glibc adapting
    its thresholds, so the mmap threshold is set too, to the most adapting would reach
    (32 MiB): left at its 128 KiB start, every larger buffer (gRPC messages, numpy
    scratch) would be mapped and faulted in afresh each time. 0 changes nothing. True
    when applied, False where the C library is not glibc or refused; ValueError for a
    negative or oversized `nbytes`."""
    if not 0 <= nbytes < 1 << 31:
        raise ValueError(f"malloc trim threshold must be 0..2GiB, got {nbytes}")
    if nbytes == 0:
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return (mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(M_TRIM_THRESHOLD, nbytes) == 1)
