"""SGLang HiCache shim: kvtier's keys of ``--hicache-storage-backend-extra-config``
and the one namespace of a rank's pages.

Runs in every SGLang scheduler process (one per TP/PP rank) when the backend
is built; pure and cheap (never blocks), imports neither SGLang nor kvtier's native core.
Callers: :class:`kvtier.integrations.sglang.storage.KVTierStorage`, the
benchmark and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgument
from kvtier.integrations._keys import kvtier_keys
from kvtier.tiers.records import namespace_name
from kvtier.units import to_bytes, to_capacity

if TYPE_CHECKING:
    from kvtier.tiers.factory import TierConfig

# kvtier's keys: name -> (type, what it is). Other keys of the extra config
# are SGLang's (backend_name, module_path, class_name, interface_v1, ...).
CONFIG_KEYS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "kvtier_disk_path": (str, "directory of the disk tier"),
    "kvtier_disk_bytes": (
        (int, str),
        "disk tier size, e.g. 100GiB, or a share of the free space, e.g. 80% (default 100GiB)",
    ),
    "kvtier_disk_reserve": ((int, str), "free space the disk tier never takes"),
    "kvtier_disk_policy": (str, "disk eviction policy: lru, clock, clock:N or plfu (default lru)"),
    "kvtier_disk_backend": (str, "auto, io_uring or pread (default auto)"),
    "kvtier_disk_timeout_s": ((int, float), "a disk job not done after this fails (default 30)"),
    "kvtier_remote_url": (
        str,
        "redis://[USER:PASS@]HOST:PORT, redis-cluster://H:P,H:P; rediss:// for TLS",
    ),
    "kvtier_remote_ttl_s": ((int, float), "expiry of remote values in seconds (default none)"),
    "kvtier_remote_timeout_s": ((int, float), "remote connect and I/O timeout (default 2)"),
    "kvtier_remote_tls_ca_file": (str, "rediss: PEM CA file (default: the system's)"),
    "kvtier_remote_tls_cert_file": (str, "rediss: PEM client certificate"),
    "kvtier_remote_tls_key_file": (str, "rediss: PEM key of the client certificate"),
    "kvtier_remote_tls_server_name": (str, "rediss: name the server certificate must carry"),
    "kvtier_namespace": (str, "extra namespace mixed into every key (default none)"),
    "kvtier_host_bytes": (
        (int, str),
        "kvtier's memory tier in front of disk and Redis: the pages stored last, read back from "
        "memory, per rank and KV pool (e.g. 8GiB; default 0: none)",
    ),
    "kvtier_staging_bytes": (
        (int, str),
        "host memory for pages on their way to or from the tiers, per rank and pool (default: "
        "SGLang's batch of 128 pages each way, at most 1GiB)",
    ),
}


@dataclass(frozen=True)
class StorageSettings:
    """What the extra config asks of kvtier: the tiers (as
    :class:`~kvtier.tiers.factory.TierConfig` fields) and the staging size."""

    tier_fields: dict[str, Any] = field(default_factory=dict)
    namespace: str = ""
    staging_bytes: int | None = None  # None: see STAGING_PAGES
    host_bytes: int = 0  # the memory tier's bytes for the KV pool (0: none)

    def tier_config(self) -> TierConfig:
        """The tiers to build (imports the tier factory, and with it the native core)."""
        from kvtier.tiers.factory import TierConfig

        return TierConfig(**self.tier_fields)


def parse_extra_config(extra: Mapping[str, Any] | None) -> StorageSettings:
    """Validate kvtier's keys of SGLang's extra config (clear errors for an
    unknown ``kvtier_`` key or a mistyped value; SGLang's own keys pass).
    At least a disk path or a remote URL is required. Pure."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise InvalidArgument(
            f"hicache storage extra config must be a mapping, got {type(extra).__name__}"
        )
    got = kvtier_keys(extra, CONFIG_KEYS, "hicache extra config", skip_non_str=True)
    if "kvtier_disk_path" not in got and "kvtier_remote_url" not in got:
        raise InvalidArgument(
            "kvtier's SGLang backend needs kvtier_disk_path or kvtier_remote_url "
            "(or both) in --hicache-storage-backend-extra-config"
        )
    reserve = got.get("kvtier_disk_reserve")
    tiers = dict(
        disk_path=got.get("kvtier_disk_path"),
        disk_bytes=to_capacity("kvtier_disk_bytes", got.get("kvtier_disk_bytes", "100GiB")),
        disk_reserve_bytes=None if reserve is None else to_bytes("kvtier_disk_reserve", reserve),
        disk_policy=got.get("kvtier_disk_policy", "lru"),
        disk_backend=got.get("kvtier_disk_backend", "auto"),
        disk_timeout_s=float(got.get("kvtier_disk_timeout_s", 30.0)),
        remote_url=got.get("kvtier_remote_url"),
        remote_ttl_s=got.get("kvtier_remote_ttl_s"),
        remote_timeout_s=float(got.get("kvtier_remote_timeout_s", 2.0)),
        remote_tls_ca_file=got.get("kvtier_remote_tls_ca_file"),
        remote_tls_cert_file=got.get("kvtier_remote_tls_cert_file"),
        remote_tls_key_file=got.get("kvtier_remote_tls_key_file"),
        remote_tls_server_name=got.get("kvtier_remote_tls_server_name"),
    )
    given = got.get("kvtier_staging_bytes")
    staging = None if given is None else to_bytes("kvtier_staging_bytes", given)
    given_host = got.get("kvtier_host_bytes", 0)
    host = 0 if given_host == 0 else to_bytes("kvtier_host_bytes", given_host)
    return StorageSettings(tiers, got.get("kvtier_namespace", ""), staging, host)


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
    return namespace_name((
        "sglang-hicache", model or "", dtype, layout, int(page_tokens), int(page_bytes), pool,
        tp, int(pp_rank), int(pp_size), int(cp_rank), int(cp_size), int(dcp_rank),
        int(dcp_size), user_namespace,
    ))  # fmt: skip
