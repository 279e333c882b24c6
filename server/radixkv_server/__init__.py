"""radixkv daemon: the cache core, data path, storage tiers and gRPC service."""

from importlib import metadata

try:  # one version for the daemon and its client: the client's (radixkv.__version__), read
    __version__ = metadata.version("radixkv")  # here without importing the client (gRPC, ~200 ms)
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
