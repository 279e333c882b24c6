"""EventsConfig: the proposed daemon fields map onto it, and bad values are refused with
messages that name the setting."""

from types import SimpleNamespace

import pytest

from radixkv_server.events import EventsConfig


def test_from_daemon_maps_the_proposed_fields():
    daemon = SimpleNamespace(
        kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="tcp://*:5558",
        kv_events_topic="kv@pod-3@{namespace}", kv_events_queue_size=5, kv_events_replay_size=6,
        kv_events_replay_bytes=9, kv_events_hwm=7, kv_events_subscriber_buffer=8, kv_events_hash_seed="fleet-seed",
        kv_events_presence=True, kv_events_data_parallel_rank=3)
    c = EventsConfig.from_daemon(daemon)
    assert (c.endpoint, c.replay_endpoint, c.queue_size, c.ring_size, c.ring_bytes, c.hwm, c.subscriber_buffer,
            c.hash_seed, c.presence, c.data_parallel_rank) == ("tcp://*:5557", "tcp://*:5558", 5, 6, 9, 7, 8,
                                                               "fleet-seed", True, 3)
    assert c.topic_for("llama/tp0") == b"kv@pod-3@llama/tp0"


@pytest.mark.parametrize("kwargs, message", [
    ({"queue_size": 0}, "--kv-events-queue-size must be >= 1, got 0"),
    ({"ring_size": 0}, "--kv-events-replay-size must be >= 1"),  # the flag, not the field
    ({"ring_bytes": 0}, "--kv-events-replay-bytes must be >= 1"),
    ({"replay_endpoint": "tcp://*:5558"}, "needs --kv-events-endpoint"),
    ({"endpoint": "localhost:5557"}, "ZMQ address"),
    ({"topic": "kv-events"}, "must contain {namespace}: namespaces sharing one topic would mix"),
    ({"data_parallel_rank": -1}, "--kv-events-data-parallel-rank must be >= 0"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EventsConfig(**kwargs)


def test_an_unusable_endpoint_is_a_clear_error():
    from radixkv_server.events import EventHub

    with pytest.raises(ValueError, match="cannot open tcp://\\*:notaport"):
        EventHub(EventsConfig(endpoint="tcp://*:notaport"))


def test_the_defaults_are_the_daemons_and_a_bad_setting_is_refused_with_the_others():
    """EventsConfig's defaults are DaemonConfig's kv_events_* defaults, and a bad
    kv_events_* setting fails `load_config` like any flag, before the daemon opens its
    storage (it was refused only inside `serve`, after a Mooncake join of seconds)."""
    from radixkv_server.config import DaemonConfig, load_config

    assert EventsConfig.from_daemon(DaemonConfig()) == EventsConfig()
    with pytest.raises(ValueError, match="--kv-events-topic 'kv' must contain {namespace}"):
        load_config(["--kv-events-topic", "kv"], environ={})
    with pytest.raises(ValueError, match="--kv-events-hwm must be >= 1"):
        load_config([], environ={"RADIXKV_KV_EVENTS_HWM": "0"})
