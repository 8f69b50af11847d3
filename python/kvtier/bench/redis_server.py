"""Real redis-server processes on 127.0.0.1 at free ports, standalone or a
3-master cluster, stopped by PID; nothing reaches beyond loopback.

Who calls: ``kvtier bench remote`` without ``--url`` and the tests. Starting
and stopping block until the server answers or is gone."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


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
    ) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.port = port or free_port(need_bus=cluster)
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        args = [
            "redis-server",
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

    def cli(self, *args: str) -> str:
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
    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes = [RedisServer(workdir, cluster=True) for _ in range(masters)]
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *addrs,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
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

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
