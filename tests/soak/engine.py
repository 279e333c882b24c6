"""ChaosEngine: a simulated engine that keeps going through daemon kills and restarts and
checks that a cache failure never becomes wrong output.

    python -m tests.soak.engine --target T --namespace N --policy write_back --seed 1 \\
        --stats /tmp/x/e1.json --stop /tmp/x/stop --ready /tmp/x/e1.ready [--storage]

Each step matches a small batch of prompts (shared system prompts, random suffixes,
two extra keys) with leases, loads host hits back, waits for every transfer the
prefix depends on, then reads the prefix: every page the daemon said is valid must
hold exactly the pattern of its tokens (`KvPattern`), else the bytes are counted as
mismatches. With --storage (a daemon with a storage tier) a Match also asks what storage
holds past host; such a prompt is prefetched (wait_complete) and matched again, the
first match's lease kept until then, so pages a daemon stored before it was killed come
back through storage and are verified like any other. It then "prefills" the rest and
inserts it. A load that failed, a call
that failed, a session that was lost: those tokens are recomputed, never read.

Faults it survives: `SessionLost`/`DaemonRestarted` (drop the whole device view: every
page is the engine's again), `Unavailable` (wait for the daemon with `reconnect`).
With --stall it also misbehaves like a stuck engine now and then (never acknowledges
a load-back, forgets a lease), which the daemon's ack/lease timeouts must clean up.
Counts go to --stats (JSON, rewritten every half second, so a SIGKILL loses little),
with the message of every client error no fault explains (`error_messages`, the first
MAX_ERROR_MESSAGES): the soak's verdict fails on any of them and prints them. --ready
names a file created once the engine has registered, so the soak injects its faults
only into engines that are up (an engine process may take seconds to import torch).
"""

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from radixkv.client import Client
from radixkv.errors import NotFound, RadixKVError, SessionLost, Unavailable
from radixkv.layout import KvLayout
from radixkv.reconnect import Backoff
from radixkv.sim.kv import page_keys
from radixkv.types import Prompt, pack

from tests.support.engine import EngineDouble

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", page_size=4)
NUM_PAGES = 160
HOST_PAGES = 384
PS = LAYOUT.page_size
MAX_ERROR_MESSAGES = 10


@dataclass
class Counts:
    steps: int = 0
    requests: int = 0
    prefix_pages_verified: int = 0   # pages read after the daemon said they were valid
    bytes_verified: int = 0
    byte_mismatches: int = 0
    device_hit_pages: int = 0
    host_loaded_pages: int = 0
    prefetches: int = 0              # prompts staged from storage (--storage)
    staged_pages: int = 0            # pages a prefetch brought to host, then matched on host
    load_backs: int = 0
    failed_loads: int = 0            # reported failed (copy, ack refused, daemon lost)
    session_losses: int = 0          # SessionLost / DaemonRestarted seen
    daemon_restarts: int = 0
    unavailable: int = 0             # calls refused while the daemon was away
    ambiguous: int = 0               # a call failed but the session lived: pages set aside
    stalls: int = 0                  # load-backs never acknowledged, leases never released
    expired: int = 0                 # own leases the daemon had expired when used
    protocol_errors: int = 0
    fault_errors: int = 0            # calls failed while the daemon went away (session lost after)
    errors: int = 0                  # client errors no fault explains: each one fails the soak
    error_messages: list = field(default_factory=list)  # their messages (the first few)


class ChaosEngine(EngineDouble):
    """The engine double (`tests.support.engine`: buffers, pattern KV, page pool,
    allocation) driven by random scheduler steps that survive daemon faults."""

    def __init__(self, target: str, namespace: str, policy: str, seed: int, stall: float = 0.0,
                 storage: bool = False):
        super().__init__(LAYOUT, NUM_PAGES)
        self.rng = random.Random(seed)
        self.namespace = namespace
        self.policy = policy
        self.stall = stall
        self.storage = storage
        self.counts = Counts()
        self.page_bytes = LAYOUT.page_bytes
        client = Client(target, timeout=30, reconnect=Backoff(initial=0.05, maximum=1.0))
        client.wait_ready(60)
        self.register(client, namespace, write_policy=policy, host_pool_pages=HOST_PAGES,
                      replace_existing=True, engine=f"chaos pid {os.getpid()}")
        self.stop_file = ""
        self.systems = [pack(self.rng.randrange(1, 30000) for _ in range(PS * self.rng.randint(2, 8)))
                        for _ in range(12)]
        self.chats: list[tuple[bytes, bytes]] = []  # earlier prompts, continued like chat turns

    # -- the loop ----------------------------------------------------------------------

    def run(self, stop_file: str, stats_file: str, max_seconds: float) -> None:
        self.stop_file = stop_file
        end = time.monotonic() + max_seconds
        last = 0.0
        while not os.path.exists(stop_file) and time.monotonic() < end:
            self.guarded_step()
            if time.monotonic() - last > 0.5:
                last = time.monotonic()
                self.save(stats_file)
        self.save(stats_file)

    def guarded_step(self) -> None:
        try:
            self.step()
        except SessionLost as e:
            self.lost(e)
        except Unavailable:
            self.counts.unavailable += 1
            self.wait_for_daemon()
        except RadixKVError as e:
            if self.wait_for_daemon():
                self.counts.fault_errors += 1  # the daemon went away meanwhile (e.g. CANCELLED at SIGTERM)
                return
            self.counts.errors += 1
            if len(self.counts.error_messages) < MAX_ERROR_MESSAGES:
                self.counts.error_messages.append(f"{type(e).__name__}: {str(e)[:300]}")

    def wait_for_daemon(self) -> bool:
        """After a failed call: block until there is a session again; True when the old
        one was lost (the daemon restarted: that explains the failure). A new one means
        the device view is gone; the same one means the failed call's effect is unknown,
        so the pages this step had in use are set aside for good (never reused)."""
        while not os.path.exists(self.stop_file):
            try:
                lost = self.client.reconnect(timeout=5)
            except SessionLost as e:  # a call raced us to it
                lost = e
            except RadixKVError:
                continue
            if lost is not None:
                self.lost(lost)
                return True
            if self.pool.num_in_use:
                self.counts.ambiguous += 1  # in-use pages stay in use: leaked on purpose
            return False
        return False

    def lost(self, e: SessionLost) -> None:
        self.counts.session_losses += 1
        self.counts.daemon_restarts += type(e).__name__ == "DaemonRestarted"
        self.forget_cache()  # the daemon holds none of our pages any more

    # -- one scheduler step --------------------------------------------------------------

    def prompt(self) -> tuple[bytes, bytes]:
        """A new prompt on a shared system prompt, or the next turn of an earlier one."""
        rng = self.rng
        turn = pack(rng.randrange(1, 30000) for _ in range(rng.randint(0, 4 * PS + PS - 1)))
        if self.chats and rng.random() < 0.5:
            i = rng.randrange(len(self.chats))
            tokens, extra = self.chats[i]
            if len(tokens) + len(turn) > 40 * PS * 4:
                tokens = rng.choice(self.systems)  # long enough: the chat starts over
            self.chats[i] = (tokens + turn, extra)
            return self.chats[i]
        prompt = (rng.choice(self.systems) + turn, rng.choice((b"", b"", b"lora-7")))
        if len(self.chats) < 48:
            self.chats.append(prompt)
        else:
            self.chats[rng.randrange(48)] = prompt
        return prompt

    def step(self) -> None:
        c, counts = self.client, self.counts
        counts.steps += 1
        batch = [self.prompt() for _ in range(self.rng.randint(1, 3))]
        prompts = [Prompt(t, x) for t, x in batch]
        matches = c.match(prompts, lease=True, include_storage=self.storage)
        if self.storage:
            matches = [self.staged(p, m) for p, m in zip(prompts, matches)]
        plans = []
        for (tokens, extra), m in zip(batch, matches):
            prefix = list(m.device_pages)
            if len(prefix) * PS != m.device_tokens or not self.pool.all_cached(prefix, "Match prefix"):
                counts.protocol_errors += 1
                prefix = []
            deps = set(m.depends_on)
            counts.device_hit_pages += len(prefix)
            if m.host_tokens and prefix is not None:
                prefix, deps = self.load_host(m, prefix, deps)
            plans.append((tokens, extra, m.lease, prefix, deps))
        wanted = set().union(*(p[4] for p in plans))
        outcomes = c.wait(wanted, timeout=30) if wanted else {}
        for t, o in outcomes.items():
            if not o.ok:
                counts.failed_loads += 1
                self.pool.from_cache(o.failed_pages, "failed load")
        for tokens, extra, lease, prefix, deps in plans:
            if any(not outcomes[t].ok for t in deps):
                prefix = []  # recompute: never read what did not arrive
            self.finish(tokens, extra, lease, prefix)
        if self.rng.random() < 0.1:
            self.evict(self.rng.randint(1, 24))

    def staged(self, prompt: Prompt, m):
        """`m`, or where storage holds more: the Match after prefetching it to host (the
        first lease released once the second holds the path)."""
        if not m.storage_tokens:
            return m
        self.client.prefetch(prompt.tokens, extra_key=prompt.extra_key, policy="wait_complete")
        [again] = self.client.match([prompt], lease=True, include_storage=True)
        self.release(m.lease)
        self.counts.prefetches += 1
        self.counts.staged_pages += max(0, again.device_tokens + again.host_tokens
                                        - m.device_tokens - m.host_tokens) // PS
        return again

    def load_host(self, m, prefix: list[int], deps: set[int]):
        need = m.host_tokens // PS
        pages = self.allocate(need, partial=True)
        if not pages:
            return prefix, deps
        try:
            lb = self.client.load_back(m.host_node, pages)
        except NotFound:  # the host copy went away since the match: a miss
            self.pool.free(pages, "LoadBack refused")
            return prefix, deps
        unused = set(lb.unused_pages)
        self.pool.free([p for p in pages if p in unused], "LoadBack unused")
        self.pool.to_cache([p for p in pages if p not in unused], "LoadBack used")
        full = list(lb.device_pages)
        if full[:len(prefix)] != prefix or not self.pool.all_cached(full, "LoadBack prefix"):
            self.counts.protocol_errors += 1
            return [], deps
        deps = deps | set(lb.depends_on)
        if lb.transfer:
            self.counts.load_backs += 1
            if self.stall and self.rng.random() < self.stall:
                self.counts.stalls += 1  # never acknowledged: the daemon's ack_timeout ends it
                return prefix, deps
            deps.add(lb.transfer)
            self.counts.host_loaded_pages += len(full) - len(prefix)
        return full, deps

    def finish(self, tokens: bytes, extra: bytes, lease: int, prefix: list[int]) -> None:
        counts = self.counts
        keys = page_keys(tokens, PS, extra)
        keys_whole = len(tokens) // 4 // PS
        prefix = prefix[:keys_whole]
        bad, _ = self.kv.mismatches(prefix, keys[:len(prefix)])
        counts.byte_mismatches += bad
        counts.prefix_pages_verified += len(prefix)
        counts.bytes_verified += len(prefix) * self.page_bytes
        new = self.allocate(len(keys) - len(prefix))
        if new is None:
            self.release(lease)
            return
        self.kv.write(new, keys[len(prefix):])
        counts.requests += 1
        own, tail = new[:keys_whole - len(prefix)], new[keys_whole - len(prefix):]
        if keys_whole:
            if self.stall and self.rng.random() < self.stall:
                counts.stalls += 1
                lease = 0  # forgotten: the daemon's lease_timeout releases it
            try:
                res = self.client.insert(tokens[:keys_whole * PS * 4], prefix + own, extra_key=extra,
                                         release_lease=lease)
            except NotFound:  # the lease expired (a slow step): refused before any change
                counts.expired += 1
                res = self.client.insert(tokens[:keys_whole * PS * 4], prefix + own, extra_key=extra)
            redundant = set(res.redundant_pages)
            self.pool.free(res.redundant_pages, "Insert redundant")
            self.pool.to_cache([p for p in own if p not in redundant], "Insert")
        else:
            self.release(lease)
        self.pool.free(tail, "tail")

    def release(self, lease: int) -> None:
        if lease and not (self.stall and self.rng.random() < self.stall):
            try:
                self.client.release([lease])
            except NotFound:
                self.counts.expired += 1

    # -- reporting ---------------------------------------------------------------------

    def save(self, path: str) -> None:
        out = asdict(self.counts)
        out["pool_errors"] = self.pool.errors
        out["pool_messages"] = self.pool.messages[:5]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak.engine")
    p.add_argument("--target", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--policy", default="write_back")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall", type=float, default=0.0, help="probability of a stuck-engine misstep")
    p.add_argument("--stats", required=True)
    p.add_argument("--stop", required=True, help="stop once this file exists")
    p.add_argument("--max-seconds", type=float, default=3600)
    p.add_argument("--ready", default="", help="create this file once registered")
    p.add_argument("--storage", action="store_true", help="the daemon has a storage tier: prefetch from it")
    a = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    engine = ChaosEngine(a.target, a.namespace, a.policy, a.seed, a.stall, a.storage)
    if a.ready:
        open(a.ready, "w").close()
    try:
        engine.run(a.stop, a.stats, a.max_seconds)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
