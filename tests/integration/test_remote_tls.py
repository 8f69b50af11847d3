"""The remote tier over TLS (rediss://) against a redis-server started here
with certificates made here: byte-for-byte round trips, a clear TlsError for
every certificate that should not verify, AUTH with an ACL user over TLS, a
TLS cluster, and the options reaching the tier from the CLI and the factory."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import kvtier
import numpy as np
import pytest
import redis
from kvtier.bench.redis_server import Certificates, RedisCluster, RedisServer, make_certificates
from kvtier.options import RemoteOptions
from kvtier.pool import HostPool
from kvtier.tiers.factory import build_tier
from kvtier.tiers.remote import RemoteTier

BLOCK = 16384


def K(i: int) -> bytes:
    return b"tls-%08d" % i


@pytest.fixture(scope="module")
def server(redis_tls: RedisServer) -> RedisServer:
    """Plain and TLS ports; clients must show a certificate of the CA; an
    ACL user ``kv`` may use kvtier's keys only."""
    redis_tls.cli("ACL", "SETUSER", "kv", "on", ">kv-secret", "~kvt:*", "+@all")
    return redis_tls


@pytest.fixture(scope="module")
def certs(server: RedisServer) -> Certificates:
    assert server.tls is not None
    return server.tls


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """A second CA: its certificates look right but are not the server's."""
    return make_certificates(tmp_path_factory.mktemp("other"))


def client_files(c: Certificates) -> dict[str, str]:
    return {
        "tls_ca_file": str(c.ca),
        "tls_cert_file": str(c.client_cert),
        "tls_key_file": str(c.client_key),
    }


def finish(t: RemoteTier, token: int | None) -> list[bool]:
    assert token is not None
    t.engine.wait(sorted(t.jobs.in_flight()))
    done = [c for c in t.poll() if c.token == token]
    assert len(done) == 1
    return list(done[0].key_ok or [])


@pytest.mark.parametrize("block", [BLOCK, 600_000])
def test_round_trip_over_tls_byte_for_byte(
    server: RedisServer, certs: Certificates, block: int
) -> None:
    """Values of one TLS record and of many (600 000 bytes: 37 records, and
    more than the client's 256 KiB receive piece), several per pipelined
    window; a byte flipped on the server is still caught."""
    rng = np.random.default_rng(block)
    with HostPool(16, block) as pool:
        t = RemoteTier(
            server.tls_url, block, namespace=str(uuid.uuid4()), job_items=8, **client_files(certs)
        )
        t.attach(pool)
        data = rng.integers(0, 256, (8, block), dtype=np.uint8)
        pool.view(0, 8)[:, :block] = data
        keys = [K(i) for i in range(8)]
        assert finish(t, t.submit_store(keys, list(range(8)))) == [True] * 8
        plain = redis.Redis(host="127.0.0.1", port=server.port)
        sk, at = t.server_key(keys[5]), 64 + block // 2
        plain.setrange(sk, at, bytes(b ^ 0xFF for b in plain.getrange(sk, at, at)))
        assert (
            finish(t, t.submit_load(keys, list(range(8, 16)))) == [True] * 5 + [False] + [True] * 2
        )
        for j in (0, 1, 2, 3, 4, 6, 7):
            assert np.array_equal(pool.view(8 + j)[:block], data[j]), j
        assert t.stats()["corrupt"] == 1 and t.stats()["url"] == server.tls_url
        t.close()


def test_certificate_of_another_ca_is_a_tls_error(
    server: RedisServer, certs: Certificates, other_ca: Certificates
) -> None:
    for ca in (str(other_ca.ca), None):  # another CA; the system's store
        with pytest.raises(kvtier.TlsError) as e:
            RemoteTier(
                server.tls_url, BLOCK, tls_ca_file=ca, tls_cert_file=str(certs.client_cert),
                tls_key_file=str(certs.client_key),
            )  # fmt: skip
        assert str(e.value) == (
            f"[Errno {errno.EPROTO}] TLS handshake with {server.tls_url} failed: "
            "certificate verify failed (self-signed certificate in certificate chain)"
        )
        assert isinstance(e.value, kvtier.IoError) and e.value.errno == errno.EPROTO


def test_certificate_for_another_name_is_a_tls_error(
    server: RedisServer, certs: Certificates
) -> None:
    with pytest.raises(kvtier.TlsError, match="hostname mismatch") as e:
        RemoteTier(server.tls_url, BLOCK, tls_server_name="kv.example.com", **client_files(certs))
    assert server.tls_url in str(e.value) and "certificate verify failed" in str(e.value)
    # the name the certificate carries verifies in place of the address
    RemoteTier(server.tls_url, BLOCK, tls_server_name="localhost", **client_files(certs)).close()


def test_client_certificate_missing_or_unknown_is_a_tls_error(
    server: RedisServer, certs: Certificates, other_ca: Certificates
) -> None:
    for cert, key in ((None, None), (str(other_ca.client_cert), str(other_ca.client_key))):
        with pytest.raises(kvtier.TlsError) as e:
            RemoteTier(
                server.tls_url, BLOCK, tls_ca_file=str(certs.ca), tls_cert_file=cert,
                tls_key_file=key,
            )  # fmt: skip
        msg = str(e.value)
        assert msg.startswith(f"[Errno {e.value.errno}] TLS with {server.tls_url} failed: "), msg
        # The server's alert when it arrives in time, else the reset that follows it.
        assert "alert" in msg or "wants a client certificate" in msg, msg


def test_tls_to_a_plain_port_and_plain_to_a_tls_port(
    server: RedisServer, certs: Certificates
) -> None:
    plain_as_tls = f"rediss://127.0.0.1:{server.port}"
    with pytest.raises(kvtier.TlsError) as e:
        RemoteTier(plain_as_tls, BLOCK, timeout_s=0.5, **client_files(certs))
    assert str(e.value).startswith(f"[Errno {e.value.errno}] TLS handshake with {plain_as_tls} ")
    with pytest.raises(kvtier.IoError) as io:
        RemoteTier(f"redis://127.0.0.1:{server.tls_port}", BLOCK, timeout_s=0.5)
    assert not isinstance(io.value, kvtier.TlsError)
    assert f"127.0.0.1:{server.tls_port}" in str(io.value)


def test_bad_tls_options_are_clear_errors(
    server: RedisServer, certs: Certificates, other_ca: Certificates, tmp_path: Path
) -> None:
    with pytest.raises(kvtier.InvalidArgument) as inv:
        RemoteTier(f"redis://kv:pw@127.0.0.1:{server.port}", BLOCK, tls_ca_file=str(certs.ca))
    assert str(inv.value) == (
        f"tls_ca_file given for 'redis://kv:***@127.0.0.1:{server.port}': TLS needs a "
        "rediss:// (or rediss-cluster://) URL"
    )
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(kvtier.InvalidArgument, match=f"tls_cert_file '{missing}' is not a file"):
        RemoteTier(server.tls_url, BLOCK, tls_cert_file=missing)
    with pytest.raises(kvtier.InvalidArgument, match="a TLS client key needs a client certificate"):
        RemoteTier(server.tls_url, BLOCK, tls_key_file=str(certs.client_key))
    with pytest.raises(
        kvtier.TlsError, match=r"cannot load TLS client key .*: key values mismatch"
    ):
        RemoteTier(
            server.tls_url, BLOCK, tls_cert_file=str(certs.client_cert),
            tls_key_file=str(other_ca.client_key),
        )  # fmt: skip
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(kvtier.TlsError, match=f"cannot load TLS CA file {garbage}: "):
        RemoteTier(server.tls_url, BLOCK, tls_ca_file=str(garbage))


def test_acl_user_over_tls(server: RedisServer, certs: Certificates) -> None:
    url = f"rediss://kv:kv-secret@127.0.0.1:{server.tls_port}"
    with HostPool(4, BLOCK) as pool:
        t = RemoteTier(url, BLOCK, namespace=str(uuid.uuid4()), **client_files(certs))
        t.attach(pool)
        pool.view(0)[:] = 7
        assert finish(t, t.submit_store([K(1)], [0])) == [True]
        assert finish(t, t.submit_load([K(1)], [1])) == [True]
        assert (pool.view(1) == 7).all()
        assert t.stats()["url"] == f"rediss://kv:***@127.0.0.1:{server.tls_port}"
        t.close()
    # The ACL user really is in force: its commands are refused outside kvt:*.
    acl = redis.Redis(host="127.0.0.1", port=server.port, username="kv", password="kv-secret")
    with pytest.raises(redis.exceptions.NoPermissionError):
        acl.get("outside")
    with pytest.raises(kvtier.IoError) as e:
        RemoteTier(url.replace("kv-secret", "wrong"), BLOCK, **client_files(certs))
    assert not isinstance(e.value, kvtier.TlsError) and e.value.errno == errno.EACCES
    assert "WRONGPASS" in str(e.value) and "wrong" not in str(e.value).replace("WRONGPASS", "")


def test_tls_cluster_with_an_acl_user(tmp_path: Path, certs: Certificates) -> None:
    """Every node's connection (the seed's, the slot map's, each master's)
    runs TLS and AUTH; keys spread over all three masters."""
    c = RedisCluster(tmp_path, tls=certs)
    try:
        for n in c.nodes:
            n.cli("ACL", "SETUSER", "kv", "on", ">kv-secret", "~kvt:*", "+@all")
        url = c.tls_url.replace("rediss-cluster://", "rediss-cluster://kv:kv-secret@")
        with HostPool(48, BLOCK) as pool:
            t = RemoteTier(url, BLOCK, namespace=str(uuid.uuid4()), **client_files(certs))
            t.attach(pool)
            assert sorted(t.nodes) == sorted(f"127.0.0.1:{n.tls_port}" for n in c.nodes)
            rng = np.random.default_rng(3)
            data = rng.integers(0, 256, (24, BLOCK), dtype=np.uint8)
            pool.view(0, 24)[:] = data
            keys = [K(i) for i in range(24)]
            assert finish(t, t.submit_store(keys, list(range(24)))) == [True] * 24
            assert finish(t, t.submit_load(keys, list(range(24, 48)))) == [True] * 24
            assert np.array_equal(pool.view(24, 24), data)
            per_node = [int(n.cli("DBSIZE").strip()) for n in c.nodes]
            assert sum(per_node) == 24 and all(per_node), per_node
            t.close()
    finally:
        c.stop()


def test_tls_options_reach_the_tier_from_config_and_cli(
    server: RedisServer, certs: Certificates, tmp_path: Path
) -> None:
    opts = RemoteOptions(
        server.tls_url,
        tls_ca_file=str(certs.ca),
        tls_cert_file=str(certs.client_cert),
        tls_key_file=str(certs.client_key),
        tls_server_name="localhost",
    )
    build_tier(opts, BLOCK, "tls-config").close()
    with pytest.raises(kvtier.TlsError, match="hostname mismatch"):
        build_tier(replace(opts, tls_server_name="x.example"), BLOCK, "tls-config")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "replay", "--max-requests", "200",
         "--host-blocks", "32", "--block-bytes", "16KiB", "--remote", server.tls_url,
         "--remote-tls-ca", str(certs.ca), "--remote-tls-cert", str(certs.client_cert),
         "--remote-tls-key", str(certs.client_key), "--no-progress",
         "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    js = json.loads((tmp_path / "r.json").read_text())
    assert js["verify_failures"] == 0 and js["hit_blocks"]["remote"] > 0
    bad = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "replay", "--max-requests", "10",
         "--remote", server.tls_url, "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.startswith(f"kvtier: error: [Errno {errno.EPROTO}] TLS handshake with ")
    assert "certificate verify failed" in bad.stderr
