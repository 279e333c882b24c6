"""The default host memory budget reads the daemon's own memory cgroup.

It read only the limit at the cgroup mount's root. A daemon in a systemd unit with
`MemoryMax=`, a batch job's cgroup or a container sharing the host's cgroup namespace
sits below that root: its 2 GiB limit went unseen, a 3 GiB pool was admitted, and the
kernel killed the daemon once the pool filled (every engine on the node lost its cache).
"""

import os
import uuid

import grpc
import pytest

from radixkv_server.service.host_budget import cgroup_limit
from tests.support.daemon import DaemonProcess, stop_all

from faultkit import LAYOUT, RawSession, status, stub_for

GiB = 1 << 30


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v1_the_tightest_limit_of_the_own_cgroup_and_its_ancestors(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/system.slice/radixkv.service\n0::/\n")
    memory = tmp_path / "fs" / "memory"
    _write(memory / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    _write(memory / "system.slice" / "radixkv.service" / "memory.limit_in_bytes", f"{2 * GiB}\n")
    assert cgroup_limit(str(proc), str(tmp_path / "fs")) == 2 * GiB
    _write(memory / "system.slice" / "memory.limit_in_bytes", f"{GiB}\n")  # the slice's is tighter
    assert cgroup_limit(str(proc), str(tmp_path / "fs")) == GiB


def test_v2_a_units_memory_max_below_the_root(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/radixkv.service\n")
    fs = tmp_path / "fs"
    _write(fs / "cgroup.controllers", "cpu memory\n")
    _write(fs / "system.slice" / "memory.max", "max\n")
    _write(fs / "system.slice" / "radixkv.service" / "memory.max", f"{3 * GiB}\n")
    assert cgroup_limit(str(proc), str(fs)) == 3 * GiB


def test_a_container_whose_mount_root_is_its_own_cgroup(tmp_path):
    """/proc names the host's path, which does not exist inside: the root's limit holds."""
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/0123abcd\n")
    _write(tmp_path / "fs" / "memory" / "memory.limit_in_bytes", f"{4 * GiB}\n")
    assert cgroup_limit(str(proc), str(tmp_path / "fs")) == 4 * GiB
    proc.write_text("0::/\n")  # v2 with a cgroup namespace
    _write(tmp_path / "v2" / "memory.max", f"{5 * GiB}\n")
    assert cgroup_limit(str(proc), str(tmp_path / "v2")) == 5 * GiB
    _write(tmp_path / "v2" / "memory.max", "max\n")
    assert cgroup_limit(str(proc), str(tmp_path / "v2")) is None


@pytest.fixture
def limited_cgroup():
    """A real cgroup (v1 memory, or v2) limited to 2 GiB: the path of its cgroup.procs."""
    v1 = "/sys/fs/cgroup/memory"
    base = v1 if os.path.isdir(v1) else "/sys/fs/cgroup"
    path = os.path.join(base, f"radixkv-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes" if base == v1 else "memory.max"), "w") as f:
            f.write(str(2 * GiB))
    except OSError as e:
        if os.path.isdir(path):
            os.rmdir(path)
        pytest.skip(f"cannot make a memory-limited cgroup here ({e}): needs root and a writable cgroup fs")
    yield os.path.join(path, "cgroup.procs")
    os.rmdir(path)  # empty once the daemon exited


def test_a_daemon_in_a_2GiB_cgroup_refuses_a_pool_past_it(limited_cgroup):
    join = f"import os; open({limited_cgroup!r}, 'w').write(str(os.getpid()))\n"
    d = DaemonProcess("--host-pool-size", "3GiB", launcher=(
        "-c", join + "import sys\nfrom radixkv_server.cli import main\nsys.exit(main())"))
    d.start()
    channel, stub = stub_for(d.target)
    try:
        log = d.log()
        assert f"budget={GiB}" in log and "the cgroup's memory limit of 2147483648 bytes" in log, log[-2000:]
        assert "host_pool.over_budget" in log
        pages = (3 * GiB // 2) // LAYOUT.page_bytes  # 1.5 GiB: past the budget of 1 GiB
        code, message = status(lambda: RawSession(stub, "cg/big", host_pool_pages=pages))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "set --max-host-memory" in message, message
        small = RawSession(stub, "cg/small", host_pool_pages=64)
        small.close()
    finally:
        channel.close()
        stop_all([d])
