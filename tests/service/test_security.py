"""Who can reach the daemon: socket permissions, TCP only where told, TLS and mutual TLS
on TCP, the shared token (health checks stay open), and what a token-less or
certificate-less caller gets."""

import asyncio
import datetime
import ipaddress
import os
import shutil
import signal
import stat
import tempfile

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from radixkv import errors
from radixkv.aio import AsyncClient
from radixkv.channel import Tls
from radixkv.client import Client
from radixkv.kvbuffers import ShmKvBuffers
from radixkv.sim.kv import KvPattern, page_keys
from radixkv.v1 import radixkv_pb2 as pb
from radixkv.v1 import radixkv_pb2_grpc
from radixkv_server.config import load_config
from tests.support.daemon import DaemonProcess, free_port, stop_all, wait_for

from faultkit import LAYOUT, NUM_PAGES, tokens

TOKEN = "s3cret-token-for-tests"


def listening_tcp(pid: int) -> list[str]:
    """'address:port' of every TCP socket the process listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # LISTEN
                    address, port = local.split(":")
                    out.append(f"{_ip(address)}:{int(port, 16)}")
    return out


def _ip(hex_address: str) -> str:
    """/proc/net/tcp{,6} addresses: 32-bit words in host (little-endian) order."""
    raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8))
    ip = ipaddress.ip_address(raw)
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


@pytest.fixture
def daemons():
    made: list[DaemonProcess] = []

    def start(*flags, listen=None, ready=True, probe=None, metrics=False):
        d = DaemonProcess(*flags, listen=listen, probe=probe, metrics=metrics)
        made.append(d)
        d.start(ready)
        return d

    yield start
    stop_all(made)


def test_unix_socket_and_directory_modes(daemons):
    base = tempfile.mkdtemp(prefix="rkv-perm-")
    sock = os.path.join(base, "made-by-daemon", "radixkv.sock")
    d = daemons(listen=f"unix://{sock}")
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o750
    assert listening_tcp(d.pid) == []  # metrics off (DEFAULT_FLAGS): no TCP at all
    d.stop()
    assert not os.path.exists(sock)  # removed on shutdown
    os.rmdir(os.path.dirname(sock))
    os.rmdir(base)


def test_default_config_listens_on_no_tcp_port():
    config = load_config([], {})
    assert all(a.startswith("unix:") for a in config.listen)
    assert config.metrics_host == "127.0.0.1"  # /metrics, when on, is loopback only
    assert not (config.tls_cert or config.auth_token or config.auth_token_file)


def test_tcp_binds_only_where_told(daemons):
    port = free_port()
    d = daemons(listen=f"127.0.0.1:{port}")
    assert listening_tcp(d.pid) == [f"127.0.0.1:{port}"]  # loopback only, not 0.0.0.0 or ::


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, issuer_key, issuer: str, key, ca: bool = False, san=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the daemon's certificate (localhost, 127.0.0.1), an engine's client
    certificate from the same CA, and a rogue one from another CA."""
    d = tmp_path_factory.mktemp("pki")
    files = {}

    def write(name, obj):
        path = d / name
        if isinstance(obj, x509.Certificate):
            path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        files[name] = str(path)

    ca_key, rogue_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    write("ca.pem", _cert("radixkv test CA", ca_key, "radixkv test CA", ca_key, ca=True))
    write("rogue-ca.pem", _cert("rogue CA", rogue_key, "rogue CA", rogue_key, ca=True))
    for name, issuer_key, issuer, san in [
        ("server", ca_key, "radixkv test CA", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        ("engine", ca_key, "radixkv test CA", [x509.DNSName("engine")]),
        ("rogue", rogue_key, "rogue CA", [x509.DNSName("engine")]),
        ("server2", rogue_key, "rogue CA", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
    ]:
        key = ec.generate_private_key(ec.SECP256R1())
        write(f"{name}.key", key)
        write(f"{name}.pem", _cert(name, issuer_key, issuer, key, san=san))
    return files


def reaches(target: str, **kw) -> bool | str:
    """True when a Stats call gets through; else the error's code name."""
    with Client(target, timeout=3, reconnect=None, **kw) as c:
        try:
            c.stats()
            return True
        except errors.RadixKVError as e:
            return e.code.name


def test_tls_on_tcp(daemons, pki):
    port = free_port()
    daemons("--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"], listen=f"127.0.0.1:{port}",
            probe={"tls": Tls(ca_file=pki["ca.pem"])})
    target = f"127.0.0.1:{port}"
    assert reaches(target, tls=Tls(ca_file=pki["ca.pem"])) is True
    assert reaches(f"localhost:{port}", tls=Tls(ca_file=pki["ca.pem"])) is True
    assert reaches(target) == "UNAVAILABLE"  # plaintext to a TLS port
    assert reaches(target, tls=Tls(ca_file=pki["rogue-ca.pem"])) == "UNAVAILABLE"  # unknown server CA


def test_mutual_tls(daemons, pki):
    port = free_port()
    daemons("--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"], "--tls-client-ca", pki["ca.pem"],
            listen=f"127.0.0.1:{port}", probe={"tls": Tls(pki["ca.pem"], pki["engine.pem"], pki["engine.key"])})
    target = f"127.0.0.1:{port}"
    assert reaches(target, tls=Tls(pki["ca.pem"], pki["engine.pem"], pki["engine.key"])) is True
    assert reaches(target, tls=Tls(pki["ca.pem"])) == "UNAVAILABLE"  # no client certificate
    assert reaches(target, tls=Tls(pki["ca.pem"], pki["rogue.pem"], pki["rogue.key"])) == "UNAVAILABLE"


def test_shared_token(daemons, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    d = daemons("--auth-token-file", str(token_file), metrics=True)
    with Client(d.target, timeout=3, reconnect=None) as anonymous:
        anonymous.wait_ready(5)  # health checks stay open for probes
        for call in (anonymous.stats, anonymous.echo, anonymous.check_invariants):
            with pytest.raises(errors.Unauthenticated, match="authorization: Bearer"):
                call()
        with pytest.raises(errors.Unauthenticated):
            anonymous.register("tok/tp0", LAYOUT, [("x", 0, 1)] * LAYOUT.num_buffers, 4)
    with grpc.insecure_channel(d.target) as ch:  # reflection is not open either
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert reaches(d.target, token="wrong") == "UNAUTHENTICATED"
    # A stale token shows on dashboards: refusals are counted as answered calls are
    # (Stats twice: without a token, then with the wrong one).
    assert 'radixkv_rpc_requests_total{code="UNAUTHENTICATED",method="Stats"} 2.0' in d.scrape()

    # The right token: a whole round trip, ack stream included, blocking and asyncio.
    buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
    kv = KvPattern(LAYOUT, [buffers.buffer(i) for i in range(LAYOUT.num_buffers)], NUM_PAGES)
    try:
        with Client(d.target, timeout=5, token=TOKEN) as c:
            c.register("tok/tp0", LAYOUT, buffers.specs(), NUM_PAGES, write_policy="write_back", host_pool_pages=64)
            prompt = tokens(0, 2)
            kv.write([0, 1], page_keys(prompt, 4))
            c.insert(prompt, [0, 1])
            c.evict(2)
            [m] = c.match([prompt])
            lb = c.load_back(m.host_node, [5, 6])
            assert c.wait([lb.transfer], timeout=10)[lb.transfer].ok
            assert kv.mismatches(lb.device_pages, page_keys(prompt, 4)) == (0, 0)

        async def aio():
            async with AsyncClient(d.target, timeout=5, token=TOKEN) as ac:
                await ac.register("tok/tp0", LAYOUT, buffers.specs(), NUM_PAGES, write_policy="write_back",
                                  host_pool_pages=64)
                [m] = await ac.match([prompt])
                lb = await ac.load_back(m.host_node, [7, 8])
                assert (await ac.wait([lb.transfer], timeout=10))[lb.transfer].ok
            async with AsyncClient(d.target, timeout=5, reconnect=None) as anon:
                with pytest.raises(errors.Unauthenticated):
                    await anon.stats()

        asyncio.run(aio())
    finally:
        buffers.close()
    assert TOKEN not in d.log()  # the resolved config is logged without it


def test_a_caller_without_a_token_cannot_make_the_daemon_hold_its_message(daemons, tmp_path):
    """The refusal of a call without a token came after gRPC had received and parsed its
    whole message (up to --max-message-size, 64 MiB): concurrent strangers on a TCP
    listener could grow the daemon by that much per call until it was OOM-killed."""
    import threading

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    d = daemons("--auth-token-file", str(token_file))
    before = peak = d.rss_bytes()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, d.rss_bytes())
            done.wait(0.005)

    payload = os.urandom(48 << 20)
    codes = []

    def call():
        options = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(d.target, options=options) as ch:  # a connection each
            try:
                radixkv_pb2_grpc.RadixKVStub(ch).Echo(pb.EchoRequest(payload=payload), timeout=60)
            except grpc.RpcError as e:
                codes.append(e.code())

    sampler = threading.Thread(target=sample)
    sampler.start()
    callers = [threading.Thread(target=call) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    done.set()
    sampler.join()
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    assert peak - before < 96 << 20, f"the daemon grew by {(peak - before) >> 20} MiB for 4 refused calls of 48 MiB"


def test_sighup_reloads_the_token_file(daemons, tmp_path):
    """New tokens take effect on SIGHUP, logged; the daemon serves on; a broken file
    keeps the tokens in use (logged as an error, and shown on /metrics until a reload
    takes effect: an alert needs no log search)."""
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN + "\n")
    d = daemons("--auth-token-file", str(token_file), metrics=True)
    reload_ok = 'radixkv_config_last_reload_successful{what="tokens"}'
    assert f"{reload_ok} 1.0" in d.scrape() and 'what="tls"' not in d.scrape()
    assert reaches(d.target, token=TOKEN) is True
    token_file.write_text("a-new-token\n")
    d.signal(signal.SIGHUP)
    wait_for(lambda: "event=auth.reloaded" in d.log(), 10, "the token file reloaded")
    assert d.alive and reaches(d.target, token=TOKEN) == "UNAUTHENTICATED"
    assert reaches(d.target, token="a-new-token") is True
    token_file.write_text("# nothing\n")
    d.signal(signal.SIGHUP)
    wait_for(lambda: "event=auth.reload_failed" in d.log(), 10, "the empty token file refused")
    assert d.alive and reaches(d.target, token="a-new-token") is True
    assert "a-new-token" not in d.log() and "event=daemon.reload what=tokens" in d.log()
    assert f"{reload_ok} 0.0" in d.scrape()
    token_file.write_text("a-third-token\n")
    d.signal(signal.SIGHUP)
    wait_for(lambda: d.log().count("event=auth.reloaded") == 2, 10, "the mended token file reloaded")
    assert f"{reload_ok} 1.0" in d.scrape()


def test_sighup_reloads_tls_certificates(daemons, pki, tmp_path):
    """New connections get the certificate read on SIGHUP."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(pki["server.pem"], cert)
    shutil.copy(pki["server.key"], key)
    port = free_port()
    d = daemons("--tls-cert", str(cert), "--tls-key", str(key), listen=f"127.0.0.1:{port}",
                probe={"tls": Tls(ca_file=pki["ca.pem"])})
    target = f"127.0.0.1:{port}"
    assert reaches(target, tls=Tls(ca_file=pki["ca.pem"])) is True
    shutil.copy(pki["server2.pem"], cert)  # signed by the other CA
    shutil.copy(pki["server2.key"], key)
    d.signal(signal.SIGHUP)
    wait_for(lambda: "event=tls.reloaded" in d.log(), 10, "the certificates reloaded")
    assert reaches(target, tls=Tls(ca_file=pki["rogue-ca.pem"])) is True
    assert reaches(target, tls=Tls(ca_file=pki["ca.pem"])) == "UNAVAILABLE"
    assert d.alive


def test_bad_security_config_is_refused_at_start(tmp_path):
    for flags, says in [(("--tls-cert", "x.pem"), "--tls-cert and --tls-key go together"),
                        (("--auth-token", "a", "--auth-token-file", "f"), "not both"),
                        (("--lease-timeout", "-1"), "--lease-timeout must be a number of seconds >= 0")]:
        with pytest.raises(ValueError, match=says):
            load_config(list(flags), {})
    empty = tmp_path / "empty"
    empty.write_text("")
    d = DaemonProcess("--auth-token-file", str(empty))
    try:
        d.start(ready=False)
        assert d.proc.wait(30) == 1
        assert "auth token file" in d.log() and "is empty" in d.log()
    finally:
        d.cleanup()


def test_a_storage_password_is_never_logged(daemons):
    # Nothing listens on port 1: the store's errors are logged too, with its name only.
    d = daemons("--storage", "redis://tenant:s3cret-a@127.0.0.1:1/0?password=s3cret-b&socket_connect_timeout=0.2",
                "--storage-policy", "write_through")
    with Client(d.target, timeout=10) as c:
        buffers = ShmKvBuffers.create(LAYOUT, NUM_PAGES)
        try:
            c.register("pw/tp0", LAYOUT, buffers.specs(), NUM_PAGES, host_pool_pages=16)
            [m] = c.match([tokens(0, 2)], include_storage=True)
            assert m.storage_tokens == 0
        finally:
            buffers.close()
    wait_for(lambda: "storage.unavailable" in d.log(), 10, "the store's error logged")
    log = d.log()
    assert "s3cret" not in log
    assert "redis://tenant:<set>@127.0.0.1:1/0?password=<set>&socket_connect_timeout=0.2" in log
