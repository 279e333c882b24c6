"""KvLayout: the shape of an engine's paged KV cache, shared by engine and daemon.

Device side (the engine's buffers): `num_buffers` buffers, layer-major (layer 0 K,
layer 0 V, layer 1 K, ...; one buffer per layer for "mla"). Each buffer is one
contiguous, token-major region ([num_tokens, num_kv_heads, head_dim] like SGLang's
`k_buffer[layer]`), so device page p of a buffer is the `chunk_bytes` bytes at
offset p * chunk_bytes.

Host side (the daemon's pool): page-first. One host page is `page_bytes` contiguous
bytes holding that page's chunk of every buffer, in buffer order:

    host page = [buf 0 chunk | buf 1 chunk | ... | buf num_buffers-1 chunk]

so a whole page for all layers is one contiguous run.
"""

from dataclasses import dataclass

# dtype name -> bytes per element. Names follow torch (`torch.<name>`).
DTYPE_SIZES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# kv_format -> buffers per layer.
KV_FORMATS = {"mha": 2, "mla": 1}


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Shape of one engine's KV cache. Raises ValueError naming the bad field. The
    client always sends `page_size` (the daemon's `--page-size` default is for Register
    requests that leave it 0, such as grpcurl's)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    kv_format: str = "mha"

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"KvLayout.{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"KvLayout.{name} must be >= 1, got {value}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KvLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"KvLayout.kv_format {self.kv_format!r} is not one of {sorted(KV_FORMATS)}")

    @property
    def itemsize(self) -> int:
        """Bytes per element of `dtype`."""
        return DTYPE_SIZES[self.dtype]

    @property
    def buffers_per_layer(self) -> int:
        """2 for "mha" (K and V), 1 for "mla" (one latent buffer)."""
        return KV_FORMATS[self.kv_format]

    @property
    def num_buffers(self) -> int:
        """Device buffers in all, layer-major: buffer index = layer * buffers_per_layer + j."""
        return self.num_layers * self.buffers_per_layer

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one buffer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one page in one buffer (a device page of one buffer)."""
        return self.page_size * self.token_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one host page: the chunks of every buffer, back to back."""
        return self.num_buffers * self.chunk_bytes

    def buffer_bytes(self, num_pages: int) -> int:
        """Bytes of one device buffer holding `num_pages` pages."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        return num_pages * self.chunk_bytes

    def buffer_index(self, layer: int, j: int = 0) -> int:
        """Index of buffer `j` (0 = K or the mla buffer, 1 = V) of `layer`."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        if not 0 <= j < self.buffers_per_layer:
            raise ValueError(f"buffer {j} of a layer out of range 0..{self.buffers_per_layer - 1} ({self.kv_format})")
        return layer * self.buffers_per_layer + j


__all__ = ["DTYPE_SIZES", "KV_FORMATS", "KvLayout"]
