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


def config_with_a_port_in_use(tmp_path, taken: socket.socket, events_port: int):
    return load_config(["--listen", f"unix://{tmp_path}/radixkv.sock", "--listen",
                        f"127.0.0.1:{taken.getsockname()[1]}", "--storage", f"file://{tmp_path}/pages",
                        "--host-pool-size", "16MiB", "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}"],
                       environ={})


def listening() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def test_a_start_failing_at_a_port_in_use_closes_what_it_opened(tmp_path):
    taken = listening()
    events_port = free_port()
    sock = tmp_path / "radixkv.sock"
    config = config_with_a_port_in_use(tmp_path, taken, events_port)
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


def test_a_closing_step_that_fails_leaves_the_start_error_and_the_other_steps(tmp_path, monkeypatch, caplog):
    """The storage's close raising while a failed start unwinds: the start's own error is
    what `serve` raises (exit 2 or 1 as it says), the failure is logged, and the steps
    after it still run (it replaced the start's error with a traceback, and stopped the
    unwinding there)."""
    from radixkv_server.storage.file import FileStorage

    def broken_close(self):
        raise OSError("the disk went away")
    monkeypatch.setattr(FileStorage, "close", broken_close)
    taken = listening()
    try:
        with pytest.raises(StartupError, match="cannot listen on 127.0.0.1"):
            asyncio.run(serve(config_with_a_port_in_use(tmp_path, taken, free_port())))
    finally:
        taken.close()
    [failed] = [r.fields for r in caplog.records if r.getMessage() == "shutdown.step_failed"]
    assert failed["step"] == "storage" and "the disk went away" in failed["error"]
    assert [t.name for t in threading.enumerate() if t.name.startswith("radixkv")] == [], "the later steps ran"
