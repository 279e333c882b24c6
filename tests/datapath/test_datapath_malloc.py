"""The daemon's malloc setting: a storage worker thread that receives a batch of
page-sized replies, frees them and receives the next reuses warm memory instead of
faulting every 4 KiB page in again (what a prefetch from Redis does per prompt)."""

import subprocess
import sys

import pytest

from radixkv_server.config import load_config
from radixkv_server.malloc import keep_freed_heap

# In a fresh interpreter: on a worker thread (its own malloc arena, like the daemon's
# storage threads), receive 128 replies of 64 KiB, drop them, and count the minor page
# faults of the next rounds.
_BATCHES = r"""
import resource, sys, threading
from radixkv_server.malloc import keep_freed_heap
applied = keep_freed_heap(int(sys.argv[1]))
faults = []
page = bytearray(int(sys.argv[2]))
count = int(sys.argv[3])
def batches():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        replies = [bytes(memoryview(page)) for _ in range(count)]
        del replies
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=batches)
t.start(); t.join()
print(applied, min(faults[2:]))
"""


def _faults_per_batch(threshold: int, size: int = 64 << 10, count: int = 128) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _BATCHES, str(threshold), str(size), str(count)], check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_replies_are_reused_instead_of_faulted_in_again():
    applied, tuned = _faults_per_batch(256 << 20)
    assert applied
    untouched, default = _faults_per_batch(0)
    assert untouched  # 0 leaves glibc's default, which is no failure
    # glibc's default hands freed replies back (here ~290 faults a batch, ~2k in the daemon)
    assert default >= 128, "glibc's default no longer returns freed replies; this setting may be moot"
    assert tuned < default // 10


def test_large_buffers_are_reused_too():
    """Fixing the trim threshold stops glibc adapting its mmap threshold; left at 128 KiB,
    every larger buffer (a gRPC message, numpy scratch) would be mapped afresh and faulted
    in each time: ~256 faults per MiB."""
    applied, tuned = _faults_per_batch(256 << 20, size=1 << 20, count=4)
    assert applied and tuned < 100


def test_the_threshold_is_a_flag_with_a_default_and_a_bound():
    assert load_config([]).malloc_trim_threshold == 256 << 20
    assert load_config(["--malloc-trim-threshold", "0"]).malloc_trim_threshold == 0
    with pytest.raises(ValueError, match="--malloc-trim-threshold"):
        load_config(["--malloc-trim-threshold", "4GiB"])
    with pytest.raises(ValueError, match="0..2GiB"):
        keep_freed_heap(-1)
