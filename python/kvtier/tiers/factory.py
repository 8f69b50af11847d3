"""The tier factory: lower tiers built from one configuration shape.

Process: the engine's scheduler (or ``kvtier replay``, the benchmarks).

Every front end (``kvtier replay`` through the CLI, the vLLM shim's
``kv_connector_extra_config`` and its secondary tiers, the SGLang backend)
parses its settings into the tiers' options (:mod:`kvtier.options`) and asks
here for tiers, so a setting means the same thing wherever it is given.

Who calls: :mod:`kvtier.replay`, :mod:`kvtier.integrations.vllm`. Building a
tier blocks (a disk tier checks and preallocates its directory, a remote
tier connects); nothing else does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.errors import InvalidArgument
from kvtier.options.tiers import DiskOptions, RemoteOptions
from kvtier.tiers.base import LowerTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.remote.tier import RemoteTier

LowerOptions = DiskOptions | RemoteOptions
"""The options of one lower tier; its type says its kind."""


@dataclass(frozen=True)
class TierConfig:
    """The lower tiers to build, each by its options (None: no such tier)."""

    disk: DiskOptions | None = None
    remote: RemoteOptions | None = None

    def configured(self) -> list[LowerOptions]:
        """The lower tiers asked for, fastest first (disk, then remote)."""
        return [o for o in (self.disk, self.remote) if o is not None]


def kind_of(options: LowerOptions) -> str:
    """``"disk"`` or ``"remote"``: the tier ``options`` describe."""
    return "disk" if isinstance(options, DiskOptions) else "remote"


def build_tier(
    options: LowerOptions, block_bytes: int, namespace: str, name: str | None = None
) -> LowerTier:
    """One lower tier: a disk tier (in ``options.path``, created 0700 when
    missing) or a remote one (on ``options.url``), named ``name`` (default:
    its kind). Blocks while the disk tier preallocates or the remote one connects.

    ``namespace`` names what makes this engine's bytes compatible
    (:func:`kvtier.tiers.records.namespace_name`).
    """
    name = name or kind_of(options)
    if isinstance(options, DiskOptions):
        if options.path is None:
            raise InvalidArgument("no disk tier configured (its path is None)")
        os.makedirs(options.path, mode=0o700, exist_ok=True)
        return DiskTier.from_options(options, block_bytes, namespace=namespace, name=name)
    return RemoteTier.from_options(options, block_bytes, namespace=namespace, name=name)


def build_tiers(wanted: Iterable[tuple[LowerOptions, int, str]]) -> list[LowerTier]:
    """One tier per ``(options, block_bytes, namespace)`` of ``wanted``, in
    order (:func:`build_tier`, named by their kind), all or nothing: if
    building one fails, those already built are closed (a disk tier lets go of
    its directory, a remote one of its connections) before the error
    propagates. Blocks while they are built.
    """
    tiers: list[LowerTier] = []
    try:
        for options, block_bytes, namespace in wanted:
            # One at a time, not extend(): those built before a failure must be closed.
            tiers.append(build_tier(options, block_bytes, namespace))
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
    return build_tiers((o, block_bytes, namespace) for o in cfg.configured())


def host_slot_bytes(block_bytes: int, cfg: TierConfig) -> int:
    """Bytes per host slot so every configured tier can use the slot as is
    (a disk record needs room for its trailer beside the block)."""
    if cfg.disk is not None:
        return DiskTier.slot_bytes_for(block_bytes)
    return block_bytes
