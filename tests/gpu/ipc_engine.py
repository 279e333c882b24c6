"""An engine in a separate process (CUDA IPC cannot open a process's own handles) for
tests where this process plays the daemon's data path.

`IpcEngine(device)` spawns it; `alloc(layout_kwargs, num_pages)` makes it allocate one
CUDA tensor per buffer, fill chunk (buffer b, page p) with `pattern(layout, b, p)` and
return `CudaKvBuffers.export` specs (earlier tensors are freed: close the data path
that opened them first); `expect(events, dst, src)` makes it wait on a load-back's IPC
events and count device pages `dst[i]` that do not hold the pattern of page `src[i]`.
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


def _main(conn, device: int) -> None:
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    lay, tensors, num_pages = None, [], 0
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            return
        if msg[0] == "alloc":
            _, kwargs, num_pages = msg
            tensors = []
            torch.cuda.empty_cache()
            CudaKvBuffers.forget_events()  # the other side opens a new event ring
            lay = KvLayout(**kwargs)
            every = torch.arange(num_pages, device=device)
            shape = (num_pages * lay.page_size, lay.num_kv_heads, lay.head_dim)
            for b in range(lay.num_buffers):
                t = torch.empty(shape, dtype=torch_dtype(lay), device=device)
                t.view(torch.uint8).view(num_pages, lay.chunk_bytes).copy_(pattern(lay, b, every))
                tensors.append(t)
            torch.cuda.synchronize(device)
            conn.send(CudaKvBuffers.export(lay, tensors, device))
            continue
        _, handles, dst, src = msg  # "expect"
        with torch.cuda.stream(stream):
            CudaKvBuffers.wait_events(handles, stream)
            d, s = torch.tensor(dst, device=device), torch.tensor(src, device=device)
            bad = 0
            for b, t in enumerate(tensors):
                got = t.view(torch.uint8).view(num_pages, lay.chunk_bytes).index_select(0, d)
                bad += int((got != pattern(lay, b, s)).any(dim=1).sum())
        conn.send(bad)


class IpcEngine:
    def __init__(self, device: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, device), daemon=True)
        self.proc.start()

    def alloc(self, layout_kwargs: dict, num_pages: int):
        self.conn.send(("alloc", layout_kwargs, num_pages))
        if not self.conn.poll(READY_TIMEOUT_S):
            raise TimeoutError("engine process did not export its buffers")
        return self.conn.recv()

    def expect(self, handles, dst, src) -> int:
        self.conn.send(("expect", list(handles), list(dst), list(src)))
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
