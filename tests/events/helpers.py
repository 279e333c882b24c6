"""Small real trees and bounded waits for the KV-event tests."""

import os
import tempfile
import threading
import time

import numpy as np

from radixkv_server.core.tree import RadixTree
from radixkv_server.events.hub import token_path

PAGE = 4


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.001)


def packed(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def ipc_endpoints(tag: str) -> tuple[str, str]:
    """A PUB and a ROUTER ipc:// address in a fresh temporary directory."""
    d = tempfile.mkdtemp(prefix=f"rkv-ev-{tag}-")
    return f"ipc://{os.path.join(d, 'pub')}", f"ipc://{os.path.join(d, 'replay')}"


def chain(tree: RadixTree, *runs, extra_key: bytes = b""):
    """Nodes root -> leaf with the given token runs (each whole pages)."""
    node = tree.root(extra_key)
    out = []
    for run in runs:
        node = tree.add_child(node, packed(run))
        out.append(node)
    return out


def path_of(node) -> tuple:
    """A residency record's path: cells (id, key, parent's cell) from `node` up to the root."""
    return token_path(node)


class StuckJob:
    """A publisher job whose build blocks until `release` is set (`entered` once it runs):
    a publisher thread stuck in a job, as behind a socket that never drains."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def build(self, records):
        self.entered.set()
        self.release.wait(60)
        return [], []

    def job(self) -> tuple:
        return (self, "", b"kv@stuck", 0.0, [])
