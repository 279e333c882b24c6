"""Engine-managed sessions for in-process tests: schedulers and tensor-parallel ranks whose
KV memory is a real shared-memory segment, described as one of several engine layouts
(each buffer by offset, page stride and page bytes), with byte patterns per rank."""

from radixkv.kvbuffers import BufferSpec, ShmKvBuffers
from radixkv.types import pack
from radixkv_server.service.calls import InsertRequest, Prompt
from radixkv_server.service.registration import Registration

from inproc import LAYOUT, NUM_PAGES

CHUNK = LAYOUT.chunk_bytes


def describe(buffers: ShmKvBuffers, kind: str) -> list[BufferSpec]:
    """The segment's pages described as an engine lays them out:
    - "sglang": the layout's own buffers (K and V per layer, contiguous pages);
    - "flashinfer": per layer [blocks, 2, chunk]: K and V pages alternate (stride 2 chunks);
    - "vllm": per layer [blocks, 2 * chunk]: one buffer per layer, pages of K and V together."""
    handle = buffers.name.encode()
    layer_bytes = 2 * NUM_PAGES * CHUNK
    if kind == "sglang":
        return buffers.specs()
    if kind == "flashinfer":
        return [BufferSpec(handle, layer * layer_bytes + j * CHUNK, layer_bytes - j * CHUNK, 2 * CHUNK, CHUNK)
                for layer in range(LAYOUT.num_layers) for j in range(2)]
    if kind == "vllm":
        return [BufferSpec(handle, layer * layer_bytes, layer_bytes, 2 * CHUNK, 2 * CHUNK)
                for layer in range(LAYOUT.num_layers)]
    raise ValueError(kind)


class Rank:
    """One session of an engine-managed namespace: a SCHEDULER (no memory) or an ENGINE
    rank with a segment described as `kind`."""

    def __init__(self, daemon, session, buffers: ShmKvBuffers | None, specs: list[BufferSpec]):
        self.daemon = daemon
        self.session = session
        self.buffers = buffers
        self.specs = specs

    @classmethod
    async def register(cls, daemon, namespace: str, *, role: str = "engine", tp_rank: int = 0, tp_size: int = 1,
                       kind: str = "flashinfer", instance: str = "a", layout=LAYOUT) -> "Rank":
        buffers = ShmKvBuffers.create(layout, NUM_PAGES) if role == "engine" else None
        specs = describe(buffers, kind) if buffers is not None else []
        try:
            done = await daemon.register(Registration(
                namespace=namespace, layout=layout, backend="shm", device=0, buffers=specs,
                num_device_pages=NUM_PAGES if buffers is not None else 0, device_tier="engine_managed",
                role=role, tp_rank=tp_rank, tp_size=tp_size, instance=instance))
        except BaseException:
            if buffers is not None:
                buffers.close()
            raise
        return cls(daemon, done.session, buffers, specs)

    @property
    def ns(self):
        return self.session.namespace

    # -- the engine's memory ---------------------------------------------------------------

    def _page(self, spec: BufferSpec, page: int):
        start = spec.offset + page * (spec.page_stride or spec.page_bytes or CHUNK)
        return self.buffers._bytes[start:start + (spec.page_bytes or CHUNK)]

    def fill(self, pages: list[int], seed: int) -> None:
        """A distinct byte pattern per (seed, buffer, page position, rank)."""
        for b, spec in enumerate(self.specs):
            for i, page in enumerate(pages):
                self._page(spec, page).fill_((seed + 7 * b + 13 * i + 31 * self.session.rank) % 251)

    def page_bytes(self, pages: list[int]) -> list[bytes]:
        return [bytes(self._page(spec, p).numpy()) for p in pages for spec in self.specs]

    # -- calls ---------------------------------------------------------------------------------

    async def match(self, tokens: bytes, lease: bool = True):
        (answer,) = await self.ns.match(self.session, [Prompt(tokens)], lease)
        return answer

    async def save(self, tokens: bytes, pages: list[int], async_: bool = True):
        return await self.ns.insert(self.session, InsertRequest(tokens, pack(pages), async_=async_))

    async def load(self, node: int, pages: list[int], lease: int = 0, start_page: int = 0, wait: bool = False):
        return (await self.ns.load_back(self.session, node, pack(pages), lease=lease, start_page=start_page,
                                        wait=wait)).result

    async def ack(self, transfer: int):
        return await self.ns.ack(self.session, transfer)

    async def close(self) -> None:
        await self.daemon.close_session(self.session, "closed by the test")
        if self.buffers is not None:
            self.buffers.close()
