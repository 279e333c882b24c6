"""`mooncake://HOST:PORT?...`: the URL form of a MooncakeStorage (see open.py)."""

from ..units import parse_size
from .errors import redact_url
from .mooncake_store import MooncakeStorage

URL_OPTIONS = {"segment": "segment_bytes", "buffer": "buffer_bytes", "protocol": "protocol",
               "metadata": "metadata", "hostname": "hostname", "devices": "rdma_devices",
               "timeout": "timeout", "prefix": "prefix", "replicas": "replicas", "batch": "max_batch",
               "fetch": "fetch"}


def open_url(url: str, parts, options: dict[str, str]) -> MooncakeStorage:
    """`mooncake://HOST:PORT[?option=value&...]`: the master's RPC address, and
    segment (bytes this daemon lends, e.g. 4GiB; 0 lends none), buffer (local buffer for
    copying calls), protocol (tcp | rdma), devices (RDMA devices, e.g. mlx5_0), metadata
    (default P2PHANDSHAKE, or an etcd/http metadata URL), hostname (this node's address
    as peers reach it), timeout (seconds per call), prefix (key prefix), replicas, batch,
    fetch (staged: whole records through a registered staging buffer, then checked and
    copied into the host page, the default and the faster with 0.3.13; direct: header
    and payload as two parts straight into the host page, no copy)."""
    unknown = sorted(set(options) - set(URL_OPTIONS))
    if unknown:
        raise ValueError(f"unknown Mooncake option(s) {unknown} in {redact_url(url)}; use {sorted(URL_OPTIONS)}")
    if not parts.netloc or parts.path not in ("", "/"):
        raise ValueError(f"Mooncake storage URL {redact_url(url)!r} must be mooncake://HOST:PORT")
    kwargs = {}
    for name, text in options.items():
        field = URL_OPTIONS[name]
        try:
            if field in ("segment_bytes", "buffer_bytes"):
                kwargs[field] = parse_size(text)
            elif field in ("replicas", "max_batch"):
                kwargs[field] = int(text)
            elif field == "timeout":
                kwargs[field] = float(text)
            else:
                kwargs[field] = text
        except ValueError:
            raise ValueError(f"bad Mooncake option {name} in {redact_url(url)}") from None
    return MooncakeStorage(parts.netloc, **kwargs)
