"""The options of kvtier inside an engine, beyond its tiers' own:
:class:`VllmOptions` (the connector and its manager) and
:class:`SglangOptions` (the HiCache backend), defined once like the tiers'.

Process: any; pure and cheap (the vLLM shim reads them in its API server).
Who calls: :mod:`kvtier.options.surfaces` (which parses an engine's extra
config into them), the shims. Nothing blocks; bad values raise
:class:`~kvtier.errors.InvalidArgument` at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtier.errors import InvalidArgument
from kvtier.options.fields import check_positive, opt
from kvtier.scheduler.options import PARTIAL_STORES
from kvtier.worker import WAIT_TIMEOUT_S

__all__ = ["EngineOptions", "SglangOptions", "VllmOptions"]

_VLLM = ("vllm",)


@dataclass(frozen=True)
class EngineOptions:
    """What every engine's kvtier takes beyond its tiers."""

    PREFIX: ClassVar[str] = ""

    namespace: str = opt(
        "",
        "extra namespace mixed into every key",
        surfaces=("vllm", "sglang"),
        absent="the secondary tiers take `namespace` as their own argument; replay has one engine",
    )
    node: str | None = opt(
        None,
        "the Unix socket of a kvtier node (e.g. /run/kvtier/node.sock) that owns the host "
        "pool and tiers of every engine on the machine; unset: this engine owns its own",
        surfaces=("vllm", "sglang"),
        absent="a node serves engines: replay and the secondary tiers run in one process",
    )


@dataclass(frozen=True)
class VllmOptions(EngineOptions):
    """kvtier inside vLLM: how its connector and manager use the tiers."""

    num_slots: int | None = opt(
        None,
        "host slots per rank; required with pipeline parallelism (see kvtier plan --host-memory)",
        kind="int",
        surfaces=_VLLM,
    )
    stats_path: str | None = opt(
        None,
        "write kvtier's counters and host occupancy here as JSON at shutdown",
        surfaces=_VLLM,
    )
    lower_writes: str = opt(
        "on_store",
        "when a block is written to the disk and Redis tiers: on_store (when "
        "stored in the host tier) or on_reuse (on its first reuse from the host tier: blocks "
        "nobody comes back for are never written)",
        choices=("on_store", "on_reuse"),
        surfaces=_VLLM,
    )
    partial_stores: str = opt(
        "prefix",
        "when not every new block of a request fits in the host tier: prefix (store "
        "the head that fits, evicting), free (the head that fits in free slots) or none "
        "(store nothing, as vLLM's own manager)",
        choices=PARTIAL_STORES,
        surfaces=_VLLM,
    )
    promote: bool = opt(
        True,
        "copy a disk hit into the host tier before loading it (false: the worker "
        "streams every disk hit into the engine's cache itself)",
        kind="bool",
        surfaces=_VLLM,
    )
    remote_probe: bool | None = opt(
        None,
        "keys the Redis tier does not know yet are read with one GET into a host slot "
        "(true) or checked with EXISTS first (false); none: true when kvtier_admit_after is 1",
        kind="bool",
        surfaces=_VLLM,
    )
    fenced_reads: bool = opt(
        True,
        "under KVTierConnector, a returning prefix read ahead from Redis is HIT before "
        "its values arrive and the engine's copies wait for each block's value (false: the "
        "lookup waits for every value first)",
        kind="bool",
        surfaces=_VLLM,
    )
    layered_loads: bool = opt(
        True,
        "a hit loaded within the step is waited for layer by layer: each attention "
        "layer waits only for its own KV (false: the forward pass waits for the whole load)",
        kind="bool",
        surfaces=_VLLM,
    )
    stream_slots: int | None = opt(
        None,
        "staging slots per worker for blocks moved straight between the engine and the "
        "disk or Redis tier when the host tier has no room (none: 32, or with layered loads "
        "enough for sync_load_budget_bytes; 0 turns streaming off)",
        kind="int",
        surfaces=_VLLM,
    )
    transfer_wait_s: float = opt(
        WAIT_TIMEOUT_S,
        "a worker waiting for one of its copies between the engine's KV cache and kvtier "
        "(a load the forward pass needs, a store before its blocks are reused) raises an "
        "error naming the job after this long instead of waiting for ever (0: no bound)",
        kind="seconds",
        surfaces=_VLLM,
    )
    scan_wait_ms: float = opt(
        20.0,
        "a request's first lookup that misses the host tier reads its prefix from the "
        "lower tiers and waits for it, at most this long per scheduler step (0: never wait, "
        "hits become readable a step later)",
        kind="milliseconds",
        surfaces=_VLLM,
    )
    scan_bytes: int = opt(
        64 << 20,
        "at most this much read per scheduler step by such waits",
        kind="bytes",
        surfaces=_VLLM,
    )

    def __post_init__(self) -> None:
        check_positive(num_slots=self.num_slots, scan_bytes=self.scan_bytes)
        if not self.transfer_wait_s >= 0:
            raise InvalidArgument(f"transfer_wait_s must be >= 0, got {self.transfer_wait_s}")
        if not self.scan_wait_ms >= 0:
            raise InvalidArgument(f"scan_wait_ms must be >= 0, got {self.scan_wait_ms}")
        if self.stream_slots is not None and self.stream_slots < 0:
            raise InvalidArgument(f"stream_slots must be >= 0, got {self.stream_slots}")

    @property
    def lower_admit_after(self) -> int:
        """on_reuse: lower tiers take a block on its second offer, the first
        being its store, the second its first reuse."""
        return 2 if self.lower_writes == "on_reuse" else 1


@dataclass(frozen=True)
class SglangOptions(EngineOptions):
    """kvtier as SGLang's HiCache storage backend, beyond its tiers."""

    staging_bytes: int | None = opt(
        None,
        "host memory for pages on their way to or from the tiers, per rank and pool "
        "(none: SGLang's batch of 128 pages each way, at most 1GiB)",
        kind="bytes",
        surfaces=("sglang",),
    )
