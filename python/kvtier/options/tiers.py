"""Each tier's options, defined once: :class:`HostOptions`,
:class:`DiskOptions`, :class:`RemoteOptions`.

Every field says its default, kind (and with it the unit) and meaning, and
where a user gives it (:data:`~kvtier.options.fields.SURFACES`); vLLM's and
SGLang's extra-config keys, the secondary tiers' arguments, ``kvtier
replay``'s flags and the configuration reference are derived from these
(:mod:`kvtier.options.surfaces`). The tiers take these objects.

Process: any; pure and cheap (the vLLM shim reads them in its API server):
no engine, no native core. Who calls: the tier constructors, the factory,
the surfaces. Nothing blocks; the checks run at construction and raise
:class:`~kvtier.errors.InvalidArgument`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtier.errors import InvalidArgument
from kvtier.options.fields import check_positive, opt
from kvtier.tiers.events import EVENT_LOG_KEYS
from kvtier.tiers.remote.stream import STREAM_MAXLEN
from kvtier.units import FreeFraction

__all__ = [
    "DISK_POLICIES",
    "DiskOptions",
    "HostOptions",
    "RemoteOptions",
    "parse_disk_policy",
]

DISK_POLICIES = ("lru", "clock", "plfu")
"""The disk tier's native eviction policies (``clock:N``: N in 1..255)."""

_PY = "a Python API setting (engine tuning kvtier sets itself)"


def parse_disk_policy(spec: str) -> tuple[str, int]:
    """``lru`` | ``clock`` | ``clock:N`` | ``plfu`` -> (name, N). Raises InvalidArgument."""
    name, _, arg = spec.lower().partition(":")
    if name not in DISK_POLICIES or (arg and (name != "clock" or not arg.isdigit())):
        msg = f"disk tier policy must be lru, clock, clock:N (N in 1..255) or plfu, not {spec!r}"
        raise InvalidArgument(msg)
    n = int(arg) if arg else 1
    if not 1 <= n <= 255:
        raise InvalidArgument(f"disk tier policy {spec!r}: N must be in 1..255")
    return name, n


@dataclass(frozen=True)
class HostOptions:
    """The host tier: pinned shared-memory slots in front of every other tier."""

    PREFIX: ClassVar[str] = "host"

    bytes: int | None = opt(
        None,
        "host tier size across all workers (vLLM: required; SGLang: a memory tier of "
        "the pages stored last in front of disk and Redis, per rank and KV pool, 0: none)",
        kind="bytes",
        surfaces=("vllm", "sglang"),
        absent="kvtier replay sizes its host tier with --host or --host-blocks (which take "
        "'inf' without data); a secondary tier has vLLM's host tier in front",
    )
    policy: str = opt(
        "lru",
        "eviction policy: lru, arc, plfu or a dotted class path (kvtier replay also takes "
        "belady, the offline bound)",
        key="kvtier_policy",
        flags=("--policy",),
        surfaces=("vllm", "cli"),
        absent="SGLang's memory tier keeps the pages used last (LRU); secondary tiers sit "
        "under vLLM's own host tier",
    )
    admit_after: int = opt(
        1,
        "store a block after it was offered this many times",
        kind="int",
        key="kvtier_admit_after",
        flags=("--admit-after",),
        surfaces=("vllm", "cli"),
        absent="SGLang stores what its HiCache writes through; secondary tiers sit under "
        "vLLM's own host tier",
    )
    prefix_eviction: bool = opt(
        True,
        "evict the tails of prefix chains first (false: the policy's victims as ranked)",
        kind="bool",
        key="kvtier_prefix_eviction",
        flags=("--prefix-eviction",),
        surfaces=("vllm", "cli"),
        absent="SGLang's memory tier keeps the pages used last",
    )
    max_tracked: int = opt(
        1 << 20,
        "keys the admission filter remembers while counting offers",
        kind="int",
        surfaces=(),
        absent=_PY,
    )

    def __post_init__(self) -> None:
        check_positive(bytes=self.bytes if self.bytes else None, max_tracked=self.max_tracked)
        if self.admit_after < 1:
            raise InvalidArgument(f"admit_after must be >= 1, got {self.admit_after}")


@dataclass(frozen=True)
class DiskOptions:
    """The disk tier: checksummed records in preallocated slab files, read
    and written with io_uring (or pread), kept across restarts."""

    PREFIX: ClassVar[str] = "disk"

    path: str | None = opt(
        None,
        "directory of the disk tier (created 0700; none: no disk tier)",
        flags=("--disk",),
        absent="",
    )
    capacity_bytes: int | FreeFraction = opt(
        100 << 30,
        "disk tier size, or a share of the free space",
        kind="capacity",
        key="kvtier_disk_bytes",
        flags=("--disk",),
    )
    reserve_bytes: int | None = opt(
        None,
        "free space the disk tier never takes (none: 5% of the file system, at most 4GiB)",
        kind="bytes",
        key="kvtier_disk_reserve",
    )
    policy: str = opt("lru", "eviction policy (native): lru, clock, clock:N or plfu")
    admit_after: int = opt(
        1,
        "write a block after it was offered this many times (vLLM: see kvtier_lower_writes)",
        kind="int",
        flags=("--disk-admit-after", "--lower-admit-after"),
    )
    write_budget_bps: float | None = opt(
        None,
        "disk write budget (none: unbounded)",
        kind="rate",
        key="kvtier_disk_write_budget",
    )
    backend: str = opt(
        "auto",
        "I/O backend: auto (io_uring where the kernel allows), io_uring or pread",
        choices=("auto", "io_uring", "pread"),
    )
    queue_depth: int = opt(32, "I/Os in flight per worker thread", kind="int")
    timeout_s: float = opt(
        30.0,
        "a disk job not done after this fails (its memory stays held until it ends)",
        kind="seconds",
    )
    max_io_bytes: int = opt(
        1 << 20, "largest single read or write", kind="bytes", surfaces=(), absent=_PY
    )
    num_threads: int = opt(2, "worker threads", kind="int", surfaces=(), absent=_PY)
    inflight_bytes: int = opt(
        512 << 20, "bytes in flight across jobs", kind="bytes", surfaces=(), absent=_PY
    )
    job_bytes: int = opt(8 << 20, "bytes per job", kind="bytes", surfaces=(), absent=_PY)
    sync: bool = opt(
        False, "fsync every batch (tests of crash safety)", kind="bool", surfaces=(), absent=_PY
    )
    no_data: bool = opt(
        False,
        "index only, no bytes move (policy studies)",
        kind="bool",
        surfaces=(),
        absent="kvtier replay's --no-data sets it; an engine always moves its bytes",
    )
    event_log_keys: int = opt(
        EVENT_LOG_KEYS, "keys kept for take_events", kind="int", surfaces=(), absent=_PY
    )

    def __post_init__(self) -> None:
        check_positive(
            capacity_bytes=self.capacity_bytes,
            write_budget_bps=self.write_budget_bps,
            queue_depth=self.queue_depth,
            timeout_s=self.timeout_s,
            max_io_bytes=self.max_io_bytes,
            num_threads=self.num_threads,
            inflight_bytes=self.inflight_bytes,
            job_bytes=self.job_bytes,
        )
        if self.reserve_bytes is not None and self.reserve_bytes < 0:
            raise InvalidArgument(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")
        parse_disk_policy(self.policy)
        if self.backend not in ("auto", "io_uring", "pread"):
            raise InvalidArgument(f"backend must be auto, io_uring or pread, not {self.backend!r}")
        if self.admit_after < 1:
            raise InvalidArgument(f"admit_after must be >= 1, got {self.admit_after}")


@dataclass(frozen=True)
class RemoteOptions:
    """The remote tier: a Redis / Valkey pool, standalone or cluster, shared
    by engines across nodes."""

    PREFIX: ClassVar[str] = "remote"

    url: str | None = opt(
        None,
        "redis://[USER:PASS@]HOST:PORT or redis-cluster://H:P,H:P; rediss:// and "
        "rediss-cluster:// for TLS (none: no remote tier)",
        flags=("--remote",),
    )
    ttl_s: float | None = opt(None, "expiry of stored values (none: never)", kind="seconds")
    timeout_s: float = opt(2.0, "connect and I/O timeout", kind="seconds")
    admit_after: int = opt(
        1,
        "write a block after it was offered this many times (vLLM: see kvtier_lower_writes)",
        kind="int",
        flags=("--remote-admit-after", "--lower-admit-after"),
    )
    write_budget_bps: float | None = opt(None, "write budget (none: unbounded)", kind="rate")
    degraded_ok: bool = opt(
        False, "a cluster with slots no node serves is used for the slots served", kind="bool"
    )
    known_capacity: int = opt(
        1 << 20,
        "keys whose existence on the server the tier remembers (about 230 B of the "
        "process's heap each)",
        kind="int",
    )
    tls_ca_file: str | None = opt(
        None,
        "rediss: PEM CA file (none: the system's trust store)",
        flags=("--remote-tls-ca-file", "--remote-tls-ca"),
    )
    tls_cert_file: str | None = opt(
        None,
        "rediss: PEM client certificate",
        flags=("--remote-tls-cert-file", "--remote-tls-cert"),
    )
    tls_key_file: str | None = opt(
        None,
        "rediss: PEM key of the client certificate",
        flags=("--remote-tls-key-file", "--remote-tls-key"),
    )
    tls_server_name: str | None = opt(None, "rediss: name the server's certificate must carry")
    pool_events: int = opt(
        STREAM_MAXLEN,
        "append the stores the server acknowledged to the pool's own event "
        "stream (which `kvtier events URL` tails for every engine on the pool), keeping about "
        "this many entries",
        kind="entries",
        key="kvtier_pool_events",
    )
    pool_index: bool | None = opt(
        None,
        "answer lookups from what the pool's event stream says the pool holds, with no "
        "round trip (none: with pool_events; off on a pool shared with writers whose stream "
        "is off)",
        kind="bool",
        key="kvtier_pool_index",
    )
    engine_id: str | None = opt(
        None,
        "what names this engine in the pool's event stream (none: host:pid)",
        key="kvtier_engine_id",
    )
    worker_io: bool = opt(
        False,
        "the engine's worker reads and writes the pool itself",
        kind="bool",
        surfaces=(),
        absent="set by the vLLM connector where it reports failed loads",
    )
    pipeline: int = opt(
        64, "commands in flight per connection", kind="int", surfaces=(), absent=_PY
    )
    window_bytes: int = opt(
        512 << 10, "bytes in flight per connection", kind="bytes", surfaces=(), absent=_PY
    )
    num_threads: int | None = opt(
        None, "connections (none: 4 per core, 4 to 8)", kind="int", surfaces=(), absent=_PY
    )
    inflight_bytes: int = opt(
        512 << 20, "bytes in flight across jobs", kind="bytes", surfaces=(), absent=_PY
    )
    job_items: int = opt(64, "values per job", kind="int", surfaces=(), absent=_PY)
    negative_ttl_s: float = opt(
        1.0, "how long a key found absent is remembered", kind="seconds", surfaces=(), absent=_PY
    )
    known_ttl_s: float = opt(
        2.0, "how long a key found present is remembered", kind="seconds", surfaces=(), absent=_PY
    )
    worker_nice: int | None = opt(
        None,
        "niceness of the I/O threads (none: KVTIER_IO_NICE or 10)",
        kind="int",
        surfaces=(),
        absent=_PY,
    )
    event_log_keys: int = opt(
        EVENT_LOG_KEYS, "keys kept for take_events", kind="int", surfaces=(), absent=_PY
    )

    def __post_init__(self) -> None:
        check_positive(
            ttl_s=self.ttl_s,
            timeout_s=self.timeout_s,
            pipeline=self.pipeline,
            window_bytes=self.window_bytes,
            job_items=self.job_items,
            known_ttl_s=self.known_ttl_s,
            write_budget_bps=self.write_budget_bps,
            known_capacity=self.known_capacity,
            num_threads=self.num_threads,
            inflight_bytes=self.inflight_bytes,
        )
        if self.pool_events < 0:
            raise InvalidArgument(f"pool_events must be >= 0 (0: off), got {self.pool_events}")
        if self.pool_index and not self.pool_events:
            raise InvalidArgument("pool_index reads the pool's event stream: it needs pool_events")
        if self.admit_after < 1:
            raise InvalidArgument(f"admit_after must be >= 1, got {self.admit_after}")
        if self.engine_id is not None and (not self.engine_id.strip() or len(self.engine_id) > 256):
            raise InvalidArgument(
                f"engine_id must be a non-blank name of at most 256 characters, "
                f"got {self.engine_id!r}"
            )
