"""A start that fails part-way closes what it had opened, in the shutdown order: here
its second listen address is a port in use, after the storage, the KV-event publisher
(its ZMQ port bound) and the first gRPC socket were open. `serve` used to raise and
leave the publisher's thread holding its port and the storage open (only a failure at
the metrics port closed some of it): a Mooncake store stayed mounted in its cluster,
where other daemons' stores could be placed on a segment about to vanish. In-process,
so what is left open shows (a process's exit would hide it)."""

import asyncio
import os
import socket
import threading

import pytest
import zmq

from radixkv_server.config import load_config
from radixkv_server.server import StartupError, serve
from tests.support.daemon import free_port


def test_a_start_failing_at_a_port_in_use_closes_what_it_opened(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    events_port = free_port()
    sock = tmp_path / "radixkv.sock"
    config = load_config(["--listen", f"unix://{sock}", "--listen", f"127.0.0.1:{taken.getsockname()[1]}",
                          "--storage", f"file://{tmp_path}/pages", "--host-pool-size", "16MiB",
                          "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}"], environ={})
    try:
        with pytest.raises(StartupError, match="cannot listen on 127.0.0.1"):
            asyncio.run(serve(config))
    finally:
        taken.close()
    assert not os.path.exists(sock), "the gRPC socket's file is removed"
    assert [t.name for t in threading.enumerate() if t.name.startswith("radixkv")] == [], "every daemon thread ended"
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    try:
        publisher.bind(f"tcp://127.0.0.1:{events_port}")  # the daemon's publisher let it go
    finally:
        publisher.close(linger=0)
        context.term()
