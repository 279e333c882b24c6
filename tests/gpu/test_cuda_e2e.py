"""The CUDA path end to end: a real daemon subprocess and engines whose KV lives on the GPU.

- The simulator in cuda mode, as its own process, runs a multi-turn workload under
  write-through and write-back: every byte it reads back is verified, and its stream
  waited on every load-back's per-layer IPC events.
- This process as the engine: insert, write-through backup or write-back eviction,
  load-back into other pages, layer 0 read after waiting on layer 0's event only, then
  every layer, ack; every byte verified.
- The daemon's footprint: a CUDA context on the engine's device only, little memory;
  its host pool pinned at Register and unpinned at shutdown.

The data path's bandwidth against one contiguous pinned memcpy is in
test_cuda_bandwidth.py. RADIXKV_TEST_DEVICE picks the GPU (default: the last one).
"""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from radixkv.client import Client
from radixkv.kvbuffers import CudaKvBuffers
from radixkv.layout import KvLayout
from radixkv.sim import page_keys
from radixkv.types import pack
from radixkv_server.datapath.cuda_devices import device_uuid
from tests.support.engine import EngineDouble

pytestmark = pytest.mark.gpu

# 8 layers x K,V of 16 tokens x 2 heads x 128 bf16: 8 KiB chunks, 128 KiB pages.
LAYOUT = KvLayout(num_layers=8, num_kv_heads=2, head_dim=128, dtype="bfloat16", page_size=16)
DEVICE_PAGES = 2048   # 256 MiB of engine KV
PROMPT_PAGES = 1024   # a 128 MiB load-back: long enough that later layers may still be in flight
HOST_FLAGS = ("--host-pool-size", "160MiB")


class GpuEngine(EngineDouble):
    """This process as an engine: the engine double (tests/support/engine.py) on CUDA
    buffers, with the sim's byte pattern and a session."""

    def __init__(self, target: str, device: int, policy: str, num_pages: int = DEVICE_PAGES,
                 namespace: str = "gpu/tp0"):
        super().__init__(LAYOUT, num_pages, backend="cuda", device=device)
        self.device = device
        self.namespace = namespace
        self.stream = self.buffers.stream
        self.reg = self.register(Client(target, timeout=60), namespace, write_policy=policy,
                                 engine=f"pytest pid {os.getpid()}")

    def write(self, pages, keys) -> None:
        with torch.cuda.stream(self.stream):
            self.kv.write(pages, keys)
            self.kv.synchronize()

    def scribble(self, pages) -> None:
        """Overwrite `pages` of every buffer (a load-back must really copy)."""
        idx = torch.tensor(list(pages), device=self.device)
        with torch.cuda.stream(self.stream):
            for b in range(LAYOUT.num_buffers):
                self.page_view(b)[idx] = 0xA5
        self.stream.synchronize()

    def mismatches(self, pages, keys, stream, layers=None) -> tuple[int, int]:
        buffers = None if layers is None else [LAYOUT.buffer_index(layer, j) for layer in layers
                                               for j in range(LAYOUT.buffers_per_layer)]
        with torch.cuda.stream(stream):
            return self.kv.mismatches(pages, keys, buffers)

    def evict_until(self, n: int, timeout: float = 30.0) -> tuple[list[int], int]:
        """Evict until `n` pages came back (a backup may still be running): (pages, written back)."""
        freed, written, deadline = [], 0, time.monotonic() + timeout
        while len(freed) < n and time.monotonic() < deadline:
            ev = self.client.evict(n - len(freed))
            freed += ev.freed_pages
            written += ev.written_back_pages
            if len(freed) < n:
                time.sleep(0.02)
        return freed, written

    def host_pages_used(self) -> int:
        (ns,) = [s for s in self.client.stats(self.namespace).namespaces if s.namespace == self.namespace]
        return ns.host_pages_used


def tokens_of(pages: int, salt: int = 0) -> bytes:
    n = pages * LAYOUT.page_size
    return pack(range(salt * 10**6 + 1, salt * 10**6 + n + 1))


def round_trip(eng: GpuEngine, policy: str, pages: int) -> dict:
    """Insert `pages` pages, get them to host, evict them, load them back elsewhere:
    layer 0 checked after its event alone, then all layers, then the ack. Returns facts
    for the caller to print."""
    toks = tokens_of(pages)
    keys = page_keys(toks, LAYOUT.page_size)
    src = list(range(pages))
    eng.write(src, keys)
    ins = eng.client.insert(toks, src)
    assert ins.cached_tokens == 0 and list(ins.redundant_pages) == []

    if policy == "write_through":  # the backup runs on its own after Insert
        deadline = time.monotonic() + 30
        while eng.host_pages_used() < pages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.host_pages_used() == pages, "write-through backup did not finish"
    freed, written = eng.evict_until(pages)
    assert sorted(freed) == src
    assert written == (pages if policy == "write_back" else 0)
    eng.scribble(src)

    (m,) = eng.client.match([toks], lease=True)
    assert (m.device_tokens, m.host_tokens) == (0, pages * LAYOUT.page_size)
    dst = list(range(eng.buffers.num_pages - 1, eng.buffers.num_pages - 1 - pages, -1))  # reversed, elsewhere
    lb = eng.client.load_back(m.host_node, dst)
    assert lb.transfer and list(lb.device_pages) == dst and list(lb.unused_pages) == []
    assert len(lb.layer_events) == LAYOUT.num_layers and len(set(lb.layer_events)) == LAYOUT.num_layers

    # Layer 0 as soon as its event fired: wait on event 0 only.
    events = CudaKvBuffers.events(list(lb.layer_events), eng.device)
    first = torch.cuda.Stream(eng.device)
    first.wait_event(events[0])
    later_in_flight = not events[-1].query()
    assert eng.mismatches(dst, keys, first, layers=[0]) == (0, 0)
    # Then every layer, after all events.
    CudaKvBuffers.wait_events(list(lb.layer_events), eng.stream)
    assert eng.mismatches(dst, keys, eng.stream) == (0, 0)

    outcome = eng.client.wait([lb.transfer], timeout=60)[lb.transfer]
    assert outcome.ok, outcome.reason
    eng.client.release([m.lease])
    (again,) = eng.client.match([toks])
    assert again.device_tokens == pages * LAYOUT.page_size and list(again.device_pages) == dst
    # The pages now sit on device and host: evicting them costs no copy.
    freed, written = eng.evict_until(pages)
    assert sorted(freed) == sorted(dst) and written == 0
    assert eng.client.check_invariants() == []
    return {"later_layers_in_flight": later_in_flight}


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_insert_evict_and_load_back_every_byte(gpu_daemon, device, policy):
    d = gpu_daemon(*HOST_FLAGS)
    eng = GpuEngine(d.target, device, policy)
    assert eng.reg.device_uuid == device_uuid(device)  # the daemon opened the buffers on this GPU
    try:
        facts = round_trip(eng, policy, PROMPT_PAGES)
    finally:
        eng.close()
    print(f"\n[{policy}] {PROMPT_PAGES} pages x {LAYOUT.page_bytes >> 10} KiB loaded back on cuda:{device}; "
          f"layer 0 verified while later layers were still in flight: {facts['later_layers_in_flight']}")


def _daemon_round_trip(d, device: int) -> None:
    eng = GpuEngine(d.target, device, "write_back", num_pages=256)
    try:
        round_trip(eng, "write_back", 64)
    finally:
        eng.close()


def test_host_pool_pinned_at_register_and_unpinned_at_shutdown(gpu_daemon, device):
    d = gpu_daemon(*HOST_FLAGS)
    _daemon_round_trip(d, device)
    assert d.stop() == 0
    log = d.log()
    assert re.search(r"host pool: pinned [\d.]+ GiB \(\d+ pages\)", log), log[-4000:]
    assert "host pool: unpinned" in log, log[-4000:]
    assert log.index("host pool: pinned") < log.index("host pool: unpinned")


def _text(value) -> str:
    return (value.decode() if isinstance(value, bytes) else str(value)).lower()


def _cuda_ordinals(pynvml) -> dict[int, int]:
    """NVML index -> CUDA ordinal, matched by UUID, else by PCI address, else (one GPU
    each) 0 -> 0."""
    by_uuid, by_pci = {}, {}
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        by_uuid[_text(getattr(p, "uuid", "")).removeprefix("gpu-")] = i
        if isinstance(getattr(p, "pci_bus_id", None), int):
            by_pci[(p.pci_domain_id, p.pci_bus_id, p.pci_device_id)] = i
    out = {}
    for n in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(n)
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        found = by_uuid.get(_text(pynvml.nvmlDeviceGetUUID(h)).removeprefix("gpu-"),
                            by_pci.get((pci.domain, pci.bus, pci.device)))
        if found is not None:
            out[n] = found
    if not out and pynvml.nvmlDeviceGetCount() == 1 and torch.cuda.device_count() == 1:
        out[0] = 0
    return out


def gpu_memory_of(pid: int) -> dict[int, int | None] | None:
    """{CUDA ordinal: bytes (None: NVML does not say)} that process `pid` uses on each
    visible GPU as NVML sees it, or None when NVML cannot be used."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, or no NVML
        return None
    try:
        out: dict[int, int | None] = {}
        for n, dev in _cuda_ordinals(pynvml).items():
            h = pynvml.nvmlDeviceGetHandleByIndex(n)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid:
                    out[dev] = p.usedGpuMemory  # None where the driver does not report it
        return out
    finally:
        pynvml.nvmlShutdown()


def _mib(used: dict) -> dict:
    return {k: "unknown" if v is None else f"{v / 2**20:.0f} MiB" for k, v in used.items()}


def test_daemon_context_only_on_the_engine_device(gpu_daemon, device):
    torch.zeros(1, device=device)  # this process holds a context: NVML must list it
    mine = gpu_memory_of(os.getpid())
    if not mine:
        pytest.skip(f"NVML does not list this process ({mine!r}): per-process GPU memory is not visible here")
    d = gpu_daemon(*HOST_FLAGS)
    eng = GpuEngine(d.target, device, "write_back", num_pages=256)
    try:
        round_trip(eng, "write_back", 64)
        used = gpu_memory_of(d.pid)
    finally:
        eng.close()
    print(f"\ndaemon pid {d.pid} GPU memory by CUDA device: {_mib(used)}; this process: {_mib(mine)}")
    assert set(used) == {device}, f"the daemon holds contexts on devices {sorted(used)}; the engine's is {device}"
    if used[device] is not None:
        assert used[device] < 1 << 30, f"the daemon holds {used[device] >> 20} MiB on cuda:{device}"


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_sim_process_in_cuda_mode_runs_clean(gpu_daemon, device, policy):
    d = gpu_daemon()
    cmd = [sys.executable, "-m", "radixkv.sim.cli", "--target", d.target, "--backend", "cuda",
           "--device", str(device), "--namespace", f"sim-{policy}", "--write-policy", policy,
           "--workload", "multiturn", "--requests", "300", "--clients", "6", "--max-context", "160",
           "--device-pages", "96", "--host-pages", "240", "--page-size", "4", "--layers", "2",
           "--heads", "2", "--head-dim", "16", "--seed", "7", "--progress-every", "1000000"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    print("\n" + out[-1500:])
    assert run.returncode == 0, out[-6000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-1] == "0 byte mismatches", out[-6000:]
    facts = {k: v for k, v in (ln.split(": ", 1) for ln in lines if ": " in ln)}
    load_backs, waits = int(facts["load_backs"]), int(facts["layer_event_waits"])
    assert load_backs > 0 and int(facts["host_tokens"]) > 0 and int(facts["evicted_pages"]) > 0
    assert waits == load_backs * 2  # every load-back came with one event per layer, each waited on
    assert "device pages (SimBuffers(cuda:" in out


SLOW_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of GPU clock, far longer than an RPC


def test_engine_events_order_the_daemons_copies(gpu_daemon, device):
    """The engine never synchronizes on the CPU: its writes, queued behind a slow kernel,
    precede the event it sends with Insert and Evict, so the write-back must read the
    written bytes; its last use of the load-back's target pages (a late scribble)
    precedes the LoadBack's event, so the load must land after it."""
    d = gpu_daemon(*HOST_FLAGS)
    eng = GpuEngine(d.target, device, "write_back", num_pages=256)
    try:
        pages = 64
        toks = tokens_of(pages, salt=3)
        keys = page_keys(toks, LAYOUT.page_size)
        src = list(range(pages))
        with torch.cuda.stream(eng.stream):
            torch.cuda._sleep(SLOW_CYCLES)
            eng.kv.write(src, keys)  # queued, not done, when Insert and Evict arrive
        eng.client.insert(toks, src, engine_event=CudaKvBuffers.record_event(eng.stream))
        ev = eng.client.evict(pages, engine_event=CudaKvBuffers.record_event(eng.stream))
        assert ev.written_back_pages == pages

        (m,) = eng.client.match([toks])
        dst = list(range(255, 255 - pages, -1))
        idx = torch.tensor(dst, device=device)
        with torch.cuda.stream(eng.stream):
            torch.cuda._sleep(SLOW_CYCLES)
            for b in range(LAYOUT.num_buffers):
                eng.page_view(b)[idx] = 0xA5  # the engine's last use of the pages, still queued
        lb = eng.client.load_back(m.host_node, dst, engine_event=CudaKvBuffers.record_event(eng.stream))
        CudaKvBuffers.wait_events(list(lb.layer_events), eng.stream)
        assert eng.mismatches(dst, keys, eng.stream) == (0, 0)
        assert eng.client.wait([lb.transfer], timeout=60)[lb.transfer].ok
    finally:
        eng.close()
