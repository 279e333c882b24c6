"""Conversions between protobuf messages and the daemon's own types."""

from radixkv.layout import KvLayout
from radixkv.v1 import radixkv_pb2 as pb

from .errors import invalid


def layout_from_pb(msg: pb.KvLayout, default_page_size: int) -> KvLayout:
    """A KvLayout from the wire; INVALID_ARGUMENT naming the bad field."""
    try:
        return KvLayout(
            num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
            dtype=msg.dtype, page_size=msg.page_size or default_page_size,
            kv_format=msg.kv_format or "mha")
    except (ValueError, TypeError) as e:
        raise invalid(f"layout: {e}") from None


def layout_pb(layout: KvLayout) -> pb.KvLayout:
    return pb.KvLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim, dtype=layout.dtype, page_size=layout.page_size,
                       kv_format=layout.kv_format)
