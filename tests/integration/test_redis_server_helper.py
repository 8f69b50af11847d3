"""The benchmarks' local Redis starts from a relative work directory
(``kvtier bench serve --out build/x``): redis-server changes into --dir
before it opens --logfile, so both must be absolute."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from kvtier.bench.redis_server import RedisServer


def test_redis_server_starts_from_a_relative_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    server = RedisServer(Path("rel") / "work")
    try:
        assert server.dir.is_absolute()
        assert redis.Redis(port=server.port).ping() is True
        assert (tmp_path / "rel" / "work" / f"redis-{server.port}" / "redis.log").exists()
    finally:
        server.stop()
