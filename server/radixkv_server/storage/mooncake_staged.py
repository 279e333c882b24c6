"""Whole records through a registered staging buffer, for MooncakeStorage.

The Mooncake Store moves one-part objects faster than two-part ones (measured with the
0.3.13 wheel over TCP: ~35% for gets, ~25% for puts of 64 KiB pages), more than a copy
of the page costs. So a batch of pages moves as whole records (20-byte header, then the
payload) between a registered staging buffer and the store in one batched one-part call
per `max_batch` pages:
- `get`: records land in the buffer, each is checked (length, CRC-32) and its payload
  copied into its page;
- `put`: each page's header and payload are copied into the buffer, then stored.
- `read_ahead`: records land in a buffer that stays taken until the fetch has placed
  them (or dropped them): a prefetch finds its run and reads it in one call.
All answer None when no staging buffer is free (all in use by calls still out) or the
pages differ in size; the caller then moves the pages in place (two parts), or probes
first. A buffer whose call timed out goes back to the pool only once the store lets go
of it.
"""

from contextlib import contextmanager

from .base import Read
from .errors import StorageTimeout
from .record import HEADER_BYTES, header


def get(backend, store, keys: list[bytes], pages: list) -> list[Read] | None:
    """What each key held, its payload copied into its page where it is a HIT; the run
    ends at the first page that is not one. None: read the pages in place instead."""
    record = _record_bytes(pages)
    if record is None:
        return None
    return _staged(backend, record, len(keys), lambda buf, lo, hi: _get_chunk(
        backend, store, buf, record, keys[lo:hi], pages[lo:hi], head=lo == 0), reads=True)


def read_ahead(backend, store, keys: list[bytes], page_bytes: int):
    """(records, give_back): each key's whole record as a view of a staging buffer (None
    where absent, or of another size), and what returns the buffer. None: no buffer is
    free, or the keys take more than one store call."""
    record = HEADER_BYTES + page_bytes
    if len(keys) > backend.max_batch:
        return None
    buf = backend._staging.take(record * len(keys))
    if buf is None:
        return None
    with _given_back_on_failure(backend, buf):
        records = _records(backend, store, buf, record, keys, head=True)
    return records, lambda: backend._staging.give(buf)


def put(backend, store, items: list[tuple[bytes, bytes]]) -> list[int] | None:
    """The store's answer for each (key, payload) record (0: stored, or already
    present). None: put the pages in place instead."""
    record = _record_bytes([p for _, p in items])
    if record is None:
        return None
    return _staged(backend, record, len(items), lambda buf, lo, hi: _put_chunk(
        backend, store, buf, record, items[lo:hi]), reads=False)


def _record_bytes(pages: list) -> int | None:
    size = memoryview(pages[0]).nbytes
    if any(memoryview(p).nbytes != size for p in pages):
        return None
    return HEADER_BYTES + size


def _staged(backend, record: int, n: int, chunk, reads: bool) -> list | None:
    """`chunk(buf, lo, hi)` for each run of max_batch items, in one staging buffer. With
    `reads`, the runs end after one holding a page that is not a HIT (the rest: MISS)."""
    batch = backend.max_batch
    buf = backend._staging.take(record * min(n, batch))
    if buf is None:
        return None
    out: list = []
    with _given_back_on_failure(backend, buf):
        for lo in range(0, n, batch):
            got = chunk(buf, lo, min(lo + batch, n))
            out += got
            if reads and any(r is not Read.HIT for r in got):
                break
    backend._staging.give(buf)
    return out + [Read.MISS] * (n - len(out))


@contextmanager
def _given_back_on_failure(backend, buf):
    """A store call failed: `buf` goes back to the staging pool now, or once the store
    lets go of it (a timeout: it may still write into the buffer)."""
    try:
        yield
    except StorageTimeout as exc:
        exc.settled.add_done_callback(lambda _: backend._staging.give(buf))
        raise
    except BaseException:
        backend._staging.give(buf)
        raise


def _records(backend, store, buf, record: int, keys: list[bytes], head: bool) -> list[memoryview | None]:
    """One batched get of `keys`' whole records into `buf`: each a view of it, None where
    absent, of another size (-600: larger than the page), or its owner is gone (with
    `head`, the keys start the run: StorageUnavailable when the first one's is)."""
    base = buf.ctypes.data
    names = [backend.store_key(k) for k in keys]
    codes = backend.answered("get", backend._calls.run("get", store.batch_get_into, names,
                                                       [base + i * record for i in range(len(keys))],
                                                       [record] * len(keys)), len(keys))
    backend.owners.read(codes, sum(1 for c in codes if c == record), head)
    return [memoryview(buf[i * record:(i + 1) * record]) if code == record else None
            for i, code in enumerate(codes)]


def _get_chunk(backend, store, buf, record: int, keys: list[bytes], pages: list, head: bool) -> list[Read]:
    return [Read.MISS if r is None else backend._place(key, r, page)
            for key, page, r in zip(keys, pages, _records(backend, store, buf, record, keys, head))]


def _put_chunk(backend, store, buf, record: int, items: list[tuple[bytes, bytes]]) -> list[int]:
    view = memoryview(buf)
    for i, (key, payload) in enumerate(items):
        at = i * record
        staged = view[at + HEADER_BYTES:at + record]
        staged[:] = memoryview(payload).cast("B")
        view[at:at + HEADER_BYTES] = header(key, staged)  # checksummed where the copy left it in cache
    names = [backend.store_key(k) for k, _ in items]
    base = buf.ctypes.data
    return backend.answered("put", backend._calls.run("put", store.batch_put_from, names,
                                                      [base + i * record for i in range(len(names))],
                                                      [record] * len(names), backend._config()), len(names))
