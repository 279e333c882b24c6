"""Whose memory an engine's shared-memory KV segment is.

The daemon mapped every segment with MAP_POPULATE, which allocates a tmpfs segment's
holes: an engine's segment it had not written yet (the client made them sparse) was
committed by the daemon at Register, counted in the daemon's RSS and charged to the
daemon's cgroup, so a sidecar sized for its host pool could be killed by an engine's
KV. The client now commits its segment itself (and says when /dev/shm has no room for
it); the daemon populates only a segment that is committed whole.
"""

import errno
import os
import secrets

import pytest

from radixkv import KvLayout
from radixkv.kvbuffers import SHM_DIR, ShmKvBuffers
from radixkv_server.datapath import open_device_buffers

LAY = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
PAGES = 256  # 8 MiB in all


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_the_client_commits_its_segment_and_the_daemon_maps_the_same_memory():
    engine = ShmKvBuffers.create(LAY, PAGES)
    try:
        path = os.path.join(SHM_DIR, engine.name)
        assert allocated(path) >= engine.nbytes  # the engine's, from its creation
        dev = open_device_buffers("shm", LAY, PAGES, engine.specs())
        try:
            engine.page_view(0)[PAGES - 1].fill_(5)
            assert dev._maps[engine.name][(PAGES - 1) * LAY.chunk_bytes] == 5  # one memory, both mappings
        finally:
            dev.close()
    finally:
        engine.close()


def test_a_sparse_segment_is_not_committed_by_the_daemons_mapping():
    """An engine (any language) that registers a segment it has not written: the
    daemon's Register leaves it sparse; pages it copies into are allocated then."""
    name = f"radixkv_test_{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    size = LAY.num_buffers * LAY.buffer_bytes(PAGES)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        engine = ShmKvBuffers.attach(LAY, PAGES, name)
        dev = open_device_buffers("shm", LAY, PAGES, engine.specs())
        try:
            assert allocated(path) == 0  # was the whole segment, committed by the daemon
            engine.page_view(0)[3].fill_(9)  # the engine writes one page
            assert dev._maps[name][3 * LAY.chunk_bytes] == 9
            assert 0 < allocated(path) < size
        finally:
            dev.close()
            engine.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_segment_past_the_room_in_dev_shm_is_refused_saying_so():
    """Instead of a SIGBUS at the engine's first write past the room there is."""
    fs = os.statvfs(SHM_DIR)
    pages = (fs.f_blocks * fs.f_frsize) // (LAY.num_buffers * LAY.buffer_bytes(1)) + PAGES
    name = f"radixkv_test_{secrets.token_hex(4)}"
    with pytest.raises(OSError) as e:
        ShmKvBuffers.create(LAY, pages, name=name)
    assert e.value.errno == errno.ENOSPC and "--shm-size" in str(e.value), e.value
    assert not os.path.exists(os.path.join(SHM_DIR, name))  # nothing left behind
