"""What the daemon refuses to map, and what outlives a close, in shared memory.

/dev/shm is writable by every local user, and an engine's description of its buffers
is only a description: the daemon must not follow a link planted there into some other
file, must refuse pages of two buffers that share bytes (a load would write one
buffer's data over the other's), and no mapping may go while a tensor still points
into it.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from radixkv import KvLayout
from radixkv.kvbuffers import ShmKvBuffers
from radixkv_server.datapath import BufferSpec, DeviceOpenError, open_device_buffers
from radixkv_server.datapath.device import check_page_overlap

LAY = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
PAGES = 8
C = LAY.chunk_bytes


@pytest.fixture
def segment():
    eng = ShmKvBuffers.create(LAY, 4 * PAGES)  # room for any layout below
    yield eng
    eng.close()


def test_a_link_in_dev_shm_is_refused_and_its_target_never_written(tmp_path, segment):
    target = tmp_path / "not-kv.conf"
    target.write_bytes(b"keep me" * 4096)
    link = f"/dev/shm/radixkv-test-link-{os.getpid()}"
    os.symlink(target, link)
    try:
        with pytest.raises(DeviceOpenError, match="symbolic link"):
            open_device_buffers("shm", LAY, PAGES, [BufferSpec(os.path.basename(link).encode(), b * PAGES * C,
                                                               PAGES * C) for b in range(LAY.num_buffers)])
    finally:
        os.unlink(link)
    assert target.read_bytes() == b"keep me" * 4096


def test_a_directory_in_dev_shm_is_not_a_segment():
    path = f"/dev/shm/radixkv-test-dir-{os.getpid()}"
    os.mkdir(path)
    try:
        with pytest.raises(DeviceOpenError):
            open_device_buffers("shm", LAY, PAGES, [BufferSpec(os.path.basename(path).encode(), 0, PAGES * C)] * 4)
    finally:
        os.rmdir(path)


def strided(segment, placed):
    """Open `placed` [(offset, page_stride)] in `segment`."""
    name = segment.name.encode()
    return open_device_buffers("shm", LAY, PAGES, [BufferSpec(name, off, (PAGES - 1) * (st or C) + C, st, C)
                                                   for off, st in placed])


def test_interleaved_pages_that_never_meet_are_accepted(segment):
    # FlashInfer-like: per layer one region whose page p holds K then V.
    region = PAGES * 2 * C
    dev = strided(segment, [(0, 2 * C), (C, 2 * C), (region, 2 * C), (region + C, 2 * C)])
    dev.close()


@pytest.mark.parametrize("placed, pair", [
    ([(0, 2 * C), (0, 2 * C), (4 * PAGES * C, 0), (5 * PAGES * C, 0)], "buffers 0 (layer 0 K) and 1 (layer 0 V)"),
    # dense layer 1 K inside layer 0's interleaved pages (it meets both K and V)
    ([(0, 2 * C), (C, 2 * C), (C, 0), (3 * PAGES * C, 0)], "and 2 (layer 1 K)"),
    # one stride's last page meets another stride's page half way
    ([(0, 2 * C), (3 * PAGES * C, 0), (14 * C + C // 2, 3 * C), (6 * PAGES * C, 0)], "buffers 0 (layer 0 K) and 2"),
], ids=["same-offset", "dense-inside-strided", "two-strides"])
def test_buffers_whose_pages_share_bytes_are_refused(segment, placed, pair):
    with pytest.raises(DeviceOpenError, match="overlap") as e:
        strided(segment, placed)
    assert pair in str(e.value)


def test_the_overlap_check_agrees_with_listing_every_page():
    """Closed form (one stride) and page lists (two) against brute force."""
    import random
    rng = random.Random(7)
    for _ in range(2000):
        n, chunk = rng.randint(1, 6), rng.choice([4, 8])
        placed = [("m", rng.randint(0, 60), rng.choice([chunk, chunk + 2, 2 * chunk, 3 * chunk]))
                  for _ in range(rng.randint(2, 3))]
        owners = {}
        shared = False
        for b, (_, off, stride) in enumerate(placed):
            for p in range(n):
                for x in range(off + p * stride, off + p * stride + chunk):
                    shared |= owners.setdefault(x, b) != b
        try:
            check_page_overlap(placed, n, chunk, LAY)
            refused = False
        except DeviceOpenError:
            refused = True
        assert refused == shared, (placed, n, chunk)


def test_an_engines_tensors_outlive_the_buffers_close():
    """`ShmKvBuffers.close()` while the engine still holds a layer's tensor: the tensor
    stays readable (it crashed the process when close unmapped at once)."""
    child = textwrap.dedent("""
        from radixkv import KvLayout
        from radixkv.kvbuffers import ShmKvBuffers
        lay = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
        b = ShmKvBuffers.create(lay, 4096)
        k0 = b.k(0)
        k0.fill_(1)
        b.close()
        print(int(k0.float().sum()))
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(4096 * 4 * 2 * 8)]


def test_the_daemons_mapping_stays_while_a_view_of_it_lives(segment):
    dev = open_device_buffers("shm", LAY, PAGES, segment.specs()[:LAY.num_buffers])
    held = dev._views[0]  # as a copy thread would hold it mid-copy
    dev.close()
    segment.page_view(0)[0].fill_(7)
    assert int(held[0].view(-1)[0]) & 0xFF == 7


def test_a_segment_shrunk_after_register_fails_copies_instead_of_killing_the_daemon():
    """In a child process: a copy touching a mapping past its file's end is SIGBUS."""
    child = textwrap.dedent("""
        import os
        from radixkv import KvLayout
        from radixkv.kvbuffers import ShmKvBuffers
        from radixkv_server.core.pages import pack
        from radixkv_server.datapath import CopyError, HostPool, open_device_buffers
        lay = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
        eng = ShmKvBuffers.create(lay, 64)
        dev = open_device_buffers("shm", lay, 64, eng.specs())
        pool = HostPool(lay, 8, pin="never")
        os.truncate("/dev/shm/" + eng.name, 4096)
        for copy in (lambda: dev.submit_store(pack([63]), pool, pack([0])),
                     lambda: dev.submit_load(pool, pack([0]), pack([63]))):
            try:
                copy()
                print("copied")
            except CopyError as e:
                print("refused:", e)
        dev.close()
        eng.close()
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused:") and "shrank" in line for line in lines), lines
