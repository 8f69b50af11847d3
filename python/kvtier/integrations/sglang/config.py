"""SGLang HiCache shim: kvtier's keys of ``--hicache-storage-backend-extra-config``
and the one namespace of a rank's pages.

Runs in every SGLang scheduler process (one per TP/PP rank) when the backend
is built; pure and cheap (never blocks), imports neither SGLang nor kvtier's native core.
Callers: :class:`kvtier.integrations.sglang.storage.KVTierStorage`, the
benchmark and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgument
from kvtier.options.engines import SglangOptions
from kvtier.options.fields import key_of
from kvtier.options.surfaces import engine_keys, parse_engine_config
from kvtier.options.tiers import DiskOptions, HostOptions, RemoteOptions
from kvtier.tiers.records import namespace_name

if TYPE_CHECKING:
    from kvtier.tiers.factory import TierConfig

# kvtier's keys: name -> (accepted types, what it is), from kvtier.options.
# Other keys of the extra config are SGLang's (backend_name, module_path,
# class_name, interface_v1, ...).
CONFIG_KEYS = engine_keys("sglang")


@dataclass(frozen=True)
class StorageSettings:
    """What the extra config asks of kvtier: the lower tiers' options (None:
    not configured), the namespace tag, the staging size (None: see
    ``STAGING_PAGES``) and the memory tier's bytes for the KV pool (0: none)."""

    disk: DiskOptions | None = None
    remote: RemoteOptions | None = None
    namespace: str = ""
    staging_bytes: int | None = None
    host_bytes: int = 0
    node: str | None = None

    def tier_config(self) -> TierConfig:
        """The tiers to build (imports the tier factory, and with it the native core)."""
        from kvtier.tiers.factory import TierConfig

        return TierConfig(self.disk, self.remote)


def parse_extra_config(extra: Mapping[str, Any] | None) -> StorageSettings:
    """Validate kvtier's keys of SGLang's extra config (clear errors for an
    unknown ``kvtier_`` key or a mistyped value; SGLang's own keys pass).
    At least a disk path or a remote URL is required. Pure."""
    cfg = parse_engine_config({} if extra is None else extra, "sglang", "hicache extra config")
    eng: SglangOptions = cfg.engine
    if eng.node is not None:
        given = [
            key_of(cls, name)
            for cls, name, v in (
                (DiskOptions, "path", cfg.disk),
                (RemoteOptions, "url", cfg.remote),
                (HostOptions, "bytes", cfg.host.bytes),
                (SglangOptions, "staging_bytes", eng.staging_bytes),
            )
            if v is not None
        ]
        if given:
            raise InvalidArgument(
                f"{key_of(SglangOptions, 'node')}: the node owns the host memory and the disk "
                "and remote tiers; give their settings to `kvtier node`, not to the engine "
                f"({', '.join(given)})"
            )
    elif cfg.disk is None and cfg.remote is None:
        raise InvalidArgument(
            "kvtier's SGLang backend needs kvtier_disk_path or kvtier_remote_url "
            "(or both), or kvtier_node, in --hicache-storage-backend-extra-config"
        )
    return StorageSettings(
        cfg.disk, cfg.remote, eng.namespace, eng.staging_bytes, cfg.host.bytes or 0, eng.node
    )


def storage_namespace(
    *,
    model: str | None,
    dtype: str,
    layout: str,
    page_tokens: int,
    page_bytes: int,
    pool: str,
    is_mla: bool,
    shared_across_tp: bool,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    cp_rank: int = 0,
    cp_size: int = 1,
    dcp_rank: int = 0,
    dcp_size: int = 1,
    user_namespace: str = "",
) -> str:
    """The namespace of one rank's pages of one host pool in kvtier's disk
    and Redis tiers: what makes SGLang's page bytes compatible (DESIGN.md,
    hard rule 4). Model, KV dtype, the host pool's layout, tokens and bytes
    per page, the pool's name, whether the model is MLA, the TP rank and
    size (``shared_across_tp``: an MLA page is the same on every TP rank, so
    a pool all ranks share, Redis, keeps one namespace for all of them,
    written by one rank; a disk tier has one owner and stays per rank), the
    pipeline stage and size, context-parallel shards, the user's tag.

    The first part names the engine, so an SGLang page and a vLLM block
    (:func:`kvtier.integrations.vllm.engine_namespace`) never share a digest
    even where every other part agreed. Pure.
    """
    tp = ("all", tp_size if dcp_size > 1 else None) if shared_across_tp else (tp_rank, tp_size)
    return namespace_name(
        (
            "sglang-hicache",
            model or "",
            dtype,
            layout,
            int(page_tokens),
            int(page_bytes),
            pool,
            tp,
            int(pp_rank),
            int(pp_size),
            int(cp_rank),
            int(cp_size),
            int(dcp_rank),
            int(dcp_size),
            user_namespace,
        )
    )
