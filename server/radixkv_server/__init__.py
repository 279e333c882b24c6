"""radixkv daemon: the cache core, data path, storage tiers and gRPC service."""

from radixkv import __version__  # one version for the client and the daemon (client/radixkv/__init__.py)

__all__ = ["__version__"]
