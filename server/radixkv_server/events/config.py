"""Settings of the event publisher. The daemon's `DaemonConfig` (server/radixkv_server/
config.py) carries the `kv_events_*` fields listed in docs/events.md, from which the
flags and `RADIXKV_KV_EVENTS_*` variables derive; `from_daemon` builds this from it, and
`DaemonConfig` does so when it is made, so a bad setting is refused with the others
(exit code 2) before the daemon opens anything. The defaults here are DaemonConfig's
(tests/events/test_config.py holds them equal), for the hub's tests and tools."""

from dataclasses import dataclass

from radixkv.routing.blockhash import DEFAULT_SEED


FLAGS = {"queue_size": "--kv-events-queue-size", "ring_size": "--kv-events-replay-size",
         "ring_bytes": "--kv-events-replay-bytes", "hwm": "--kv-events-hwm",
         "subscriber_buffer": "--kv-events-subscriber-buffer"}  # field -> its flag


@dataclass(frozen=True)
class EventsConfig:
    endpoint: str = ""           # ZMQ PUB address, e.g. tcp://*:5557 ("": no ZMQ)
    replay_endpoint: str = ""    # ZMQ ROUTER address for replay, e.g. tcp://*:5558 ("": none)
    topic: str = "kv@{namespace}"  # per-namespace topic; {namespace} is substituted
    queue_size: int = 10_000     # batches waiting for the publisher thread; then dropped
    ring_size: int = 10_000      # batches kept for replay (ZMQ and WatchEvents)
    ring_bytes: int = 256 << 20  # ... while they hold no more bytes than this
    hwm: int = 100_000           # ZMQ send high-water mark per subscriber
    subscriber_buffer: int = 1_000  # batches one WatchEvents stream may fall behind
    hash_seed: str = DEFAULT_SEED   # block-hash chain seed (vLLM's NONE_HASH seed)
    data_parallel_rank: int = 0  # written into every batch, as vLLM does
    presence: bool = False       # one event when a block arrives on the daemon, one when it left (builder.py)

    def __post_init__(self):
        for name, flag in FLAGS.items():
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if "{namespace}" not in self.topic:
            raise ValueError(f"--kv-events-topic {self.topic!r} must contain {{namespace}}: namespaces "
                             "sharing one topic would mix their blocks, and dropping one would clear the others'")
        if self.data_parallel_rank < 0:
            raise ValueError(f"--kv-events-data-parallel-rank must be >= 0, got {self.data_parallel_rank}")
        if self.replay_endpoint and not self.endpoint:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value and "://" not in value:
                raise ValueError(f"--kv-events-{name.replace('_', '-')} must be a ZMQ address such as "
                                 f"tcp://*:5557 or ipc:///path, got {value!r}")

    def topic_for(self, namespace: str) -> bytes:
        return self.topic.replace("{namespace}", namespace).encode()

    @classmethod
    def from_daemon(cls, config) -> "EventsConfig":
        """From a DaemonConfig's kv_events_* fields (raises ValueError on a bad value)."""
        return cls(
            endpoint=config.kv_events_endpoint,
            replay_endpoint=config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
            queue_size=config.kv_events_queue_size,
            ring_size=config.kv_events_replay_size,
            ring_bytes=config.kv_events_replay_bytes,
            hwm=config.kv_events_hwm,
            subscriber_buffer=config.kv_events_subscriber_buffer,
            hash_seed=config.kv_events_hash_seed,
            presence=config.kv_events_presence,
            data_parallel_rank=config.kv_events_data_parallel_rank,
        )
