"""Issue 34 item 3: models with Mamba or linear-attention layers.

vLLM (0.32 and 0.33) offloads such a layer's state only in its "align"
cache mode (prefix caching on): a state per block, taken at the block's
last token, stored and loaded as one opaque chunk per block (a window of one
chunk: a prefix needs the state at its last block). kvtier is vLLM's
offloading spec there, so it moves those chunks as it moves KV; without
prefix caching the state is one running value per request and kvtier
refuses to start. The case itself (vLLM's KVCacheConfig and specs) is in
vllm_hybrid_case.py, which the engine's Python (vLLM 0.32) runs as well.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_under_engine_vllm

pytest.importorskip("vllm.v1.kv_offload.base")
import kvtier
from integration import vllm_hybrid_case as case

HERE = Path(__file__).resolve().parent


def test_vllm_offloads_the_mamba_group_as_a_window_of_one_chunk() -> None:
    case.check_groups()


def test_kvtier_moves_each_mamba_state_and_the_attention_kv_bitwise() -> None:
    case.check_round_trip()


def test_the_same_under_the_engines_vllm() -> None:
    """The same checks under the engine's vLLM (0.32: the window function
    lives in its scheduler, its OffloadingGroupConfig names no window)."""
    out = run_under_engine_vllm(HERE / "vllm_hybrid_case.py")
    assert out.strip().endswith("ok"), out[-2000:]


def test_the_spec_keeps_the_mamba_group_a_window_of_one_chunk() -> None:
    """The manager's read-ahead sees the Mamba group's window as vLLM 0.33
    states it (one chunk: only the state at a prefix's last block is read)."""
    from dataclasses import fields

    from vllm.v1.kv_offload.config import OffloadingGroupConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if "sliding_window_size_in_chunks" not in {f.name for f in fields(OffloadingGroupConfig)}:
        pytest.skip("this vLLM's OffloadingGroupConfig names no window (KVTierConnector does)")
    spec = OffloadingSpecFactory.create_spec(
        case.offloading_config({**case.SPEC, "kvtier_host_bytes": "4MiB"})
    )
    assert spec.windows == {(1).to_bytes(4, "big"): 1}


@pytest.mark.parametrize(
    ("kind", "mode", "refused"),
    [("is_hybrid", "none", True), ("is_attention_free", "none", True),
     ("is_hybrid", "align", False), ("is_attention_free", "align", False),
     (None, "none", False)],
)  # fmt: skip
def test_recurrent_layers_without_a_state_per_block_are_refused_at_start_up(
    kind: str | None, mode: str, refused: bool
) -> None:
    """Prefix caching off (mamba_cache_mode 'none'): the state is one running
    value per request, so a loaded prefix would have no state for the
    recurrent layers: refused with the reason and the fix, never served."""
    from kvtier.integrations.vllm import check_engine

    model = SimpleNamespace(use_mla=False, **({kind: True} if kind else {}))
    cache = SimpleNamespace(enable_prefix_caching=mode == "align", mamba_cache_mode=mode)
    cfg = SimpleNamespace(model_config=model, cache_config=cache)
    if refused:
        with pytest.raises(kvtier.UnsupportedEngine, match="Mamba or linear-attention") as e:
            check_engine(cfg)
        assert "--enable-prefix-caching" in str(e.value)
    else:
        check_engine(cfg)


def test_check_engine_reads_the_mode_vllm_derives_from_prefix_caching() -> None:
    """vLLM's own CacheConfig: 'none' unless prefix caching turned it to
    'align' (MambaModelConfig does that when the engine is configured)."""
    from kvtier.integrations.vllm import check_engine
    from vllm.config import CacheConfig

    model = SimpleNamespace(use_mla=False, is_hybrid=True)
    cache = CacheConfig()
    assert cache.mamba_cache_mode == "none"
    with pytest.raises(kvtier.UnsupportedEngine):
        check_engine(SimpleNamespace(model_config=model, cache_config=cache))
    cache.mamba_cache_mode = "align"
    check_engine(SimpleNamespace(model_config=model, cache_config=cache))


@pytest.mark.parametrize("asked", [None, True, False])
def test_a_recurrent_model_loads_a_step_ahead_and_whole(asked: bool | None) -> None:
    """Within the prefill's step, 2 of 5 hits of a Qwen3-Next gave other
    tokens under vLLM 0.32 (a step ahead none did), and vLLM's recurrent
    layers never call wait_for_layer_load: check_engine turns both loads
    within the step and layered loads off for such a model, whatever was
    asked, and leaves an attention-only model's settings alone."""
    from kvtier.integrations.vllm import check_engine

    def cfg(hybrid: bool) -> SimpleNamespace:
        extra = {} if asked is None else {"kvtier_layered_loads": asked,
                                          "sync_load_budget_bytes": "64MiB" if asked else 0}  # fmt: skip
        return SimpleNamespace(
            model_config=SimpleNamespace(use_mla=False, is_hybrid=hybrid),
            cache_config=SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="align"),
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        )

    hybrid, plain = cfg(True), cfg(False)
    want = dict(plain.kv_transfer_config.kv_connector_extra_config)
    check_engine(hybrid)
    check_engine(plain)
    assert hybrid.kv_transfer_config.kv_connector_extra_config == {
        "kvtier_layered_loads": False, "sync_load_budget_bytes": 0,
    }  # fmt: skip
    assert plain.kv_transfer_config.kv_connector_extra_config == want
