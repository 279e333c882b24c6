"""`mooncake://HOST:PORT?...`: the URL form of a MooncakeStorage (see open.py)."""

import importlib
import ipaddress
import logging

from ..logs import log_event
from ..units import parse_size
from .errors import redact_url
from .mooncake_store import MooncakeStorage

log = logging.getLogger("radixkv.storage")

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
    try:  # else "ready", retrying an import that cannot succeed, forever
        importlib.import_module("mooncake.store")
    except (ImportError, OSError) as e:  # the package missing, or its libraries (libibverbs1)
        raise ValueError(f"--storage mooncake:// needs the Mooncake Store client ({e}): pip install "
                         "'radixkv-server[mooncake]', and the system library libibverbs1") from None
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
    storage = MooncakeStorage(parts.netloc, **kwargs)
    _warn_unreachable_segment(parts.netloc, kwargs.get("hostname", "127.0.0.1"),
                              kwargs.get("segment_bytes", 1))  # 1: lends the default segment
    return storage


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: not known to be this machine alone
        return False


def _warn_unreachable_segment(master: str, hostname: str, segment_bytes: int) -> None:
    """A segment lent under a loopback hostname while the master is elsewhere: the other
    nodes would look for its pages on their own machine (their reads fail, logged as a
    dead owner). Warned at open: it is the operator's `hostname=`."""
    if segment_bytes and _is_loopback(hostname) and not _is_loopback(master.rpartition(":")[0]):
        log_event(log, "storage.segment_unreachable", logging.WARNING, store=f"mooncake://{master}",
                  hostname=hostname, note="this node lends a segment under a loopback hostname to a master on "
                  "another machine: other nodes cannot read it; set hostname= to this node's address, or "
                  "segment=0 to lend none")
