"""A configuration the daemon cannot start with ends in one clear line and exit code 1
(`daemon.failed`) or 2 (a bad flag or variable), never a traceback; what it can start
with but will not work as meant is said at start: RADIXKV_* variables that name no
setting, a storage tier that does not answer (and `radixkv_storage_up` reads 0 until it
does), not first at the shutdown's store."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.support.daemon import DaemonProcess, wait_for

from scrape import DEADLINE_S


@pytest.fixture
def socket_dir():
    path = tempfile.mkdtemp(prefix="rkv-s-")  # a unix socket path must stay under 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("flags,env,code,says", [
    (("--storage", "file:///proc/radixkv-test/pages"), {}, 1, "unavailable during open"),
    (("--listen", "127.0.0.1:99999"), {}, 1, "the port must be a number in 0-65535"),
    (("--kv-events-replay-endpoint", "tcp://127.0.0.1:5999"), {}, 1,
     "kv events: kv_events_replay_endpoint needs kv_events_endpoint"),
    (("--shutdown-grace", "nan"), {}, 2, "shutdown_grace must be a number of seconds >= 0, got nan"),
    ((), {"RADIXKV_KV_EVENTS_WATCH": "ture"}, 2, "kv_events_watch: expected true or false"),
], ids=["storage-directory", "port", "events-off", "nan", "boolean"])
def test_a_configuration_that_cannot_work_is_refused_in_one_line(socket_dir, flags, env, code, says):
    done = subprocess.run(
        [sys.executable, "-m", "radixkv_server", "--listen", f"unix://{socket_dir}/radixkv.sock",
         "--metrics-port", "0", *flags],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == code, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    if code == 1:
        assert "daemon.failed" in done.stderr


def test_variables_that_name_no_setting_are_said_at_start():
    d = DaemonProcess(env={**os.environ, "RADIXKV_HOST_POOL": "1GiB"}).start()
    try:
        [line] = [line for line in d.log().splitlines() if "config.unknown_variables" in line]
        assert "RADIXKV_HOST_POOL" in line
    finally:
        d.stop()
        d.cleanup()


def test_a_storage_tier_that_does_not_answer_is_said_at_start():
    d = DaemonProcess("--storage", "redis://127.0.0.1:1/0", metrics=True).start()
    try:
        wait_for(lambda: "storage.unavailable" in d.log(), DEADLINE_S, "the start's storage check")
        assert "direction=check" in d.log()
        assert "radixkv_storage_up 0.0" in d.scrape()
    finally:
        d.stop()
        d.cleanup()
