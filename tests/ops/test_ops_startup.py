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
    (("--storage", "ftp://x"), {}, 2, "unsupported storage URL scheme 'ftp'"),
    (("--listen", "127.0.0.1:99999"), {}, 2, "the port must be a number in 0-65535"),
    (("--listen", "/tmp/rkv-bare.sock"), {}, 2, "a Unix socket is unix://PATH"),
    (("--kv-events-replay-endpoint", "tcp://127.0.0.1:5999"), {}, 2,
     "radixkv-server: --kv-events-replay-endpoint needs --kv-events-endpoint"),
    (("--kv-events-replay-size", "0"), {}, 2, "radixkv-server: --kv-events-replay-size must be >= 1, got 0"),
    (("--shutdown-grace", "nan"), {}, 2, "--shutdown-grace must be a number of seconds >= 0, got nan"),
    # Register says it as a uint32: past it, every Register failed INTERNAL and left its session live
    (("--max-prompts-per-match", str(2**32)), {}, 2, "--max-prompts-per-match must be at most 4294967295"),
    ((), {"RADIXKV_KV_EVENTS_WATCH": "ture"}, 2, "RADIXKV_KV_EVENTS_WATCH: expected true or false"),
    (("--host-pool-size", "0"), {}, 2, "--host-pool-size must be > 0"),
    (("--max-message-size", "100"), {}, 2, "--max-message-size must be at least 1MiB"),
    (("--listen", "unix:///tmp/rkv-twice.sock", "--listen", "unix:///tmp/rkv-twice.sock"), {}, 2,
     "an address is given twice"),
], ids=["storage-directory", "storage-scheme", "port", "bare-path", "events-off", "replay-size", "nan", "prompts-uint32", "boolean",
        "no-host-pool", "tiny-messages",
        "listen-twice"])
def test_a_configuration_that_cannot_work_is_refused_in_one_line(socket_dir, flags, env, code, says):
    """Exit 2 for a value no daemon could start with (the storage scheme, port, events'
    settings said 1 before), 1 for what this machine refuses. The last three started
    "ready" before, and then refused every engine (or call)."""
    done = subprocess.run(
        [sys.executable, "-m", "radixkv_server", "--listen", f"unix://{socket_dir}/radixkv.sock",
         "--metrics-port", "0", *flags],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == code, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    if code == 1:
        assert "daemon.failed" in done.stderr


def test_mooncake_storage_without_its_client_is_refused_saying_what_to_install(socket_dir):
    """Without the `mooncake` extra the daemon started ready and logged, every 10 s, an
    import that could never succeed (the packaging review). The package is hidden here
    as Python hides a missing one (None in sys.modules)."""
    hidden = ("import sys, runpy; sys.modules['mooncake'] = None; "
              "sys.argv = ['radixkv-server', *sys.argv[1:]]; runpy.run_module('radixkv_server', run_name='__main__')")
    done = subprocess.run(
        [sys.executable, "-c", hidden, "--listen", f"unix://{socket_dir}/radixkv.sock", "--metrics-port", "0",
         "--storage", "mooncake://127.0.0.1:50051"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "needs the Mooncake Store client" in done.stderr and "pip install 'radixkv-server[mooncake]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_variables_that_name_no_setting_are_said_at_start():
    d = DaemonProcess(env={**os.environ, "RADIXKV_HOST_POOL": "1GiB"}).start()
    try:
        [line] = [line for line in d.log().splitlines() if "config.unknown_variables" in line]
        assert "RADIXKV_HOST_POOL" in line
    finally:
        d.stop()
        d.cleanup()


def test_a_default_host_pool_past_the_memory_budget_is_said_at_start():
    """Registers that take the default pool will be refused (those that size their pool
    are served): said at start, not first at the engines' Registers."""
    d = DaemonProcess("--host-pool-size", "1GiB", "--max-host-memory", "512MiB", metrics=True).start()
    try:
        [line] = [line for line in d.log().splitlines() if "host_pool.over_budget" in line]
        assert "budget=536870912" in line and "--max-host-memory" in line
        # The budget in force is said whatever its source, and exported.
        [line] = [line for line in d.log().splitlines() if "host_memory.budget" in line]
        assert "budget=536870912" in line and "source=--max-host-memory" in line
        assert "radixkv_host_memory_budget_bytes 5.36870912e+08" in d.scrape()
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


def test_a_listen_path_the_daemon_cannot_use_is_refused_and_left_alone(socket_dir):
    """A file at the socket's path that is not a socket is the operator's: refused, kept
    (it was deleted, and the daemon started); a directory that cannot be made is said
    in one line (a traceback)."""
    taken = os.path.join(socket_dir, "radixkv.sock")
    with open(taken, "w") as f:
        f.write("the operator's")
    for listen, says in [(f"unix://{taken}", f"{taken} exists and is not a socket"),
                         ("unix:///proc/radixkv-test/radixkv.sock",
                          "cannot create the socket's directory /proc/radixkv-test")]:
        done = subprocess.run([sys.executable, "-m", "radixkv_server", "--listen", listen, "--metrics-port", "0"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stderr
        assert says in done.stderr and "daemon.failed" in done.stderr and "Traceback" not in done.stderr, done.stderr
    with open(taken) as f:
        assert f.read() == "the operator's"


def test_clients_on_defaults_find_a_daemon_on_the_per_user_fallback(socket_dir, monkeypatch):
    """Not root, `make serve`'s daemon listens in the user's runtime directory; a client,
    `radixkv-health` and `radixkv-sim` on their defaults look there too when /run/radixkv
    holds no socket (they looked at /run/radixkv alone, and said the daemon was down)."""
    from radixkv.channel import DEFAULT_TARGET, fallback_target, resolve_target

    monkeypatch.setenv("XDG_RUNTIME_DIR", socket_dir)
    if os.path.exists(DEFAULT_TARGET.removeprefix("unix://")):  # a daemon on this machine's /run answers first
        assert resolve_target(DEFAULT_TARGET) == DEFAULT_TARGET
        return
    assert resolve_target(DEFAULT_TARGET) == DEFAULT_TARGET  # no daemon anywhere: the usual address in errors
    d = DaemonProcess(listen=fallback_target()).start()
    try:
        assert resolve_target(DEFAULT_TARGET) == fallback_target() == f"unix://{socket_dir}/radixkv/radixkv.sock"
        for path in (socket_dir, f"{socket_dir}/radixkv"):  # another user could have made or swapped the socket
            mode = os.stat(path).st_mode
            os.chmod(path, mode | 0o002)
            assert resolve_target(DEFAULT_TARGET) == DEFAULT_TARGET
            os.chmod(path, mode)
        health = subprocess.run([sys.executable, "-m", "radixkv_server.healthcheck"], capture_output=True,
                                text=True, timeout=60, env={**os.environ, "RADIXKV_LISTEN": ""})
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
    finally:
        d.stop()
        d.cleanup()


def test_a_start_that_cannot_listen_names_the_cause_and_leaves_no_socket(socket_dir):
    """gRPC's own error said only "Failed to bind ... set GRPC_VERBOSITY=debug" (the cause
    on a line of its C core, outside the structured log), and the unix socket bound
    before the failing address stayed behind."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    garbage = os.path.join(socket_dir, "garbage.pem")
    with open(garbage, "w") as f:
        f.write("not a certificate\n")
    path = os.path.join(socket_dir, "first.sock")
    try:
        for flags, says in [(("--listen", f"127.0.0.1:{taken.getsockname()[1]}"), "Address already in use"),
                            (("--listen", "127.0.0.1:0", "--tls-cert", garbage, "--tls-key", garbage),
                             f"TLS certificate {garbage}, key {garbage}: cannot be used")]:
            done = subprocess.run([sys.executable, "-m", "radixkv_server", "--listen", f"unix://{path}",
                                   "--metrics-port", "0", *flags], capture_output=True, text=True, timeout=120)
            assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
            assert not os.path.exists(path), "the socket bound first was left behind"
    finally:
        taken.close()
