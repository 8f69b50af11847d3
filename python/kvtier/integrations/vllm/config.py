"""vLLM shim: kvtier's keys of ``kv_connector_extra_config``, its metrics,
the start-up check of the engine and the one namespace of an engine's blocks.

Runs in every vLLM process (API server, engine core, workers); pure and
cheap (never blocks) except :func:`check_engine`, which reads vLLM's platform
and may turn one setting of the connector's extra config off. Callers: the
spec, the secondary tiers and the connector.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvtier.errors import UnsupportedEngine
from kvtier.options.engines import VllmOptions
from kvtier.options.fields import key_of
from kvtier.options.surfaces import EngineConfig, engine_keys, parse_engine_config
from kvtier.tiers.records import namespace_name

# Keys of kv_connector_extra_config that vLLM itself reads (never ours to reject).
_VLLM_KEYS = {
    "spec_name",
    "spec_module_path",
    "block_size",
    "blocks_per_chunk",
    "canonical_layout",
    "self_describing_kv_events",
    "offload_prompt_only",
    "sync_load_budget_bytes",
}
# kvtier's keys: name -> (accepted types, what it is), from kvtier.options.
CONFIG_KEYS = engine_keys("vllm")
GAUGES = ("host_usage_perc", "host_busy", "tier_jobs")

KVTIER_METRICS = {
    "vllm:kv_offload_kvtier_host_usage_perc": "Fraction of kvtier host slots in use.",
    "vllm:kv_offload_kvtier_host_busy": "kvtier host blocks pinned, being written or held.",
    "vllm:kv_offload_kvtier_tier_jobs": "kvtier lower-tier jobs in flight.",
    "vllm:kv_offload_kvtier_loaded_host": "Chunks loaded into the engine from kvtier's host tier.",
    "vllm:kv_offload_kvtier_loaded_disk": "Chunks loaded into the engine after promotion from "
    "disk (each load of such a block, not the disk's reads: disk_reads).",
    "vllm:kv_offload_kvtier_loaded_remote": "Chunks loaded into the engine after promotion from "
    "Redis (each load of such a block, not Redis's reads: remote_reads).",
    "vllm:kv_offload_kvtier_promotions": "Blocks promoted from lower tiers into the host tier.",
    "vllm:kv_offload_kvtier_disk_reads": "Blocks kvtier's disk tier read (into the host tier or "
    "for the engine's worker), failed reads (corrupt records among them) included.",
    "vllm:kv_offload_kvtier_remote_reads": "Blocks kvtier read from Redis, failed reads (corrupt "
    "values among them) included.",
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


def parse_extra_config(extra: dict[str, Any] | Any) -> EngineConfig:
    """Validate kvtier's keys of ``kv_connector_extra_config`` (clear errors
    for unknown, mistyped or out-of-range ones) into the tiers' and the
    connector's options (:class:`~kvtier.options.VllmOptions` in ``engine``)."""
    return parse_engine_config(extra, "vllm", "kv_connector_extra_config")


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
        layered = key_of(VllmOptions, "layered_loads")
        for key, off in ((layered, False), ("sync_load_budget_bytes", 0)):
            if key in extra and extra[key] not in (off, str(off)):
                logging.getLogger("kvtier").warning(
                    "kvtier: %s -> %s for a model with recurrent layers: a hit loads a step "
                    "ahead of its prefill, whole",
                    key,
                    off,
                )
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


def check_current_engine() -> None:
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
    return namespace_name(
        (
            model,
            dtype,
            int(worker_kv_bytes_per_block),
            int(blocks_per_chunk),
            int(world_size),
            int(pp_size),
            kv_cache_layout,
            bool(canonical_layout),
            structure,
            user_namespace,
        )
    )
