"""The built image, run as the Dockerfile documents and probed from the host: it runs as
non-root, its HEALTHCHECK turns healthy, /metrics answers on the published port, an
engine simulator on the host sharing the socket volume and IPC namespace (as an engine
container would) runs clean, `docker stop` drains it with exit 0 inside the grace
period, none of the build's inputs (CA bundle, pip settings, torch wheel) are left
in the image, and the storage extras (Mooncake client, zlib-ng) work inside it. Needs RADIXKV_TEST_IMAGE (`make test-image`)."""

import hashlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dockertools import REPO, STOP_GRACE_S, DaemonContainer, as_engine_of, docker, poll

SIM = Path(sys.executable).parent / "radixkv-sim"
EXTRA = REPO / "scripts" / "image-extra"
MAX_IMAGE_BYTES = 2 * 10**9  # the CPU torch build; a CUDA one is several times larger


def image_uid(image_config) -> int:
    user = image_config["Config"]["User"]
    return int(user.split(":")[0]) if user.split(":")[0].isdigit() else -1


def scrape(daemon) -> str:
    with urllib.request.urlopen(daemon.metrics_url(), timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def rpcs_answered(metrics_text: str) -> dict[tuple[str, str], float]:
    """(method, code) -> count, from radixkv_rpc_requests_total."""
    return {(s.labels["method"], s.labels["code"]): s.value
            for family in text_string_to_metric_families(metrics_text)
            for s in family.samples if s.name == "radixkv_rpc_requests_total"}


def test_daemon_runs_as_the_images_non_root_user(image_config, daemon):
    uid = image_uid(image_config)
    assert uid > 0, f"the image's USER is {image_config['Config']['User']!r}"
    status = docker("exec", daemon.name, "cat", "/proc/1/status").stdout
    uids = re.search(r"^Uid:\s+(.*)$", status, re.M).group(1).split()
    assert set(map(int, uids)) == {uid}, f"pid 1 runs with uids {uids}"
    cmdline = docker("exec", daemon.name, "cat", "/proc/1/cmdline").stdout.split("\0")
    assert cmdline[1].endswith("/radixkv-server"), cmdline


def test_healthcheck_turns_healthy(image_config, daemon):
    assert image_config["Config"]["Healthcheck"]["Test"][:2] == ["CMD", "radixkv-health"]
    daemon.wait_healthy()
    last = daemon.state()["Health"]["Log"][-1]
    assert last["ExitCode"] == 0, last


def test_metrics_answer_from_the_host(daemon):
    daemon.wait_healthy()
    body = scrape(daemon)
    assert "# TYPE radixkv_rpc_requests_total counter" in body, body[:2000]


def test_simulator_on_the_host_shares_socket_and_ipc_with_no_byte_mismatch(image_config, daemon):
    if os.geteuid() != 0:
        pytest.skip("joining the container's namespaces needs root (CI runs as root)")
    daemon.wait_healthy()
    argv = [str(SIM), "--target", "unix://{socket_dir}/radixkv.sock", "--namespace", "image-test",
            "--requests", "200", "--seed", "7"]
    done = subprocess.run(as_engine_of(daemon, image_uid(image_config), argv),
                          capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"radixkv-sim exited {done.returncode}:\n{output[-4000:]}\n{daemon.logs()}"
    assert re.search(r"^0 byte mismatches$", done.stdout, re.M), output[-4000:]
    # The daemon in the container served it: the host's scrape counts its RPCs.
    served = rpcs_answered(scrape(daemon))
    assert served.get(("Register", "OK"), 0) >= 1 and served.get(("Match", "OK"), 0) >= 1, served


def test_docker_stop_exits_0_within_the_grace_period(image):
    container = DaemonContainer(image).start()
    try:
        poll(lambda: docker("exec", container.name, "radixkv-health", "--quiet", check=False).returncode == 0,
             60, "the daemon to serve on its socket")
        start = time.monotonic()
        docker("stop", "--time", str(STOP_GRACE_S), container.name, timeout=STOP_GRACE_S + 30)
        elapsed = time.monotonic() - start
        state = container.state()
        assert state["ExitCode"] == 0 and not state["OOMKilled"], f"{state}\n{container.logs()}"
        assert elapsed < STOP_GRACE_S, f"stopping took {elapsed:.1f}s (grace {STOP_GRACE_S}s)"
        assert '"daemon.stopped"' in container.logs()
    finally:
        container.remove()


def test_image_size_is_within_the_cpu_budget(image, image_config):
    size = image_config["Size"]
    print(f"image {image}: {size / 1e6:.0f} MB")
    assert size < MAX_IMAGE_BYTES, f"{size / 1e9:.2f} GB: a CUDA build of torch, or a build cache, got in?"


FIND_LEFTOVERS = r'''
import hashlib, os, sys
size, digest = int(sys.argv[1]), sys.argv[2]
for top, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(top, d) not in ("/proc", "/sys", "/dev")]
    for f in files:
        path = os.path.join(top, f)
        if f in ("pip.conf", "pip.ini") or path.startswith("/tmp/") or (f.startswith("torch-") and f.endswith(".whl")):
            print(path)
        elif size and os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) == size:
            if hashlib.sha256(open(path, "rb").read()).hexdigest() == digest:
                print(path)
'''


def test_build_inputs_do_not_reach_the_image(image, image_config):
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    for word in ("image-extra", "TORCH_WHEEL", "TORCH_INDEX_URL", "PIP_CONFIG_FILE", "ca.crt", "file://"):
        assert word not in history, f"{word!r} in the image's history:\n{history}"
    env = image_config["Config"]["Env"]
    assert not [e for e in env if e.startswith("PIP_")], env
    ca = EXTRA / "ca.crt"
    size, digest = (ca.stat().st_size, hashlib.sha256(ca.read_bytes()).hexdigest()) if ca.exists() else (0, "")
    found = docker("run", "--rm", "--entrypoint", "python3", image, "-c", FIND_LEFTOVERS, str(size), digest,
                   timeout=120).stdout.split()
    assert not found, f"build inputs left in the image: {found}"


STORAGE_ROUND_TRIP = r'''
import os, socket, subprocess, sys, tempfile, time
import numpy as np
from radixkv_server.storage import open_storage
from radixkv_server.storage.record import crc32
assert crc32.__module__.startswith("zlib_ng"), crc32.__module__
socks = [socket.socket() for _ in range(3)]  # three distinct free ports, held until all are drawn
for s in socks:
    s.bind(("127.0.0.1", 0))
port, metrics_port, http_port = (s.getsockname()[1] for s in socks)
for s in socks:
    s.close()
exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
master = subprocess.Popen([exe, f"--rpc_port={port}", f"--metrics_port={metrics_port}",
                           f"--http_metadata_server_port={http_port}", "--rpc_address=127.0.0.1",
                           "--enable_metric_reporting=false"], cwd=tempfile.mkdtemp(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    backend = open_storage(f"mooncake://127.0.0.1:{port}?segment=32MiB")
    pages = np.random.default_rng(1).integers(0, 256, size=(4, 16384), dtype=np.uint8)
    keys = [bytes([i]) * 32 for i in range(4)]
    deadline = time.monotonic() + 60
    while True:
        try:
            stored = backend.put([(k, memoryview(pages[i])) for i, k in enumerate(keys)])
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    back = backend.get(keys)
    assert stored == 4 and back == [p.tobytes() for p in pages], (stored, [b is None for b in back])
    backend.close()
    print("ROUND TRIP OK")
finally:
    master.kill()
'''


def test_storage_extras_run_in_the_image(image):
    # `--storage mooncake://` and fast record checksums work in the image: a Mooncake
    # master and a backend inside one container store and read back pages byte-exact.
    run = docker("run", "--rm", "--entrypoint", "python", image, "-c", STORAGE_ROUND_TRIP, timeout=180, check=False)
    assert run.returncode == 0 and "ROUND TRIP OK" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
