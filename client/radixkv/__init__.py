"""radixkv: what engines import to talk to the radixkv daemon.

- `Client` (blocking) and `AsyncClient` (asyncio): sessions, Match / Insert / LoadBack /
  wait (acks) / Evict, operator calls. Failures raise `radixkv.errors.RadixKVError`;
  a lost session (daemon restart) is re-registered with `Backoff` and raises
  `radixkv.errors.SessionLost` once. `Tls` and a token secure TCP connections.
- `KvLayout` describes the engine's paged KV cache; `radixkv.kvbuffers` exports the
  engine's KV buffers to the daemon (shared memory on CPU, CUDA IPC on GPU).
- `radixkv.sim`: an engine simulator that verifies every byte it reads back.
- `radixkv.v1`: the generated gRPC code.
"""

from importlib import metadata

try:  # the one version, pyproject.toml's: the daemon's too (--version, Stats)
    __version__ = metadata.version("radixkv")
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

from .aio import AsyncClient
from .channel import Tls
from .client import Client
from .layout import KvLayout
from .reconnect import Backoff
from .types import Prompt

__all__ = ["AsyncClient", "Backoff", "Client", "KvLayout", "Prompt", "Tls", "__version__"]
