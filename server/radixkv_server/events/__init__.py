"""KV events for KV-aware routers: what each tier of each namespace holds, published in
vLLM's wire format (ZMQ PUB + ROUTER replay) and fanned out in process (WatchEvents).

- `EventHub` (hub.py): the loop side; `attach()` gives the core's residency listener.
- `Publisher` (publisher.py): the thread that builds, encodes, numbers and sends batches.
- `Broadcast` / `Subscription` (fanout.py): replay ring and bounded per-reader buffers.
- `EventBuilder` (builder.py): residency records -> BlockStored / BlockRemoved events.
- Wire format and block hashes live in the client package (`radixkv.routing.wire`,
  `radixkv.routing.blockhash`) so routers use them without importing the daemon.
See docs/events.md.
"""

from .config import EventsConfig
from .fanout import (
    AsyncSubscription, Broadcast, PublishedBatch, ReplayUnavailable, SubscriberLagged, Subscription,
)
from .hub import EventHub, NamespaceEvents, resident

__all__ = [
    "AsyncSubscription", "Broadcast", "EventHub", "EventsConfig", "NamespaceEvents",
    "PublishedBatch", "ReplayUnavailable", "SubscriberLagged", "Subscription", "resident",
]
