"""The tier factory: lower tiers built from one configuration shape.

Process: the engine's scheduler (or ``kvtier replay``, the benchmarks).

Every front end (``kvtier replay`` through the CLI, the vLLM shim's
``kv_connector_extra_config`` and its secondary tiers) fills a
:class:`TierConfig` and asks here for tiers, so a setting means the same
thing wherever it is given and a new tier option is added in one place.

Who calls: :mod:`kvtier.replay`, :mod:`kvtier.integrations.vllm`. Building a
tier blocks (a disk tier checks and preallocates its directory, a remote
tier connects); nothing else does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import InvalidArgument
from kvtier.tiers.base import LowerTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool_stream import STREAM_MAXLEN
from kvtier.tiers.remote import RemoteTier
from kvtier.units import FreeFraction, parse_capacity


@dataclass(frozen=True)
class TierConfig:
    """The lower tiers to build and their settings (None: no such tier).

    Sizes are in bytes and durations in seconds (parse text with
    :mod:`kvtier.units` first); the disk capacity may also be a share of the
    free space (:func:`kvtier.units.parse_capacity`, ``"80%"``), resolved
    when the tier opens its directory. ``disk_reserve_bytes``: free space the
    disk tier never takes (None: 5% of the file system, at most 4 GiB).
    ``remote_known_capacity``: keys whose existence on the server the
    remote tier remembers (about 230 B of the process's heap each).
    ``no_data``: index only, no bytes move.
    """

    disk_path: str | None = None
    disk_bytes: int | FreeFraction = 100 << 30
    disk_reserve_bytes: int | None = None
    disk_policy: str = "lru"
    disk_admit_after: int = 1
    disk_write_budget_bps: float | None = None
    disk_backend: str = "auto"
    disk_queue_depth: int = 32
    disk_timeout_s: float = 30.0
    remote_url: str | None = None
    remote_ttl_s: float | None = None
    remote_timeout_s: float = 2.0
    remote_admit_after: int = 1
    remote_degraded_ok: bool = False
    remote_known_capacity: int = 1 << 20
    # TLS (rediss://): PEM trust anchors (default: the system's), a client
    # certificate and its key, the name the server's certificate must carry.
    remote_tls_ca_file: str | None = None
    remote_tls_cert_file: str | None = None
    remote_tls_key_file: str | None = None
    remote_tls_server_name: str | None = None
    # The engine's worker may read and write the pool itself (RemoteTier's
    # worker_io): only where the connector reports failed loads.
    remote_worker_io: bool = False
    # The pool's own event stream (RemoteTier's pool_events): whether this
    # engine appends its stores to it, and what names the engine there
    # (None: host:pid).
    remote_pool_events: bool = True
    # Lookups answered from the stream (RemoteTier's pool_index; None: with
    # remote_pool_events).
    remote_pool_index: bool | None = None
    remote_engine_id: str | None = None
    no_data: bool = False


def parse_disk_spec(spec: str) -> tuple[str, int | FreeFraction]:
    """``DIR:SIZE`` as given on the command line (``/mnt/nvme/kv:100GiB``,
    ``/mnt/nvme/kv:80%`` for a share of the free space)."""
    path, sep, size = spec.rpartition(":")
    if not sep or not path:
        raise InvalidArgument(
            f"--disk wants DIR:SIZE (e.g. /mnt/nvme/kv:100GiB or DIR:80%), got {spec!r}"
        )
    try:
        return path, parse_capacity(size)
    except InvalidArgument as e:
        raise InvalidArgument(f"--disk {spec!r}: {e}") from None


def configured(cfg: TierConfig) -> list[str]:
    """The kinds of lower tier ``cfg`` asks for, fastest first."""
    return [k for k, on in (("disk", cfg.disk_path), ("remote", cfg.remote_url)) if on is not None]


def build_tier(
    kind: str, cfg: TierConfig, block_bytes: int, namespace: str, name: str | None = None
) -> LowerTier:
    """One lower tier, ``"disk"`` (in ``cfg.disk_path``, created 0700 when
    missing) or ``"remote"`` (on ``cfg.remote_url``), named ``name`` (default:
    the kind). Blocks while the disk tier preallocates or the remote one connects.

    ``namespace`` names what makes this engine's bytes compatible
    (:func:`kvtier.tiers.records.namespace_name`).
    """
    if kind not in configured(cfg):
        raise InvalidArgument(f"no {kind} tier configured (its path or URL is None)")
    if kind == "disk":
        assert cfg.disk_path is not None
        os.makedirs(cfg.disk_path, mode=0o700, exist_ok=True)
        return DiskTier(
            Path(cfg.disk_path), cfg.disk_bytes, block_bytes, namespace=namespace,
            reserve_bytes=cfg.disk_reserve_bytes,
            name=name or kind, policy=cfg.disk_policy, admit_after=cfg.disk_admit_after,
            write_budget_bps=cfg.disk_write_budget_bps, backend=cfg.disk_backend,
            queue_depth=cfg.disk_queue_depth, timeout_s=cfg.disk_timeout_s, no_data=cfg.no_data,
        )  # fmt: skip
    assert cfg.remote_url is not None
    return RemoteTier(
        cfg.remote_url, block_bytes, namespace=namespace, name=name or kind,
        ttl_s=cfg.remote_ttl_s, timeout_s=cfg.remote_timeout_s,
        admit_after=cfg.remote_admit_after, degraded_ok=cfg.remote_degraded_ok,
        known_capacity=cfg.remote_known_capacity,
        tls_ca_file=cfg.remote_tls_ca_file, tls_cert_file=cfg.remote_tls_cert_file,
        tls_key_file=cfg.remote_tls_key_file, tls_server_name=cfg.remote_tls_server_name,
        worker_io=cfg.remote_worker_io,
        pool_events=STREAM_MAXLEN if cfg.remote_pool_events else 0,
        pool_index=cfg.remote_pool_index,
        engine_id=cfg.remote_engine_id,
    )  # fmt: skip


def build_tiers(wanted: Iterable[tuple[str, TierConfig, int, str]]) -> list[LowerTier]:
    """One tier per ``(kind, cfg, block_bytes, namespace)`` of ``wanted``, in
    order (:func:`build_tier`, named by their kind), all or nothing: if
    building one fails, those already built are closed (a disk tier lets go of
    its directory, a remote one of its connections) before the error
    propagates. Blocks while they are built.
    """
    tiers: list[LowerTier] = []
    try:
        for kind, cfg, block_bytes, namespace in wanted:
            # One at a time, not extend(): those built before a failure must be closed.
            tiers.append(build_tier(kind, cfg, block_bytes, namespace))
    except BaseException:
        close_after_failure(tiers)
        raise
    return tiers


def close_after_failure(tiers: Iterable[LowerTier]) -> None:
    """Close every tier of ``tiers`` while an error propagates: a tier that
    fails to close is logged, not raised, so the others still close and the
    error that made the caller give up is the one reported. Blocks while they
    close."""
    for t in tiers:
        try:
            t.close()
        except Exception:
            logging.getLogger("kvtier").exception("closing tier %s after a failure", t.name)


def build_lower_tiers(cfg: TierConfig, block_bytes: int, namespace: str) -> list[LowerTier]:
    """Every configured lower tier, fastest first (disk, then remote). Blocks.

    If building one fails, those already built are closed before the error
    propagates (:func:`build_tiers`).
    """
    return build_tiers((kind, cfg, block_bytes, namespace) for kind in configured(cfg))


def host_slot_bytes(block_bytes: int, cfg: TierConfig) -> int:
    """Bytes per host slot so every configured tier can use the slot as is
    (a disk record needs room for its trailer beside the block)."""
    if cfg.disk_path is not None:
        return DiskTier.slot_bytes_for(block_bytes)
    return block_bytes
