"""NUMA placement of the host pool: sysfs parsing and the per-thread CPU scope (CPU-only)."""

import os
import threading

import pytest

from radixkv.layout import KvLayout
from radixkv_server.datapath import HostPool, numa

PCI = "0000:3b:00.0"


def fake_sys(tmp_path, nodes: dict[int, str], gpu_node: int | None) -> str:
    """A /sys with `nodes` {node: cpulist} and one PCI device at PCI on `gpu_node`."""
    for n, cpus in nodes.items():
        d = tmp_path / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (tmp_path / "devices/system/node/possible").write_text("0-1\n")  # not a node directory
    dev = tmp_path / "bus/pci/devices" / PCI
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{-1 if gpu_node is None else gpu_node}\n")
    return str(tmp_path)


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("") == set()
    with pytest.raises(ValueError):
        numa.parse_cpulist("a-b")


def test_nodes_and_device_node_from_sysfs(tmp_path):
    root = fake_sys(tmp_path, {0: "0-1", 1: "2-3"}, gpu_node=1)
    assert numa.num_nodes(root) == 2
    assert numa.node_cpus(1, root) == {2, 3} and numa.node_cpus(7, root) == set()
    assert numa.device_node(PCI, root) == 1
    assert numa.device_node(PCI.upper(), root) == 1
    assert numa.device_node("0000:00:01.0", root) is None and numa.device_node(None, root) is None


def test_unknown_device_node_and_missing_sysfs(tmp_path):
    root = fake_sys(tmp_path, {0: "0-1"}, gpu_node=None)  # numa_node -1
    assert numa.device_node(PCI, root) is None
    assert numa.num_nodes(str(tmp_path / "nowhere")) == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_near_moves_only_the_calling_thread_and_moves_it_back(tmp_path):
    allowed = os.sched_getaffinity(0)
    one = min(allowed)
    root = fake_sys(tmp_path, {0: str(one), 1: "100000"}, gpu_node=0)
    seen_elsewhere, go = [], threading.Event()

    def other_thread():  # started before the scope: keeps its own CPUs
        go.wait(10)
        seen_elsewhere.append(os.sched_getaffinity(0))
    t = threading.Thread(target=other_thread)
    t.start()
    with numa.near(0, root) as moved:
        assert moved and os.sched_getaffinity(0) == {one}
        go.set()
        t.join()
    assert os.sched_getaffinity(0) == allowed
    assert seen_elsewhere == [allowed]
    with numa.near(1, root) as moved:  # no allowed CPU on node 1: stays put
        assert not moved and os.sched_getaffinity(0) == allowed
    with numa.near(None, root) as moved:
        assert not moved


def test_host_pool_without_cuda_chooses_no_node():
    pool = HostPool(KvLayout(1, 1, 4, "float16", 2), 4, pin="auto", device=0)
    try:
        assert pool.numa_node is None and pool.tensor.shape == (4, pool.layout.page_bytes)
    finally:
        pool.close()
