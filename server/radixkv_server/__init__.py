"""radixkv daemon: the cache core, data path, storage tiers and gRPC service."""

__version__ = "0.1.0"
