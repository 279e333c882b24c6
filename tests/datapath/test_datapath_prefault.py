"""--host-pool-prefault: a namespace's host pool faulted in at its Register, so the
first copies into it pay no kernel fault per 4 KiB (without it, they do)."""

import logging
import resource

from radixkv.layout import KvLayout
from radixkv_server.config import load_config
from radixkv_server.datapath import HostPool

LAYOUT = KvLayout(2, 1, 64, "float16", 16)  # 8 KiB pages
PAGES = 4096                                # 32 MiB: 8192 pages of 4 KiB


def _faults_of_first_write(pool: HostPool) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    pool.tensor.fill_(7)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_prefaulted_pool_takes_no_faults_on_first_use(caplog):
    with caplog.at_level(logging.INFO, logger="radixkv.datapath"):
        warm = HostPool(LAYOUT, PAGES, pin="never", prefault=True)
    cold = HostPool(LAYOUT, PAGES, pin="never")
    try:
        assert "faulted in 0.03 GiB" in caplog.text
        assert _faults_of_first_write(cold) > PAGES  # about one per 4 KiB: 8192
        assert _faults_of_first_write(warm) < PAGES // 20
        assert warm.read_page(PAGES - 1) == bytes([7]) * LAYOUT.page_bytes
    finally:
        warm.close()
        cold.close()


def test_prefault_is_off_by_default_and_a_flag():
    assert load_config([]).host_pool_prefault is False
    assert load_config(["--host-pool-prefault", "true"]).host_pool_prefault is True


def test_a_namespace_registered_with_the_flag_has_its_pool_faulted_in(caplog):
    from tests.service_inproc.inproc import Engine, run, running_daemon

    async def scenario():
        async with running_daemon(host_pool_prefault=True) as daemon:
            with caplog.at_level(logging.INFO, logger="radixkv.datapath"):
                e = await Engine.register(daemon, "t/prefault")
            assert "host pool: faulted in" in caplog.text
            await e.close()
    run(scenario())
