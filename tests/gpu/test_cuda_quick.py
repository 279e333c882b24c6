"""The GPU check's first pass (~60 s, scripts/gpu-check.sh): the facts every later test
depends on, each proven once across two processes (issue 19).

- the environment: torch, CUDA runtime and driver versions, the GPU's UUID, and
  CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM with the device address the driver gives
  for the pinned pool (printed, and appended to $RADIXKV_BENCH_OUT);
- an IPC open at an offset: buffers whose storages start inside a shared allocation
  block (torch's storage_offset_bytes) and views of one storage, opened by GPU UUID
  with a wrong ordinal, byte-exact;
- one gather/scatter through the zero-copy view of the pinned pool;
- one per-layer event wait across processes: the engine waits on layer 0's event only
  and finds layer 0 in place;
- the engine's event: a store submitted right after the engine queued a slow write
  reads the written bytes (the copy stream waited on the GPU, not the CPU);
- re-export gives new handles (torch's per-export reference), and overlapping buffer
  specs are refused.
"""

import os

import pytest
import torch

from radixkv import KvLayout
from radixkv.cuda_handle import decode_cuda_handle
from radixkv_server.core.pages import pack
from radixkv_server.datapath import DeviceOpenError, HostPool, open_device_buffers
from radixkv_server.datapath.cuda_devices import device_uuid
from radixkv_server.datapath.cuda_host import can_use_host_pointer, mapped_pointer

from ipc_engine import IpcEngine, host_pattern

pytestmark = pytest.mark.gpu

SMALL = dict(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)  # 2 KiB buffers: one block


@pytest.fixture
def engine(device):
    e = IpcEngine(device)
    yield e
    e.close()


def _report(lines: list[str]) -> None:
    print("\n" + "\n".join(lines))
    out = os.environ.get("RADIXKV_BENCH_OUT")
    if out:
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")


def test_environment_facts(device):
    lay = KvLayout(**SMALL)
    pool = HostPool(lay, 16, device=device)
    try:
        can, driver_ptr = mapped_pointer(pool.tensor.data_ptr(), device)
        free, total = torch.cuda.mem_get_info(device)
        _report([
            f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}, "
            f"driver API {getattr(torch._C, '_cuda_getDriverVersion', lambda: '?')()}",
            f"cuda:{device} {torch.cuda.get_device_name(device)} {device_uuid(device)}, {free >> 30}/{total >> 30} GiB free",
            f"pool pinned: {pool.pinned}; CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = {can}; "
            f"device pointer {'== host pointer' if driver_ptr == pool.tensor.data_ptr() else hex(driver_ptr or 0)}",
        ])
        assert pool.pinned, "pin='auto' did not pin on a GPU machine (see the daemon's log line)"
        assert can == can_use_host_pointer(device) and can in (0, 1)
        assert driver_ptr, "the driver gave no device address for the registered pool"
    finally:
        pool.close()


@pytest.mark.parametrize("one_storage", [False, True], ids=["block_offsets", "one_storage"])
def test_ipc_open_at_an_offset_by_uuid_gather_scatter_and_layer_event(engine, device, one_storage):
    lay, num_pages = KvLayout(**SMALL), 16
    specs = engine.alloc(SMALL, num_pages, one_storage)
    offsets = [decode_cuda_handle(s.handle)[3] for s in specs] if not one_storage else [s.offset for s in specs]
    assert any(o > 0 for o in offsets), f"nothing opened at an offset: {offsets}"
    dev = open_device_buffers("cuda", lay, num_pages, specs, 99, device_uuid=device_uuid(device))
    pool = HostPool(lay, 32, device=device)
    try:
        assert dev.device == device
        devs, hosts = [3, 1, 4, 15, 9], [20, 2, 31, 7, 0]
        dev.submit_store(pack(devs), pool, pack(hosts)).wait()
        assert torch.equal(pool.tensor[torch.tensor(hosts)], host_pattern(lay, torch.tensor(devs)))
        assert dev._host_views[(pool.tensor.data_ptr(), None)] is not None, \
            "no zero-copy view: copies went chunk by chunk"
        targets = [10, 11, 12, 13, 14]
        job = dev.submit_load(pool, pack(hosts), pack(targets))
        assert engine.expect(job.events, targets, devs, layer=0) == 0  # layer 0's event only
        job.wait()
        assert engine.expect(job.events, targets, devs) == 0
    finally:
        dev.close()
        pool.close()


def test_a_store_waits_for_the_engines_event(engine, device):
    lay, num_pages = KvLayout(**SMALL), 16
    specs = engine.alloc(SMALL, num_pages)
    dev = open_device_buffers("cuda", lay, num_pages, specs, device)
    pool = HostPool(lay, 16, device=device)
    try:
        pages, salt = [2, 5, 6], 100
        event = engine.write_late(pages, salt)  # queued behind ~0.1 s of GPU sleep, not synchronized
        dev.submit_store(pack(pages), pool, pack([0, 1, 2]), after=event).wait()
        want = host_pattern(lay, torch.tensor(pages) + salt)
        assert torch.equal(pool.tensor[:3], want), "the store read the pages before the engine's write"
    finally:
        dev.close()
        pool.close()


def test_reexport_gives_new_handles_and_overlap_is_refused(engine, device):
    lay, num_pages = KvLayout(**SMALL), 16
    first = engine.alloc(SMALL, num_pages)
    again = engine.reexport()
    assert [s.handle for s in again] != [s.handle for s in first]  # a new IPC reference each
    dev = open_device_buffers("cuda", lay, num_pages, again, device)
    dev.close()
    overlapping = list(engine.reexport())  # its own references: each export is opened once
    overlapping[1] = overlapping[0]
    with pytest.raises(DeviceOpenError, match="overlap"):
        open_device_buffers("cuda", lay, num_pages, overlapping, device)
