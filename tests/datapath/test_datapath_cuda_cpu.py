"""The CUDA path's decisions and kernels that run without a GPU (issue 19): a failed
enqueue settles only after its stream drained, the pin fallback, which device address
the pinned pool gets, UUID matching, overlap rejection, and the page gather/scatter
code itself (device-agnostic, run here on CPU tensors). What needs a GPU is in tests/gpu.
"""

import asyncio
import threading

import pytest
import torch

from radixkv.layout import KvLayout
from radixkv.types import pack
from radixkv_server.datapath import CopyEngine, CopyError, CopyJob, DeviceBuffers, DeviceOpenError, HostPool
from radixkv_server.datapath.cuda import enqueue_or_drain, load_pages, store_pages
from radixkv_server.datapath.cuda_devices import normalize_uuid, ordinal_for_uuid
from radixkv_server.datapath.cuda_host import choose_device_pointer, pin_refused
from radixkv_server.datapath.device import check_overlap

MHA = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
MLA = KvLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="bfloat16", page_size=2, kv_format="mla")


class StandInStream:
    """Stands in for a torch.cuda.Stream, which cannot run here: `synchronize()` only
    records that it was called, in one log with the kernels 'queued' and the settling."""

    def __init__(self, log: list[str]):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("stream synchronized")


def test_a_failed_enqueue_drains_the_stream_before_failing():
    log: list[str] = []

    def enqueue():
        log.append("kernel queued")  # the first layer's copy is already running
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (scratch)")

    with pytest.raises(CopyError, match="could not be enqueued: OutOfMemoryError"):
        enqueue_or_drain(StandInStream(log), enqueue)
    assert log == ["kernel queued", "stream synchronized"]


def test_an_enqueue_that_works_does_not_wait():
    log: list[str] = []
    assert enqueue_or_drain(StandInStream(log), lambda: "done event") == "done event"
    assert log == []


class FailingEnqueue(DeviceBuffers):
    """A backend whose copies fail half-way through enqueueing, through the real
    `enqueue_or_drain` (its stream is the stand-in above)."""

    def __init__(self, log: list[str]):
        self.layout, self.num_pages, self.log = MHA, 8, log

    def _submit(self):
        def enqueue():
            self.log.append("kernel queued")
            raise RuntimeError("CUDA error: out of memory")
        return enqueue_or_drain(StandInStream(self.log), enqueue)

    def submit_load(self, host_pool, host_pages, device_pages, after=b"") -> CopyJob:
        return self._submit()

    def submit_store(self, device_pages, host_pool, host_pages, after=b"") -> CopyJob:
        return self._submit()

    def close(self) -> None:
        pass


def test_a_failed_transfer_settles_only_after_its_stream_drained():
    log: list[str] = []
    settled = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        pool = HostPool(MHA, 8, pin="never")

        def on_done(transfer, error):
            log.append(f"transfer {transfer} settled: {error}")
            settled.set()

        ce = CopyEngine(loop, FailingEnqueue(log), pool, on_done)
        try:
            ce.load(7, pack([0]), pack([1]))
            assert await ce.wait(7) is not None
        finally:
            ce.close()
            pool.close()

    asyncio.run(main())
    assert settled.is_set()
    assert log[:2] == ["kernel queued", "stream synchronized"]
    assert log[2].startswith("transfer 7 settled: CopyError: CUDA copy could not be enqueued")


def test_pin_auto_goes_on_unpinned_and_always_fails_when_refused():
    refusal = RuntimeError("cudaHostRegister of 1073741824 bytes failed: CUDA error 2 (out of memory)")
    line = pin_refused("auto", refusal, 1 << 30)
    assert "going on unpinned" in line and "1.00 GiB" in line and "CUDA error 2" in line
    with pytest.raises(RuntimeError, match="pin='always'.*CUDA error 2"):
        pin_refused("always", refusal, 1 << 30)


def test_the_pool_is_addressed_where_the_driver_says():
    host = 0x7F00_0000_0000
    assert choose_device_pointer(host, 0, 0x2_0000_0000) == 0x2_0000_0000  # the driver's pointer wins
    assert choose_device_pointer(host, 1, host) == host                     # same address on such devices
    assert choose_device_pointer(host, 1, None) == host                     # attribute says: host pointer works
    assert choose_device_pointer(host, 0, None) is None                     # neither: copy chunk by chunk
    assert choose_device_pointer(host, None, None) is None                  # driver not askable


VISIBLE = ["5b8a7c2e-1111-2222-3333-444455556666", "GPU-0f00ba44-aaaa-bbbb-cccc-ddddeeeeffff"]


@pytest.mark.parametrize("uuid, ordinal", [
    ("GPU-5b8a7c2e-1111-2222-3333-444455556666", 0),  # nvidia-smi's spelling of torch's
    ("0F00BA44-AAAA-BBBB-CCCC-DDDDEEEEFFFF", 1),       # case and prefix do not matter
])
def test_a_uuid_names_the_daemons_own_ordinal(uuid, ordinal):
    assert ordinal_for_uuid(uuid, VISIBLE) == ordinal


def test_an_invisible_uuid_is_a_clear_error():
    with pytest.raises(DeviceOpenError, match=r"GPU-deadbeef.*not visible.*cuda:0=GPU-5b8a7c2e.*CUDA_VISIBLE_DEVICES"):
        ordinal_for_uuid("GPU-deadbeef", VISIBLE)
    with pytest.raises(DeviceOpenError, match="visible: none"):
        ordinal_for_uuid("GPU-deadbeef", [])
    assert normalize_uuid(" GPU-AB ") == "ab"


def test_overlapping_device_buffers_are_rejected_in_one_address_space():
    need = 4096
    base = 0x7000_0000
    apart = [(None, base + i * need, base + (i + 1) * need) for i in range(4)]
    check_overlap(apart, MHA, "cuda:0")  # back to back: fine
    shifted = apart[:3] + [(None, base + 2 * need + 64, base + 3 * need + 64)]  # buffer 3 starts inside buffer 2
    with pytest.raises(DeviceOpenError, match=r"buffers 2 \(layer 1 K\) and 3 \(layer 1 V\) overlap in cuda:0"):
        check_overlap(shifted, MHA, "cuda:0")
    # Equal offsets in different segments do not overlap; in one segment they do.
    check_overlap([("a", 0, need), ("b", 0, need)], MLA, "segment")
    with pytest.raises(DeviceOpenError, match="segment 'a'"):
        check_overlap([("a", 0, need), ("a", 0, need)], MLA, "segment")


@pytest.mark.parametrize("layout", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("per", [1, 3, 64], ids=["scratch1", "scratch3", "scratch64"])
def test_gather_and_scatter_move_whole_pages(layout, per):
    """The copy kernels of the CUDA backend, on CPU tensors: pages go to the right place
    in every buffer, in groups no larger than the scratch buffer."""
    num_pages, host_pages, cols = 10, 12, layout.chunk_bytes // 2
    gen = torch.Generator().manual_seed(1)
    views = [torch.randint(-2**15, 2**15, (num_pages, cols), dtype=torch.int16, generator=gen)
             for _ in range(layout.num_buffers)]
    h3 = torch.zeros((host_pages, layout.num_buffers, cols), dtype=torch.int16)
    scratch = torch.empty((per, layout.buffers_per_layer, cols), dtype=torch.int16)
    dev, host = [7, 2, 9, 0, 5], [11, 0, 3, 4, 8]
    store_pages(layout, h3, views, torch.tensor(host), torch.tensor(dev), scratch)
    for d, h in zip(dev, host):
        for b in range(layout.num_buffers):
            assert torch.equal(h3[h, b], views[b][d])
    targets = [1, 3, 4, 6, 8]
    done = []
    load_pages(layout, h3, views, torch.tensor(host), torch.tensor(targets), scratch, done.append)
    assert done == list(range(layout.num_layers))  # one event per layer, in order
    for h, t in zip(host, targets):
        for b in range(layout.num_buffers):
            assert torch.equal(views[b][t], h3[h, b])


def _export(**fields) -> bytes:
    """A CUDA handle as torch's export gives it (this machine has no GPU to export one),
    with `fields` replaced."""
    import base64
    import json

    doc = {"v": 1, "device": 0, "handle": base64.b64encode(b"\x01" * 64).decode(), "size": 1 << 20, "offset": 0,
           "ref_handle": base64.b64encode(b"/torch_4759_1410171797_1").decode(), "ref_offset": 3,
           "event_handle": None, "event_sync": True}
    doc.update({k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in fields.items()})
    return json.dumps(doc).encode()


@pytest.mark.parametrize("fields, says", [
    ({"ref_handle": b"/victim-tenant-kv-segment"}, "is not a torch reference counter"),
    ({"ref_handle": b"/torch_1_2_3/../../victim"}, "is not a torch reference counter"),
    ({"ref_offset": -(1 << 30)}, "ref_offset -1073741824 outside"),
    ({"ref_offset": 10_000}, "ref_offset 10000 outside"),
    ({"size": 0}, "size > 0"),
    ({"offset": -1}, "offset must be >= 0"),
    ({"size": "1"}, "must be integers"),
    ({"event_sync": 1}, "event_sync must be true or false"),
])
def test_a_cuda_handle_whose_reference_counter_is_not_torchs_is_refused(fields, says):
    """The daemon hands an export's fields to torch, which at the storage's end opens the
    shared-memory file `ref_handle` names, grows it, decrements slot `ref_offset` and
    unlinks it at zero: a forged name let one tenant change or remove another's segment
    (or write outside the mapping) through the daemon (found by a security review)."""
    from radixkv.cuda_handle import decode_cuda_handle

    assert decode_cuda_handle(_export())[4] == b"/torch_4759_1410171797_1"  # torch's own shape passes
    with pytest.raises(ValueError, match=says):
        decode_cuda_handle(_export(**fields))
