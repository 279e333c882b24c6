"""An engine process to be SIGKILLed with copies in flight:

    python -m tests.soak.victim <target> <namespace>

Registers (write_back), caches PREFIXES on device and evicts them to host, then leaves
work in flight: a leased match, a load-back it never acknowledges, a second one it
acknowledges while the copy still runs, and an eviction whose write-back is still
copying. Prints READY once the daemon reports those copies in flight, then waits to be
killed. Start the daemon with --fault-copy-delay so the copies last.
"""

import sys
import threading

from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.layout import KvLayout
from radixkv.sim.kv import KvPattern, page_keys
from radixkv.types import pack

from tests.support.daemon import wait_for

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
NUM_PAGES = 64
PREFIXES = [pack(range(base, base + 16)) for base in (0, 1000, 2000)]  # 4 pages each
LATE = pack(range(5000, 5016))  # cached on device only, evicted (written back) at the end


def main(target: str, namespace: str) -> None:
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    kv = KvPattern(LAYOUT, [buffers.buffer(i) for i in range(LAYOUT.num_buffers)], NUM_PAGES)
    c = Client(target, timeout=30)
    c.register(namespace, LAYOUT, buffers.specs(), NUM_PAGES, write_policy="write_back",
               host_pool_pages=256, engine="victim")
    for i, tokens in enumerate(PREFIXES):
        pages = list(range(4 * i, 4 * i + 4))
        kv.write(pages, page_keys(tokens, 4))
        c.insert(tokens, pages)
    assert len(c.evict(12).freed_pages) == 12
    m0, m1 = c.match(PREFIXES[:2], lease=True)
    assert m0.host_tokens == 16 and m1.host_tokens == 16
    unacked = c.load_back(m0.host_node, [20, 21, 22, 23])
    acked = c.load_back(m1.host_node, [24, 25, 26, 27])
    threading.Thread(target=c.wait, args=([acked.transfer],), daemon=True).start()
    kv.write([30, 31, 32, 33], page_keys(LATE, 4))
    c.insert(LATE, [30, 31, 32, 33])
    threading.Thread(target=c.evict, args=(4,), daemon=True).start()  # writes LATE back first

    def in_flight():
        [ns] = c.stats(namespace).namespaces
        return ns.transfers_in_flight >= 3 and ns.device_pages_protected > 0

    wait_for(in_flight, 20, "load-backs and a write-back in flight")
    print("READY", unacked.transfer, acked.transfer, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
