"""A blocking scheduler session for tests that drive a worker's session directly: it
registers as the connector's scheduler does (role "scheduler", no buffers), and gives the
lookup's hits (leased Match) without the connector's asynchronous lookups around them."""

from radixkv import Client
from radixkv.errors import RadixKVError
from radixkv.layout import KvLayout
from radixkv.vllm.config import ConnectorConfig
from radixkv.vllm.daemon import MISS, Hit, hit_of, register_options


class SchedulerSession:
    def __init__(self, config: ConnectorConfig, layout: KvLayout, tp_size: int = 1):
        self.config, self.layout = config, layout
        self._client = Client(config.target, timeout=config.timeout_s)
        self._client.register(config.namespace, layout, [], 0,
                              **register_options(config, engine="test scheduler", role="scheduler", tp_size=tp_size))

    def lookup(self, prompts: list[bytes]) -> list[Hit]:
        """The leased host hit of each prompt; misses while the daemon cannot answer (the
        call after a restart registers the session again, as the connector's does)."""
        try:
            return [hit_of(r) for r in self._client.match(prompts, lease=True)]
        except RadixKVError:
            return [MISS] * len(prompts)

    def release(self, leases: list[int]) -> None:
        self._client.release([x for x in leases if x])

    def close(self) -> None:
        self._client.close()
