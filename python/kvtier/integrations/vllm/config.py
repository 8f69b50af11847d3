"""vLLM shim: kvtier's keys of ``kv_connector_extra_config``, its metrics,
the start-up check of the engine and the one namespace of an engine's blocks.

Runs in every vLLM process (API server, engine core, workers); pure and
cheap (never blocks) except :func:`check_engine`, which reads vLLM's platform
and may turn one setting of the connector's extra config off. Callers: the
spec, the secondary tiers and the connector.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kvtier.errors import InvalidArgument, UnsupportedEngine
from kvtier.integrations._keys import kvtier_keys
from kvtier.tiers.records import namespace_name
from kvtier.units import to_bytes, to_capacity

# Keys of kv_connector_extra_config that vLLM itself reads (never ours to reject).
_VLLM_KEYS = {
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
    "self_describing_kv_events", "offload_prompt_only", "sync_load_budget_bytes",
}  # fmt: skip
# kvtier's keys: name -> (type, what it is)
CONFIG_KEYS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "kvtier_host_bytes": ((int, str), "host tier size across all workers, e.g. 64GiB (required)"),
    "kvtier_policy": (str, "host eviction policy: lru, arc or a dotted class path (default lru)"),
    "kvtier_disk_policy": (
        str,
        "disk eviction policy (native): lru, clock, clock:N or plfu (default lru)",
    ),
    "kvtier_admit_after": (int, "store a block after it was offered N times (default 1)"),
    "kvtier_lower_writes": (
        str,
        "when a block is written to the disk and Redis tiers: on_store (when stored in the host "
        "tier, the default) or on_reuse (on its first reuse from the host tier: blocks nobody "
        "comes back for are never written)",
    ),
    "kvtier_disk_path": (str, "directory of the disk tier (optional)"),
    "kvtier_disk_bytes": (
        (int, str),
        "disk tier size, e.g. 100GiB, or a share of the free space, e.g. 80% (default 100GiB)",
    ),
    "kvtier_disk_reserve": (
        (int, str),
        "free space the disk tier never takes (default 5% of the file system, at most 4GiB)",
    ),
    "kvtier_disk_write_budget": (
        (int, str),
        "disk write budget in bytes per second (default none)",
    ),
    "kvtier_disk_timeout_s": (
        (int, float),
        "a disk job not done after this fails; its memory stays held until it ends (default 30)",
    ),
    "kvtier_remote_url": (
        str,
        "redis://[USER:PASS@]HOST:PORT or redis-cluster://H:P,H:P; rediss:// for TLS (optional)",
    ),
    "kvtier_remote_tls_ca_file": (str, "rediss: PEM CA file (default: the system's trust store)"),
    "kvtier_remote_tls_cert_file": (str, "rediss: PEM client certificate (optional)"),
    "kvtier_remote_tls_key_file": (str, "rediss: PEM key of the client certificate (optional)"),
    "kvtier_remote_tls_server_name": (str, "rediss: name the server certificate must carry"),
    "kvtier_remote_ttl_s": ((int, float), "expiry of remote values in seconds (default none)"),
    "kvtier_pool_events": (
        bool,
        "append the stores Redis acknowledged to the pool's own event stream, which `kvtier "
        "events URL` tails for every engine on the pool (default true)",
    ),
    "kvtier_pool_index": (
        bool,
        "answer Redis lookups from what the pool's event stream says the pool holds, with no "
        "round trip (default: with kvtier_pool_events; turn it off on a pool shared with "
        "writers whose stream is off)",
    ),
    "kvtier_engine_id": (
        str,
        "what names this engine in the pool's event stream (default host:pid)",
    ),
    "kvtier_namespace": (str, "extra namespace mixed into every key (default none)"),
    "kvtier_num_slots": (int, "host slots per rank; required with pipeline parallelism"),
    "kvtier_stats_path": (
        str,
        "write kvtier's counters and host occupancy here as JSON at shutdown",
    ),
    "kvtier_promote": (
        bool,
        "copy a disk hit into the host tier before loading it (default true; false: the worker "
        "streams every disk hit into the engine's cache itself)",
    ),
    "kvtier_remote_probe": (
        bool,
        "keys the Redis tier does not know yet are read with one GET into a host slot (true) or "
        "checked with EXISTS first (false; with kvtier_promote false the worker then streams "
        "them); default true when kvtier_admit_after is 1",
    ),
    "kvtier_fenced_reads": (
        bool,
        "under KVTierConnector, a returning prefix read ahead from Redis is HIT before its "
        "values arrive and the engine's copies wait for each block's value (the read and the "
        "load overlap; default true); false: the lookup waits for every value first",
    ),
    "kvtier_layered_loads": (
        bool,
        "a hit loaded within the step is waited for layer by layer: each attention layer "
        "waits only for its own KV, the copies of later layers (and a disk hit's reads, "
        "record by record in layer order) overlap the compute of earlier ones (default true; "
        "false: the forward pass waits for the whole load first)",
    ),
    "kvtier_stream_slots": (
        int,
        "staging slots per worker for blocks moved straight between the engine and the disk "
        "or Redis tier when the host tier has no room (default 32, or with layered loads "
        "enough for sync_load_budget_bytes; 0 turns streaming off)",
    ),
    "kvtier_scan_wait_ms": (
        (int, float),
        "a request's first lookup that misses the host tier reads its prefix from the lower "
        "tiers and waits for it, at most this long per scheduler step (default 20; 0: never "
        "wait, hits become readable a step later)",
    ),
    "kvtier_scan_bytes": (
        (int, str),
        "at most this much read per scheduler step by such waits (default 64MiB)",
    ),
}
_GAUGES = ("host_usage_perc", "host_busy", "tier_jobs")

KVTIER_METRICS = {
    "vllm:kv_offload_kvtier_host_usage_perc": "Fraction of kvtier host slots in use.",
    "vllm:kv_offload_kvtier_host_busy": "kvtier host blocks pinned, being written or held.",
    "vllm:kv_offload_kvtier_tier_jobs": "kvtier lower-tier jobs in flight.",
    "vllm:kv_offload_kvtier_loaded_host": "Chunks loaded into the engine from kvtier's host tier.",
    "vllm:kv_offload_kvtier_loaded_disk": "Chunks loaded into the engine after promotion from disk.",
    "vllm:kv_offload_kvtier_loaded_remote": "Chunks loaded into the engine after promotion from Redis.",
    "vllm:kv_offload_kvtier_promotions": "Blocks promoted from lower tiers into the host tier.",
    "vllm:kv_offload_kvtier_cascades": "Blocks copied from the host tier to lower tiers.",
    "vllm:kv_offload_kvtier_cascades_dropped": "Cascades dropped under backpressure.",
    "vllm:kv_offload_kvtier_allocation_failures": "Stores or promotions refused for lack of room.",
    "vllm:kv_offload_kvtier_scan_reads": "Blocks read ahead by a lookup and readable in its step.",
    "vllm:kv_offload_kvtier_fenced_reads": "Blocks read ahead and HIT before their value "
    "arrived (the engine's copy waits for it).",
    "vllm:kv_offload_kvtier_fenced_failures": "Of those, reads that failed (their loads recomputed).",
    "vllm:kv_offload_kvtier_scan_timeouts": "Read-ahead waits cut short by their deadline.",
    "vllm:kv_offload_kvtier_scan_waits": "Lookups that waited for their request's read-ahead.",
    "vllm:kv_offload_kvtier_scan_wait_us": "Microseconds lookups waited for read-ahead, in all.",
    "vllm:kv_offload_kvtier_load_failures": "Chunks of loads that failed in the engine's worker "
    "(recomputed by vLLM under KVTierConnector).",
}


def parse_extra_config(extra: dict[str, Any] | Any) -> dict[str, Any]:
    """Validate kvtier's keys of ``kv_connector_extra_config``; clear errors for
    unknown or mistyped ones. Returns the kvtier keys with sizes in bytes."""
    if not isinstance(extra, Mapping):
        raise InvalidArgument(
            f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}"
        )
    out = kvtier_keys(extra, CONFIG_KEYS, "kv_connector_extra_config")
    for key in (
        "kvtier_host_bytes", "kvtier_disk_reserve", "kvtier_disk_write_budget", "kvtier_scan_bytes",
    ):  # fmt: skip
        if key in out:
            out[key] = to_bytes(key, out[key])
    if "kvtier_disk_bytes" in out:
        out["kvtier_disk_bytes"] = to_capacity("kvtier_disk_bytes", out["kvtier_disk_bytes"])
    if out.get("kvtier_admit_after", 1) < 1:
        raise InvalidArgument("kvtier_admit_after: must be >= 1")
    if out.get("kvtier_lower_writes", "on_store") not in ("on_store", "on_reuse"):
        raise InvalidArgument(
            f"kvtier_lower_writes: must be on_store or on_reuse, got {out['kvtier_lower_writes']!r}"
        )
    if out.get("kvtier_scan_wait_ms", 0) < 0:
        raise InvalidArgument("kvtier_scan_wait_ms: must be >= 0")
    engine_id = out.get("kvtier_engine_id")
    if engine_id is not None and (not engine_id.strip() or len(engine_id) > 256):
        raise InvalidArgument(
            f"kvtier_engine_id: must be a non-blank name of at most 256 characters, "
            f"got {engine_id!r}"
        )
    return out


def check_engine(vllm_config: Any) -> None:
    """Refuse an engine that would compute wrong tokens from loaded KV.

    vLLM's CPU platform turns prefix caching and chunked prefill off for MLA
    models on its reference CPU_MLA backend (not on AMX_MLA), because that
    backend's prefill over cached context is wrong. A connector that loads a
    prefix into such an engine gets different tokens (measured with a small
    DeepSeek-V3-shaped model: the latents kvtier loaded were bitwise equal
    to the ones the engine computed for the same tokens, and vLLM's own
    prefix cache, forced on, gave the same wrong tokens). Who calls: the
    shim's connector and spec, in every engine process, at start-up; cheap.

    A model with Mamba or linear-attention layers is served only where vLLM
    keeps their state per block (``mamba_cache_mode`` "align", vLLM's
    default with prefix caching on): each block then holds the state after
    its last token, which vLLM's offloading connector stores and loads as
    one opaque chunk per block (a window of one chunk) beside the attention
    groups' KV. Without it ("none") the state is one running value per
    request: a prefix loaded into the attention layers would have none.
    For such a model this also turns loads within the prefill's step off in
    the connector's extra config (``sync_load_budget_bytes`` 0, and
    ``kvtier_layered_loads`` false): a hit loads a step ahead, whole. Measured
    with a random Qwen3-Next on vLLM 0.32's CPU build: loaded within the
    step, 2 of 5 hits gave other tokens than recomputing (the state the
    prefill resumed from was not the one loaded), a step ahead all were
    identical; and vLLM's recurrent layers never call ``wait_for_layer_load``.

    Raises :class:`~kvtier.errors.UnsupportedEngine`."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if model is None or cache is None:
        return
    _check_recurrent_state(model, cache, getattr(vllm_config, "kv_transfer_config", None))
    if not getattr(model, "use_mla", False):
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not cache.enable_prefix_caching:
        raise UnsupportedEngine(
            "kvtier: this engine cannot use offloaded KV for an MLA model: vLLM's CPU "
            "platform turned prefix caching off for it (its CPU_MLA backend does not "
            "compute a prompt on top of cached context, so loaded prefixes would give "
            "wrong tokens). Serve it without kv_transfer_config, or where the engine "
            "keeps prefix caching on (a GPU, or vLLM's AMX_MLA backend with a bfloat16 "
            "model on a CPU with AMX)."
        )


def _check_recurrent_state(model: Any, cache: Any, transfer: Any) -> None:
    """The recurrent-layer part of :func:`check_engine`. vLLM's ``is_hybrid``
    is false for a hybrid architecture configured without recurrent layers."""
    recurrent = any(bool(getattr(model, n, False)) for n in ("is_hybrid", "is_attention_free"))
    if not recurrent:
        return
    extra = getattr(transfer, "kv_connector_extra_config", None)
    if isinstance(extra, dict):
        for key, off in (("kvtier_layered_loads", False), ("sync_load_budget_bytes", 0)):
            if key in extra and extra[key] not in (off, str(off)):
                logging.getLogger("kvtier").warning(
                    "kvtier: %s -> %s for a model with recurrent layers: a hit loads a step "
                    "ahead of its prefill, whole", key, off,
                )  # fmt: skip
            extra[key] = off
    mode = getattr(cache, "mamba_cache_mode", "none")
    if mode != "align":
        raise UnsupportedEngine(
            "kvtier: this engine cannot use offloaded KV for a model with Mamba or "
            "linear-attention layers: vLLM keeps their state as one running value per "
            f"request (mamba_cache_mode {mode!r}, prefix caching off), so a prefix loaded "
            "into its attention layers would have no state for the recurrent ones. Turn "
            "prefix caching on (enable_prefix_caching / --enable-prefix-caching): vLLM then "
            "keeps a state per block (mamba_cache_mode 'align'), which kvtier offloads."
        )


def _check_current_engine() -> None:
    """:func:`check_engine` on the config vLLM is building, where the caller
    (a spec or secondary tier, handed only vLLM's OffloadingConfig) runs
    inside vLLM's config context; nothing outside one."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # a vLLM without it: the connector checks
        return
    current = get_current_vllm_config_or_none()
    if current is not None:
        check_engine(current)


def engine_namespace(
    *,
    model: str,
    dtype: str,
    worker_kv_bytes_per_block: int,
    blocks_per_chunk: int,
    world_size: int,
    pp_size: int,
    kv_cache_layout: str | None,
    canonical_layout: bool,
    user_namespace: str,
    groups: Iterable[Any],
) -> str:
    """The namespace of this engine's blocks in kvtier's disk and Redis tiers,
    the same for both routes (the whole spec, per pipeline stage, and the
    secondary tiers): what makes bytes compatible (DESIGN.md, hard rule 4).

    Model, KV dtype, one worker's KV bytes per block, blocks per chunk, the
    world and pipeline sizes (TP=2 and PP=2 move equal bytes of different
    layers), vLLM's KV layout and whether the canonical one was asked for, the
    user's extra tag, and the KV-cache group structure (``groups``: vLLM's
    ``OffloadingConfig.groups``; each group's tokens per block and number of
    layers count, and a sliding-window group's window). Pure; see :func:`~kvtier.tiers.records.namespace_name`.
    """
    # A sliding-window group keeps (and stores) only its window's blocks: two
    # models differing only in the window must not share blocks either.
    structure = tuple(
        (
            int(g.tokens_per_block),
            len(g.layer_names),
            getattr(g, "sliding_window_size_in_chunks", None),
        )
        for g in groups
    )
    return namespace_name((
        model, dtype, int(worker_kv_bytes_per_block), int(blocks_per_chunk), int(world_size),
        int(pp_size), kv_cache_layout, bool(canonical_layout), structure, user_namespace,
    ))  # fmt: skip
