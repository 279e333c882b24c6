"""The CUDA engine double: an engine in a separate process (CUDA IPC cannot open a
process's own handles) for tests where this process plays the daemon's data path
(test_cuda_datapath, test_cuda_bandwidth).

`IpcEngine(device)` spawns it; `alloc(layout_kwargs, num_pages, one_storage)` makes it
allocate one CUDA tensor per buffer (with `one_storage`, views of one allocation: one
IPC handle), fill chunk (buffer b, page p) with `pattern(layout, b, p)` and return
`CudaKvBuffers.export` specs, also kept in `specs` (earlier tensors are freed: close the
data path that opened them first); `expect(events, dst, src)` makes it wait on a
load-back's IPC events and count device pages `dst[i]` that do not hold the pattern of
page `src[i]` (with `layer`: wait on that layer's event only, check that layer's
buffers); `write_late(pages, salt)` queues a slow kernel, then overwrites those pages
with `pattern(..., salt)`, records an interprocess event after it and returns its handle
without synchronizing (the daemon's copy must wait for it); `reexport()` exports the
same tensors again. The bytes name their page, not their tokens: these tests move pages
directly, without a daemon. (Engines that talk to a daemon build on
`tests/support/engine.py` instead.)
"""

import multiprocessing as mp

import torch

from radixkv import KvLayout
from radixkv.kvbuffers import CudaKvBuffers, torch_dtype

READY_TIMEOUT_S = 300


def pattern(lay: KvLayout, b: int, pages: torch.Tensor) -> torch.Tensor:
    """uint8 [len(pages), chunk_bytes]: the bytes of buffer b at each page (on pages' device)."""
    c = torch.arange(lay.chunk_bytes, device=pages.device)
    return ((c[None, :] * 3 + b * 37 + pages[:, None] * 11 + 1) % 251).to(torch.uint8)


def host_pattern(lay: KvLayout, pages: torch.Tensor) -> torch.Tensor:
    """uint8 [len(pages), page_bytes]: host pages holding those device pages."""
    return torch.cat([pattern(lay, b, pages) for b in range(lay.num_buffers)], dim=1)


def filled_buffers(lay: KvLayout, num_pages: int, device, one_storage: bool = False) -> list[torch.Tensor]:
    """One tensor per buffer on `device` (views of one allocation with `one_storage`),
    chunk (b, p) holding `pattern(lay, b, p)`."""
    every = torch.arange(num_pages, device=device)
    shape = (num_pages * lay.page_size, lay.num_kv_heads, lay.head_dim)
    whole = torch.empty((lay.num_buffers, *shape), dtype=torch_dtype(lay), device=device) if one_storage else None
    tensors = []
    for b in range(lay.num_buffers):
        t = whole[b] if one_storage else torch.empty(shape, dtype=torch_dtype(lay), device=device)
        t.view(torch.uint8).view(num_pages, lay.chunk_bytes).copy_(pattern(lay, b, every))
        tensors.append(t)
    return tensors


def count_bad(lay: KvLayout, tensors: list[torch.Tensor], dst, src, buffers=None) -> int:
    """Pages `dst[i]` (of `buffers`, default all) that do not hold the pattern of page `src[i]`."""
    device = tensors[0].device
    d, s = torch.tensor(dst, device=device), torch.tensor(src, device=device)
    bad = 0
    for b, t in enumerate(tensors):
        if buffers is not None and b not in buffers:
            continue
        got = t.view(torch.uint8).view(-1, lay.chunk_bytes).index_select(0, d)
        bad += int((got != pattern(lay, b, s)).any(dim=1).sum())
    return bad


SLOW_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of GPU clock before a late write


def _write_late(lay: KvLayout, tensors, stream, pages: list[int], salt: int) -> bytes:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLOW_CYCLES)
        idx = torch.tensor(pages, device=stream.device)
        for b, t in enumerate(tensors):
            t.view(torch.uint8).view(-1, lay.chunk_bytes).index_copy_(0, idx, pattern(lay, b, idx + salt))
    return bytes(CudaKvBuffers.record_event(stream).ipc_handle())


def _main(conn, device: int) -> None:
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    lay, tensors, exported = None, [], None
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            return
        if msg[0] == "write_late":
            conn.send(_write_late(lay, tensors, stream, msg[1], msg[2]))
            continue
        if msg[0] == "reexport":
            conn.send(list(exported.fresh()))
            continue
        if msg[0] == "alloc":
            _, kwargs, num_pages, one_storage = msg
            tensors, exported = [], None  # the export holds the tensors too
            torch.cuda.empty_cache()
            CudaKvBuffers.forget_events()  # the other side opens a new event ring
            lay = KvLayout(**kwargs)
            tensors = filled_buffers(lay, num_pages, device, one_storage)
            torch.cuda.synchronize(device)
            exported = CudaKvBuffers.export(lay, tensors, device)
            conn.send(list(exported))
            continue
        _, handles, dst, src, layer = msg  # "expect"
        with torch.cuda.stream(stream):
            if layer is None:
                CudaKvBuffers.wait_events(handles, stream)
                bad = count_bad(lay, tensors, dst, src)
            else:
                stream.wait_event(CudaKvBuffers.events([handles[layer]], device)[0])
                bpl = lay.buffers_per_layer
                bad = count_bad(lay, tensors, dst, src, range(layer * bpl, (layer + 1) * bpl))
        conn.send(bad)


class IpcEngine:
    def __init__(self, device: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, device), daemon=True)
        self.proc.start()

    def alloc(self, layout_kwargs: dict, num_pages: int, one_storage: bool = False):
        self.conn.send(("alloc", layout_kwargs, num_pages, one_storage))
        if not self.conn.poll(READY_TIMEOUT_S):
            raise TimeoutError("engine process did not export its buffers")
        self.specs = self.conn.recv()
        return self.specs

    def expect(self, handles, dst, src, layer: int | None = None) -> int:
        self.conn.send(("expect", list(handles), list(dst), list(src), layer))
        return self._recv("check its pages")

    def write_late(self, pages, salt: int) -> bytes:
        self.conn.send(("write_late", list(pages), salt))
        return self._recv("queue a late write")

    def reexport(self):
        self.conn.send(("reexport",))
        return self._recv("export again")

    def _recv(self, what: str):
        if not self.conn.poll(READY_TIMEOUT_S):
            raise TimeoutError(f"engine process did not {what}")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
