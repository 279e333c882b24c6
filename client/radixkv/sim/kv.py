"""Deterministic KV bytes: what the simulated engine writes and later verifies.

Page i of a sequence gets a 64-bit key from a hash chain over the tokens,
`key_i = H(key_{i-1} || tokens of page i)` starting from the extra key, so a key names
the whole prefix up to the end of that page (a partial trailing page hashes the tokens
it has). The chunk of buffer b for that page is filled with the int64 words
`seed(key_i, b) + 0, 1, 2, ...`. Any page holding another prefix's KV, another
buffer's (layer's) chunk, or bytes shifted within the page compares unequal.

Buffers may live on the CPU (shared memory) or on a CUDA device: expected bytes are
generated on the buffers' device and compared there, on the current stream.
"""

import hashlib
from collections.abc import Sequence

import torch

from ..layout import KvLayout

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def page_keys(tokens: bytes, page_size: int, extra_key: bytes = b"") -> list[int]:
    """One key per page of `tokens` (packed int32), the last possibly partial."""
    step = page_size * 4
    h = hashlib.blake2b(b"radixkv-sim" + extra_key, digest_size=8).digest()
    keys = []
    for off in range(0, len(tokens), step):
        h = hashlib.blake2b(h + tokens[off:off + step], digest_size=8).digest()
        keys.append(int.from_bytes(h, "little"))
    return keys


def _seed(key: int, buffer: int) -> int:
    """A signed int64 seed for one (prefix key, buffer) pair."""
    s = (key ^ ((buffer + 1) * _GOLDEN)) & _MASK
    return s - (1 << 64) if s >= 1 << 63 else s


class KvPattern:
    """Writes and verifies pattern KV in the engine's device buffers.

    `buffers` are the device buffers in layout order (layer-major), each a contiguous
    tensor of at least `num_pages * layout.chunk_bytes` bytes, all on one device (CPU or
    one CUDA device); page p of buffer b is the chunk at byte offset p * chunk_bytes.
    On CUDA, `write` and `mismatches` run on the current stream: `mismatches` waits for
    its own result, `write` returns once enqueued (`synchronize` waits for it). `rank`:
    the tensor-parallel rank whose KV it is (each rank's bytes differ, as each holds other
    heads): a rank holding another rank's page compares unequal.
    """

    def __init__(self, layout: KvLayout, buffers: Sequence[torch.Tensor], num_pages: int, rank: int = 0):
        if len(buffers) != layout.num_buffers:
            raise ValueError(f"layout has {layout.num_buffers} buffers, got {len(buffers)}")
        devices = {t.device for t in buffers}
        if len(devices) != 1:
            raise ValueError(f"buffers must share one device, got {sorted(map(str, devices))}")
        self.layout = layout
        self.num_pages = num_pages
        self._salt = (rank * _GOLDEN * 3) & _MASK
        self.device: torch.device = devices.pop()
        chunk = layout.chunk_bytes
        self._pages = [self._page_view(t, num_pages, chunk) for t in buffers]
        self._words = torch.arange((chunk + 7) // 8, dtype=torch.int64, device=self.device)

    @staticmethod
    def _page_view(t: torch.Tensor, num_pages: int, chunk: int) -> torch.Tensor:
        if not t.is_contiguous():
            raise ValueError("device buffers must be contiguous")
        flat = t.reshape(-1).view(torch.uint8)
        if flat.numel() < num_pages * chunk:
            raise ValueError(f"buffer of {flat.numel()} bytes is smaller than {num_pages} pages of {chunk}")
        return flat[: num_pages * chunk].view(num_pages, chunk)

    def expected(self, keys: Sequence[int], buffer: int) -> torch.Tensor:
        """[len(keys), chunk_bytes] uint8: the bytes buffer `buffer` holds for those pages."""
        seeds = torch.tensor([_seed(k ^ self._salt, buffer) for k in keys], dtype=torch.int64, device=self.device)
        words = seeds.view(-1, 1) + self._words.view(1, -1)
        return words.view(torch.uint8)[:, : self.layout.chunk_bytes]

    def write(self, pages: Sequence[int], keys: Sequence[int]) -> None:
        """Fill device `pages[i]` of every buffer with the pattern of `keys[i]`."""
        if len(pages) != len(keys):
            raise ValueError(f"{len(pages)} pages for {len(keys)} keys")
        if not pages:
            return
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        for b, view in enumerate(self._pages):
            view[idx] = self.expected(keys, b)

    def synchronize(self) -> None:
        """Wait until every `write` issued so far (on the current stream) is in device
        memory; nothing to wait for on the CPU. Call before handing written pages to the
        daemon (Insert): its copies do not wait for the engine's stream."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def mismatches(self, pages: Sequence[int], keys: Sequence[int],
                   buffers: Sequence[int] | None = None) -> tuple[int, int]:
        """(bytes that differ, (page, buffer) chunks that differ) between device `pages`
        and the pattern of `keys`, over `buffers` (default: all); (0, 0) when every byte
        is right."""
        if len(pages) != len(keys):
            raise ValueError(f"{len(pages)} pages for {len(keys)} keys")
        if not pages:
            return 0, 0
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        bad_bytes = bad_chunks = 0
        for b in range(len(self._pages)) if buffers is None else buffers:
            diff = self._pages[b][idx] != self.expected(keys, b)
            bad_bytes += int(diff.sum())
            bad_chunks += int(diff.any(dim=1).sum())
        return bad_bytes, bad_chunks
