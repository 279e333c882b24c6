"""MooncakeStorage never pairs a store answer with the wrong key: a batch call that
answers fewer (or more) results than it was given keys raises StorageUnavailable. The
real store client cannot be made to do that, so a stand-in answers here; everything
else (slots, staging buffers, call threads) is the backend's own."""

import numpy as np
import pytest

from radixkv_server.storage import StorageUnavailable
from radixkv_server.storage.mooncake_store import MooncakeStorage

PAGE = 4096
KEYS = [bytes([i]) * 32 for i in range(4)]


class ShortStore:
    """A joined store client whose batch calls answer one result fewer than asked."""

    def __init__(self, present: int = 0):
        self.present = present  # batch_is_exist's answer for each key (1: present)

    def batch_is_exist(self, names):
        return [self.present] * (len(names) - 1)

    def batch_get_into(self, names, ptrs, sizes):
        return list(sizes[:-1])  # "whole" records, one short

    def batch_get_into_multi_buffers(self, names, ptrs, sizes):
        return [sum(s) for s in sizes[:-1]]

    def get_batch(self, names):
        return [b""] * (len(names) - 1)

    def batch_put_from(self, names, ptrs, sizes, config):
        return [0] * (len(names) - 1)

    def batch_put_from_multi_buffers(self, names, ptrs, sizes, config):
        return [0] * (len(names) - 1)

    def register_buffer(self, address, nbytes):
        return 0


@pytest.fixture(params=["staged", "direct"])
def backend(request):
    b = MooncakeStorage("127.0.0.1:1", segment_bytes=0, timeout=2.0, fetch=request.param)
    b.pool = np.zeros((len(KEYS), PAGE), dtype=np.uint8)
    b.attach_memory(b.pool.ctypes.data, b.pool.nbytes)
    b._member._store = ShortStore()  # "joined"
    yield b
    b._member._store = None  # nothing to close
    b.close()


def pages(b):
    return [memoryview(b.pool[i]) for i in range(len(KEYS))]


def test_a_short_existence_answer_is_unavailable(backend):
    with pytest.raises(StorageUnavailable, match="answered 3 results for 4 keys"):
        backend.exists_prefix(KEYS)


def test_a_short_read_answer_is_unavailable_never_a_page_of_another_key(backend):
    with pytest.raises(StorageUnavailable, match="answered 3 results for 4 keys"):
        backend.get_into(KEYS, pages(backend))
    with pytest.raises(StorageUnavailable, match="answered 3 results for 4 keys"):
        backend.get(KEYS)  # the copying path
    assert backend.stats.gets == 0 and backend.stats.errors == 2


def test_a_short_read_ahead_answer_is_unavailable(backend):
    """Staged fetches read ahead; direct ones probe instead, and the probe's short answer
    is as unavailable."""
    with pytest.raises(StorageUnavailable, match="answered 3 results for 4 keys"):
        backend.read_ahead(KEYS, PAGE)


@pytest.mark.parametrize("present", [0, 1])
def test_a_short_put_answer_is_unavailable_never_pages_counted_stored(backend, present):
    backend._member._store.present = present
    with pytest.raises(StorageUnavailable, match="answered 3 results for 4 keys"):
        backend.put([(k, memoryview(backend.pool[i])) for i, k in enumerate(KEYS)])
    assert backend.stats.puts == 0


def test_a_short_put_answer_from_the_store_itself_is_unavailable(backend):
    store = backend._member._store
    store.batch_is_exist = lambda names: [0] * len(names)  # the probe answers right
    with pytest.raises(StorageUnavailable, match="answered 3 results for 4 keys"):
        backend.put([(k, memoryview(backend.pool[i])) for i, k in enumerate(KEYS)])
    assert backend.stats.puts == 0
