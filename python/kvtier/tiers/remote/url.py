"""How to reach a Redis / Valkey pool: its URL (``redis://``, ``rediss://``,
``redis-cluster://``, ``rediss-cluster://``; user and password, database),
redacted for logs, and :class:`RemoteConnection`, the plain settings a
native client is opened from in any process.

Process: any (the scheduler's remote tier, the workers' readers, SGLang's
backend). Who calls: :mod:`kvtier.tiers.remote`, its worker side, the
benchmarks. Nothing blocks but :meth:`RemoteConnection.open_store`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from kvtier.errors import InvalidArgument

if TYPE_CHECKING:
    from kvtier import _native


_SCHEMES = {  # scheme -> (cluster, tls)
    "redis": (False, False),
    "rediss": (False, True),
    "redis-cluster": (True, False),
    "rediss-cluster": (True, True),
}


def default_connections() -> int:
    """Connections (engine worker threads, one connection each per server) a
    remote tier opens when not told: 4 per core, at least 4, at most 8.

    Why: a large value goes one at a time per connection (see the client), so
    the server thread is kept busy by many connections rather than by deep
    pipelines. On 2 cores against one loopback redis-server (`kvtier bench
    remote --peer lmcache`, 256 KiB and 2 MiB values) 8 connections matched
    LMCache's client with its own default of 8 workers, 2 connections stored
    0.7-0.8 of what it did; in a live engine (`kvtier bench serve`, host+redis) the
    later turns took 40-43 ms with 8 against 47-84 ms with 2. One server
    thread is the limit beyond that (its busy share under loads: 0.9-0.97)."""
    return max(4, min(8, 4 * (os.cpu_count() or 1)))


def parse_url(url: str) -> dict[str, Any]:
    """``redis://[user[:password]@]host:port[/db]`` or
    ``redis-cluster://[user[:password]@]host:port[,host:port...]``; ``rediss``
    in place of ``redis`` for TLS."""
    try:
        parts = urlsplit(url)
        path = parts.path
    except ValueError as e:  # e.g. an unclosed [IPv6 address
        raise InvalidArgument(f"cannot parse remote URL {url!r}: {e}") from None
    if parts.scheme not in _SCHEMES:
        raise InvalidArgument(
            "remote URL must start with redis://, rediss://, redis-cluster:// or "
            f"rediss-cluster://, got {url!r}"
        )
    netloc = parts.netloc
    user = password = ""
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, password = cred.partition(":")
        if not password:  # redis://:password@host or redis://password@host
            user, password = "", user
        user, password = unquote(user), unquote(password)
    seeds = []
    for hp in netloc.split(","):
        host, _, port = hp.rpartition(":")
        if not host:
            host, port = hp, "6379"
        try:
            n = int(port)
        except ValueError:
            n = 0
        if not 0 < n < 65536:
            raise InvalidArgument(f"bad port {port!r} in remote URL {url!r} (1-65535)")
        if not host.strip("[]"):
            raise InvalidArgument(f"no server in remote URL {url!r}")
        seeds.append((host.strip("[]"), n))
    db = 0
    if path.strip("/"):
        try:
            db = int(path.strip("/"))
        except ValueError:
            db = -1
        if db < 0:
            raise InvalidArgument(f"bad database number in remote URL {url!r}")
    cluster, tls = _SCHEMES[parts.scheme]
    return {
        "seeds": seeds,
        "cluster": cluster,
        "user": user,
        "password": password,
        "db": db,
        "tls": tls,
    }


TLS_FIELDS = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name")
"""The TLS settings of :class:`~kvtier.options.tiers.RemoteOptions`, in the
order the native client takes them."""


def check_tls_options(url: str, cfg: dict[str, Any], tls: dict[str, str | None]) -> None:
    """Raises InvalidArgument for TLS options a URL cannot use (``cfg``: its
    :func:`parse_url`) or files that are not there."""
    given = [k for k, v in tls.items() if v]
    if given and not cfg["tls"]:
        raise InvalidArgument(
            f"{', '.join(given)} given for {redact_url(url)!r}: TLS needs a rediss:// "
            "(or rediss-cluster://) URL"
        )
    for k in given:
        if k.endswith("_file") and not os.path.isfile(str(tls[k])):
            raise InvalidArgument(f"{k} {tls[k]!r} is not a file")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for stats and reports)."""
    parts = urlsplit(url)
    cred, at, hosts = parts.netloc.rpartition("@")
    if not at:
        return url
    user, sep, _ = cred.partition(":")
    return parts._replace(netloc=(f"{user}:***" if sep else "***") + "@" + hosts).geturl()


@dataclass(frozen=True)
class RemoteConnection:
    """How to open a native client to one Redis/Valkey pool: the URL's parts
    (:func:`parse_url`), timeouts, pipelining, TTL, namespace, TLS files.
    Plain values: it travels in a :class:`~kvtier.tiers.remote.worker.RemoteReaderSpec`
    to engine workers, which open their own client to the same pool.
    ``lazy``: start even when the servers do not answer yet (``degraded_ok``)."""

    seeds: tuple[tuple[str, int], ...]
    cluster: bool
    user: str
    password: str = field(repr=False)
    db: int
    connect_timeout_ms: int
    io_timeout_ms: int
    pipeline: int
    ttl_ms: int
    lazy: bool
    ns: bytes
    window_bytes: int
    tls: bool
    tls_settings: tuple[str, ...] = ("", "", "", "")  # TLS_FIELDS' values, "" when not given

    def open_store(self) -> _native.RemoteStore:
        """A connected native client. Blocks while it connects (and, for a
        cluster, reads the slot map)."""
        from kvtier import _native

        return _native.RemoteStore(
            list(self.seeds),
            self.cluster,
            self.user,
            self.password,
            self.db,
            self.connect_timeout_ms,
            self.io_timeout_ms,
            self.pipeline,
            self.ttl_ms,
            self.lazy,
            self.ns,
            self.window_bytes,
            self.tls,
            *self.tls_settings,
        )
