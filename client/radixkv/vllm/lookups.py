"""The scheduler's own daemon session: lookups that never block vLLM's scheduler.

vLLM asks `get_num_new_matched_tokens` for a waiting request, possibly several times.
The first ask queues its prompt here and answers None ("ask again next step"). At the
end of the scheduler step (`send`, from build_connector_meta) whatever was asked goes
out in one batched Match with leases on the session stream (several, when a burst of
waiting requests passes the daemon's prompts per Match or MATCH_BYTES of keys); a later
ask gets the hit.

The session is an `AsyncClient` on the connector's own event loop, which the scheduler's
calls run in short passes (`radixkv.vllm.pump`): `send` writes the Match in one, and the
first ask of the next step reads what landed in another, both on the scheduler's thread,
tens of microseconds each and no thread in between. A prompt whose Match says storage
holds more is staged meanwhile (Prefetch, waiting for it, and Match again, that first
Match's lease kept until then), as a task on the same loop. A Match that fails, or stays
unanswered past the session's timeout, gives misses. So does every lookup while the
session is lost: they answer at once, and a task of their loop registers the session
again (one attempt at a time, paced by the client's backoff), so that no request waits
on a registration that a daemon which stopped answering would hold for the timeout.
Failing lookups log a warning once, and a line when they are answered again.

A hit holds its lease until the caller takes it over (`take`, for a load whose ranks then
report back) or drops it (`drop`: not loaded, finished, aborted). `drop` is idempotent and
also covers a lookup still queued or in flight (its lease is released when it lands).
Releases go out in the next pass (the watchdog's within a few milliseconds when the
engine stops stepping).

For vLLM's metrics it counts prompts looked up, lookups the daemon did not answer and
prompts staged from storage (`take_counts`), and times each lookup from the first ask to
the ask that gets its answer (`take_waits`: how long the request waited for radixkv);
`storage` is the daemon's storage tier as Register named it.
"""

import asyncio
import logging
from collections import Counter
from time import perf_counter

from radixkv.aio import AsyncClient
from radixkv.errors import NotFound, RadixKVError, Unavailable
from radixkv.layout import KvLayout
from radixkv.types import Prompt

from .config import ConnectorConfig
from .daemon import MISS, Hit, hit_of, register_options, registration_refused
from .outages import OutageLog, RegisteringAgain
from .pump import LoopPump

log = logging.getLogger("vllm.radixkv")  # vLLM's log handlers show it

# A step's lookups go out in Matches of at most the daemon's --max-prompts-per-match
# prompts (Register says it; OLDER_DAEMON_PROMPTS, its default, from a daemon too old to
# say) and about MATCH_BYTES of token and extra-key bytes (a longer prompt goes alone;
# half the smallest --max-message-size a daemon takes): vLLM asks for every waiting
# request in a step, and one Match past either limit was refused whole, every lookup of
# the step a miss.
OLDER_DAEMON_PROMPTS = 4096
MATCH_BYTES = 512 << 10


def batches(prompts: dict[str, Prompt], most: int) -> list[dict[str, Prompt]]:
    """`prompts` (request id -> prompt), in order, in batches of at most `most` prompts
    and about MATCH_BYTES of keys each."""
    out: list[dict[str, Prompt]] = []
    batch: dict[str, Prompt] = {}
    size = 0
    for req_id, prompt in prompts.items():
        n = len(prompt.tokens) + len(prompt.extra_key)
        if batch and (len(batch) >= most or size + n > MATCH_BYTES):
            out.append(batch)
            batch, size = {}, 0
        batch[req_id] = prompt
        size += n
    if batch:
        out.append(batch)
    return out


class Lookups:
    """Batched, asynchronous Match per request id on the scheduler's session. Every
    table is guarded by the pump's lock, which the loop's passes hold."""

    def __init__(self, pump: LoopPump, client: AsyncClient, storage: str = ""):
        self._pump = pump
        self._client = client
        self.storage = storage
        self._counts: Counter = Counter()
        self._asked: dict[str, float] = {}  # request -> when first asked, until its answer is read
        self._waits: list[float] = []  # seconds from a first ask to its answer, since take_waits
        self._queued: dict[str, Prompt] = {}  # asked this step, not sent yet
        self._inflight: set[str] = set()  # in a Match (or staging) now
        self._hits: dict[str, Hit] = {}
        self._dropped: set[str] = set()  # dropped while its Match was in flight
        self._releases: list[int] = []  # leases for the next Release
        self._steps = 0  # build_connector_meta calls so far
        self._read_at = -1  # the step whose answers were last read
        self._registering: asyncio.Task | None = None  # registering a lost session again
        self._registering_log = RegisteringAgain(log, "scheduler")
        self._failing = OutageLog(log, "lookups fail and are treated as misses until the daemon answers",
                                  "lookups answered again")

    @classmethod
    def open(cls, config: ConnectorConfig, layout: KvLayout, *, engine: str, tp_size: int,
             instance: str) -> "Lookups":
        """Register the scheduler's session (role "scheduler": Match and Release, no
        buffers) with the layout the workers register. Raises RuntimeError (vLLM fails to
        start) when the daemon is unreachable within connect_timeout_s or refuses."""
        pump = LoopPump()

        async def attach() -> tuple[AsyncClient, str]:
            client = AsyncClient(config.target, timeout=config.timeout_s, stream=True, **config.channel())
            try:
                await client.wait_ready(config.connect_timeout_s)
                reg = await client.register(config.namespace, layout, [], 0,
                                            **register_options(config, engine=engine, role="scheduler",
                                                               tp_size=tp_size, instance=instance))
            except BaseException:
                await client.close()
                raise
            return client, reg.storage

        try:
            client, storage = pump.run(attach())
        except RadixKVError as e:
            pump.close()
            raise registration_refused(config, "scheduler", e) from None
        log.info("radixkv: scheduler registered with %s, namespace %r", config.target, config.namespace)
        return cls(pump, client, storage)

    def poll(self, req_id: str, tokens) -> Hit | None:
        """The hit for `req_id` (the same one on every call until taken or dropped), or
        None while its lookup is queued or in flight (the first call queues `tokens()`,
        the prompt as radixkv keys it, called only then; `send` sends it). The first call
        of a step with lookups in flight reads the answers that landed."""
        if self._inflight and self._read_at != self._steps:
            self._read_at = self._steps
            self._pump.tick()
        with self._pump.lock:
            hit = self._hits.get(req_id)
            if hit is None and req_id not in self._inflight and req_id not in self._queued:
                self._asked[req_id] = perf_counter()
                self._queued[req_id] = Prompt.of(tokens())
            elif hit is not None and req_id in self._asked:
                self._waits.append(perf_counter() - self._asked.pop(req_id))
        return hit

    def send(self) -> None:
        """End of a scheduler step: what was asked goes out in one Match (and what was
        released in one Release), written now."""
        self._steps += 1
        with self._pump.lock:
            asked, self._queued = self._queued, {}
            self._inflight.update(asked)
            for batch in batches(asked, self._prompts_per_match()):
                self._pump.spawn(self._lookup(batch))
            if not asked and not self._releases:
                return
        self._pump.tick()

    def _prompts_per_match(self) -> int:
        registration = self._client.registration if self._client is not None else None
        return (registration.max_prompts_per_match if registration is not None else 0) or OLDER_DAEMON_PROMPTS

    def take_counts(self) -> Counter:
        """The counts since the last call (see the module's docstring), then zero."""
        with self._pump.lock:
            counts, self._counts = self._counts, Counter()
        return counts

    def take_waits(self) -> list[float]:
        """Seconds from each lookup's first ask to the ask that got its answer, since the
        last call (a lookup dropped before its answer was read has none)."""
        with self._pump.lock:
            waits, self._waits = self._waits, []
        return waits

    def take(self, req_id: str) -> Hit:
        """Forget `req_id`'s hit without releasing it: the caller now owns its lease
        (`release` it later). MISS when there is none."""
        with self._pump.lock:
            return self._hits.pop(req_id, MISS)

    def drop(self, req_id: str) -> None:
        """Forget `req_id` and release its lease, now or when its Match lands (idempotent)."""
        with self._pump.lock:
            hit = self._hits.pop(req_id, None)
            self._queued.pop(req_id, None)
            self._asked.pop(req_id, None)
            if req_id in self._inflight:
                self._dropped.add(req_id)
            if hit is not None:
                self.release(hit.lease)

    def drop_all(self) -> None:
        """`drop` every request queued, in flight or holding a hit."""
        with self._pump.lock:
            for req_id in [*self._hits, *self._queued, *self._inflight]:
                self.drop(req_id)

    def release(self, lease: int) -> None:
        """Release a lease taken over with `take` (in the next pass; 0 is ignored)."""
        if lease:
            with self._pump.lock:
                if not self._releases and self._client is not None:
                    self._pump.spawn(self._release_soon())
                self._releases.append(lease)

    def close(self) -> None:
        """Release every lease still held and end the session (the daemon releases the
        leases of answers still on their way with it), then stop the loop. Idempotent."""
        with self._pump.lock:
            if self._client is None:
                return
            leases = [h.lease for h in self._hits.values() if h.lease] + self._releases
            self._hits.clear()
            self._releases = []
            client, self._client = self._client, None

        async def end() -> None:
            try:
                if leases:
                    await client.release(leases)
            except RadixKVError as e:
                log.warning("radixkv: releasing %d leases at close failed: %s", len(leases), e)
            await client.close()

        try:
            self._pump.run(end(), timeout=2 * client.timeout)
        except (RadixKVError, TimeoutError) as e:
            log.warning("radixkv: closing the scheduler's session: %s", e)
        self._pump.close()

    # -- tasks on the loop (in passes: the pump's lock is held) ------------------------

    async def _lookup(self, batch: dict[str, Prompt]) -> None:
        prompts, client = list(batch.values()), self._client
        if client is None:
            return  # closed: the daemon released its leases with the session
        self._counts["lookups"] += len(prompts)
        try:
            if client.session_lost:
                self._register_again(client)
                raise Unavailable("the scheduler's session is lost and being registered again")
            results = await client.match(prompts, lease=True, include_storage=True)
        except RadixKVError as e:
            self._counts["lookup_failures"] += len(prompts)
            self._failing.failed(e)
            results = [None] * len(prompts)
        else:
            self._failing.worked()
        staging = []
        for (req_id, prompt), result in zip(batch.items(), results):
            if result is not None and result.storage_tokens:
                staging.append(self._stage(client, req_id, prompt, result))
            else:
                self._file(req_id, MISS if result is None else hit_of(result))
        if staging:
            await asyncio.gather(*staging)

    async def _stage(self, client: AsyncClient, req_id: str, prompt: Prompt, found) -> None:
        """A prompt with more in storage: fetched to host (Prefetch, waiting for it) and
        matched again while `found`'s lease keeps the host part; where the daemon cannot
        answer, `found`'s hit (lease kept)."""
        try:
            await client.prefetch(prompt.tokens, extra_key=prompt.extra_key, policy="wait_complete")
            [again] = await client.match([prompt], lease=True, include_storage=True)
        except RadixKVError as e:
            log.warning("radixkv: staging a prompt from storage failed, its host hit kept: %s", e)
            self._file(req_id, hit_of(found))
            return
        self.release(found.lease)
        self._counts["staged"] += 1
        self._file(req_id, hit_of(again, on_host=found.complete_tokens))

    def _register_again(self, client: AsyncClient) -> None:
        """Register the lost session in a task of its own (one at a time)."""
        if self._registering is None or self._registering.done():
            self._registering = self._pump.spawn(self._reconnect(client))

    async def _reconnect(self, client: AsyncClient) -> None:
        try:
            lost = await client.reconnect(timeout=0)  # one attempt, if the backoff lets it
        except RadixKVError as e:
            self._registering_log.failed(e)
            return
        self._registering_log.worked()
        if lost is not None:
            log.warning("radixkv: scheduler: %s", lost)

    async def _release_soon(self) -> None:
        """One Release of every lease released before this task ran."""
        leases, self._releases = self._releases, []
        if not leases or self._client is None:
            return  # close took them
        client = self._client
        try:
            await client.release(leases)
        except NotFound:  # some from a session lost since (a restarted daemon): release the rest
            await self._release_each(client, leases)
        except RadixKVError as e:
            log.warning("radixkv: releasing %d leases failed: %s", len(leases), e)

    async def _release_each(self, client: AsyncClient, leases: list[int]) -> None:
        """A Release answers all or nothing; one by one, the leases the daemon no
        longer knows (taken before it restarted, or expired) are skipped."""
        gone = 0
        for lease in leases:
            try:
                await client.release([lease])
            except NotFound:
                gone += 1
            except RadixKVError as e:
                log.warning("radixkv: releasing lease %d failed: %s", lease, e)
        log.debug("radixkv: %d of %d leases released were no longer held", gone, len(leases))

    def _file(self, req_id: str, hit: Hit) -> None:
        self._inflight.discard(req_id)
        if req_id in self._dropped:
            self._dropped.discard(req_id)
            self.release(hit.lease)
        else:
            self._hits[req_id] = hit


__all__ = ["Lookups"]
