"""A Redis Cluster that speaks TLS only (a managed cluster with in-transit encryption,
Valkey with tls-cluster), through `rediss+cluster://`: refused as an unknown scheme
before (the store operators' review). Real redis-servers, a CA made here."""

import datetime
import ipaddress

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from radixkv_server.storage import StorageUnavailable, open_storage
from tests.storage.fleet import RedisCluster, lender_keys

PAGE = 4 << 10
PAGES = 32


def _certificate(subject: str, key, issuer: str, issuer_key, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture
def tls_cluster(tmp_path):
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    files = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "node.pem", "key": tmp_path / "node.key"}
    files["ca"].write_bytes(_certificate("test CA", ca_key, "test CA", ca_key, True).public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(_certificate("node", key, "test CA", ca_key, False).public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    cluster = RedisCluster(masters=3, replicas=0, tls={k: str(v) for k, v in files.items()}).start()
    yield cluster
    cluster.cleanup()


def test_pages_go_over_tls_to_every_shard_and_a_plain_connection_is_refused(tls_cluster):
    backend = open_storage(f"{tls_cluster.url}&prefix=tls:&socket_timeout=2&client_name=radixkv-tls-test")
    assert backend.name.startswith("rediss+cluster://")
    keys = lender_keys(21, PAGES)
    data = [np.random.default_rng(21 + i).bytes(PAGE) for i in range(PAGES)]
    backend.check()
    assert backend.put(list(zip(keys, data))) == PAGES
    assert backend.get(keys) == data
    for port in tls_cluster.ports:  # spread over the shards, each written over TLS
        with tls_cluster.client(port) as node:
            assert node.dbsize() > 0
            assert "radixkv-tls-test" in {c.get("name") for c in node.client_list()}
    backend.close()

    plain = open_storage(tls_cluster.url.replace("rediss+cluster", "redis+cluster").split("?")[0]
                         + "?socket_timeout=1&retries=0")
    with pytest.raises(StorageUnavailable):  # the nodes speak TLS only
        plain.check()
    plain.close()
