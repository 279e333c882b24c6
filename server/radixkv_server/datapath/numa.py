"""Host memory near the GPU: the NUMA node a CUDA device hangs off, and a scope that
runs the calling thread on that node's CPUs.

Linux places a page on the node of the CPU that first touches it, and
`cudaHostRegister` touches (faults in) every page of the host pool, so pinning the pool
inside `near(node)` puts it on the GPU's node: PCIe transfers then avoid the link
between sockets. On a machine with one node, or where sysfs or CUDA says nothing,
every function here answers None or does nothing. Only the calling thread moves
(`sched_setaffinity(0)` is per thread on Linux), and it moves back afterwards.
"""

import logging
import os
import re
from contextlib import contextmanager

log = logging.getLogger("radixkv.datapath")

SYS = "/sys"


def pci_address(device: int) -> str | None:
    """The PCI address ("0000:3b:00.0") of CUDA device `device` as torch reports it
    (no context is created), or None when torch does not report it."""
    import torch
    try:
        props = torch.cuda.get_device_properties(device)
    except (AssertionError, RuntimeError) as e:  # torch without CUDA, bad ordinal
        log.debug("no properties for CUDA device %s: %s", device, e)
        return None
    ids = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if any(not isinstance(i, int) for i in ids):
        return None
    return f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"


def device_node(pci: str | None, sys_root: str = SYS) -> int | None:
    """The NUMA node of the PCI device at `pci`; None when unknown (-1 in sysfs, no
    sysfs entry, or `pci` None)."""
    if not pci:
        return None
    try:
        with open(os.path.join(sys_root, "bus/pci/devices", pci.lower(), "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def num_nodes(sys_root: str = SYS) -> int:
    """NUMA nodes with CPUs or memory on this machine (1 when sysfs says nothing)."""
    try:
        names = os.listdir(os.path.join(sys_root, "devices/system/node"))
    except OSError:
        return 1
    return max(1, sum(1 for n in names if re.fullmatch(r"node\d+", n)))


def node_cpus(node: int, sys_root: str = SYS) -> set[int]:
    """The CPUs of NUMA node `node` (empty when unknown)."""
    try:
        with open(os.path.join(sys_root, f"devices/system/node/node{node}/cpulist")) as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return set()


def parse_cpulist(text: str) -> set[int]:
    """"0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}. Raises ValueError on malformed text."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_node(device: int, sys_root: str = SYS) -> int | None:
    """The NUMA node worth allocating CUDA device `device`'s host memory on: None on a
    machine with one node (nothing to choose) or when the device's node is unknown."""
    if num_nodes(sys_root) < 2:
        return None
    return device_node(pci_address(device), sys_root)


@contextmanager
def near(node: int | None, sys_root: str = SYS):
    """Run the calling thread on `node`'s CPUs (those it may use) inside the block; yields
    whether it moved. Does nothing for None, an unknown node, or no allowed CPU there."""
    if node is None or not hasattr(os, "sched_setaffinity"):
        yield False
        return
    before = os.sched_getaffinity(0)
    target = node_cpus(node, sys_root) & before
    if not target:
        yield False
        return
    try:
        os.sched_setaffinity(0, target)
    except OSError as e:
        log.debug("cannot move to NUMA node %d's CPUs: %s", node, e)
        yield False
        return
    try:
        yield True
    finally:
        os.sched_setaffinity(0, before)


__all__ = ["device_node", "gpu_node", "near", "node_cpus", "num_nodes", "parse_cpulist", "pci_address"]
