from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kvtier
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.planner import (
    ModelKV,
    even_partition,
    host_pool_per_rank,
    model_from_hf_config,
    parse_partition,
    plan_per_device,
    plan_total,
    recommend_partition,
)

LLAMA70B = ModelKV(64, 8, 128, "bfloat16")  # 4096 B per token per layer
BLOCK = 16 * 48 * 4096  # stage 0 block bytes in the 48/16 split


def test_48_16_per_device_same_capacity_with_two_thirds_memory() -> None:
    plan = plan_per_device(LLAMA70B, [48, 16], 16, 6000 * BLOCK)
    u = plan.uniform["stages"]
    assert (u[0]["max_tokens"], u[1]["max_tokens"]) == (96_000, 288_000)  # stage 1: 3x
    assert [s.max_tokens for s in plan.stages] == [96_000, 96_000]
    used = sum(s.kv_bytes for s in plan.stages)
    assert used * 3 == 2 * 2 * 6000 * BLOCK  # 2/3 of the memory
    assert plan.saved_bytes == 2 * 6000 * BLOCK // 3
    assert plan.uniform["usable_tokens"] == 96_000


def test_48_16_total_budget_gives_1_5x_capacity() -> None:
    total = 2 * 6000 * BLOCK
    plan = plan_total(LLAMA70B, [48, 16], 16, total)
    assert [s.blocks for s in plan.stages] == [9000, 9000]
    assert plan.uniform["usable_blocks"] == 6000
    assert plan.capacity_gain == pytest.approx(1.5)
    assert sum(s.kv_bytes for s in plan.stages) == total


def test_even_partition_matches_vllm_remainder_rule() -> None:
    assert even_partition(10, 4) == [2, 3, 3, 2]
    assert even_partition(64, 2) == [32, 32]
    assert even_partition(7, 3) == [2, 3, 2]


@settings(max_examples=200, deadline=None)
@given(
    layers=st.integers(2, 96),
    kv_heads=st.integers(1, 16),
    head_dim=st.sampled_from([64, 96, 128, 256]),
    stages=st.integers(1, 8),
    block_tokens=st.sampled_from([16, 32, 64]),
    mem_blocks=st.integers(1, 4000),
    seed=st.randoms(use_true_random=False),
)
def test_plan_properties(
    layers, kv_heads, head_dim, stages, block_tokens, mem_blocks, seed
) -> None:  # type: ignore[no-untyped-def]
    stages = min(stages, layers)
    cuts = sorted(seed.sample(range(1, layers), stages - 1))
    partition = [b - a for a, b in zip([0, *cuts], [*cuts, layers])]
    model = ModelKV(layers, kv_heads, head_dim)
    per_layer_block = model.full_layer_bytes_per_token * block_tokens
    budget = mem_blocks * per_layer_block * max(partition)
    plan = plan_per_device(model, partition, block_tokens, budget)
    assert len({s.blocks for s in plan.stages}) == 1
    assert all(s.kv_bytes <= budget for s in plan.stages)
    assert plan.stages[0].max_tokens >= plan.uniform["usable_tokens"]
    total = plan_total(model, partition, block_tokens, budget * len(partition))
    assert len({s.blocks for s in total.stages}) == 1
    assert sum(s.kv_bytes for s in total.stages) <= budget * len(partition)
    assert total.stages[0].blocks >= total.uniform["usable_blocks"]


def hf_model(
    tmp_path: Path, layers: int, heads: int, kv_heads: int, hidden: int, **extra: object
) -> ModelKV:
    """model_from_hf_config on a config.json of ``layers`` layers, ``heads``
    attention and ``kv_heads`` KV heads, hidden size ``hidden``, bfloat16,
    and the ``extra`` keys."""
    cfg = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": hidden,
        "torch_dtype": "bfloat16",
        **extra,
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return model_from_hf_config(p)


def test_mla_bytes_per_token(tmp_path: Path) -> None:
    m = hf_model(tmp_path, 61, 128, 128, 7168, kv_lora_rank=512, qk_rope_head_dim=64)
    assert m.full_layer_bytes_per_token == (512 + 64) * 2  # one latent, not K and V
    assert sum(m.stage_bytes_per_token([61])) == 61 * 1152


def test_sliding_window_bytes_per_token(tmp_path: Path) -> None:
    # Gemma-style: 5 sliding layers per global one, window 4096, 32k context.
    gemma = {"head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 32768}
    m = hf_model(tmp_path, 12, 8, 4, 2560, sliding_window_pattern=6, **gemma)
    assert m.sliding == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    full = 2 * 4 * 256 * 2
    assert m.full_layer_bytes_per_token == full
    # 2 global layers at full cost + 10 sliding layers at 4096/32768 of it
    assert sum(m.stage_bytes_per_token([12])) == pytest.approx(2 * full + 10 * full / 8)
    # The same model with its sliding layers named one by one instead.
    alternating = ["sliding_attention", "full_attention"] * 6
    m = hf_model(tmp_path, 12, 8, 4, 2560, layer_types=alternating, **gemma)
    assert m.sliding == (0, 2, 4, 6, 8, 10)


def test_recommend_partition_maximises_capacity() -> None:
    model = ModelKV(64, 8, 128)
    gib = 1 << 30
    parts, blocks = recommend_partition(
        model,
        2,
        16,
        80 * gib,
        weight_bytes_per_layer=gib,
        embedding_bytes=2 * gib,
        lm_head_bytes=2 * gib,
    )
    assert sum(parts) == 64 and parts == [32, 32]
    # A heavier first stage (bigger embedding) gets fewer layers.
    parts2, _ = recommend_partition(
        model, 2, 16, 80 * gib, weight_bytes_per_layer=gib, embedding_bytes=10 * gib
    )
    assert parts2[0] < parts2[1]
    # Brute force over every split agrees on the best block count.
    kvb = model.full_layer_bytes_per_token * 16

    def cap(p: list[int]) -> int:
        free = [80 * gib - 2 * gib - p[0] * gib, 80 * gib - 2 * gib - p[1] * gib]
        return min(f // (n * kvb) for f, n in zip(free, p))

    assert blocks == max(cap([a, 64 - a]) for a in range(1, 64))


def test_host_pool_per_rank() -> None:
    ranks = host_pool_per_rank(LLAMA70B, [48, 16], 16, 64 << 30)
    assert ranks[0]["num_slots"] == ranks[1]["num_slots"]
    assert ranks[0]["slot_bytes"] == 3 * ranks[1]["slot_bytes"]
    assert sum(r["pool_bytes"] for r in ranks) <= 64 << 30


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: parse_partition("48,15", 64), "partition"),
        (lambda: parse_partition("64,0", 64), "partition"),
        (lambda: ModelKV(0, 8, 128), "layers"),
        (lambda: ModelKV(64, -1, 128), "kv_heads"),
        (lambda: ModelKV(64, 8, 128, "float12"), "dtype"),
        (lambda: plan_per_device(LLAMA70B, [48, 16], 16, 1000), "kv_memory"),
        (lambda: plan_total(LLAMA70B, [48, 16], 16, 1000), "total_kv_memory"),
        (lambda: plan_per_device(LLAMA70B, [48, 16], 0, 1 << 30), "block_tokens"),
    ],
)
def test_bad_input_names_the_field(call, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(kvtier.InvalidArgument, match=f"^{field}:"):
        call()


def _kvtier_plan(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvtier plan`` as a user runs it (its own process), for the Llama-70B shape."""
    shape = ["--layers", "64", "--kv-heads", "8", "--head-dim", "128"]
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "plan", *shape, *args], capture_output=True, text=True
    )


def test_cli_json() -> None:
    out = _kvtier_plan(
        "--dtype", "bfloat16", "--block-tokens", "16", "--partition", "48,16",
        "--kv-memory", str(6000 * BLOCK), "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    js = json.loads(out.stdout.strip().splitlines()[-1])
    assert [s["max_tokens"] for s in js["stages"]] == [96_000, 96_000]
    assert js["saved_bytes"] == 2 * 6000 * BLOCK // 3
    assert set(js) >= {"stages", "uniform", "saved_bytes", "capacity_gain"}


def test_cli_bad_partition_exit_code() -> None:
    out = _kvtier_plan("--partition", "40,16", "--kv-memory", "20GiB")
    assert out.returncode == 2
    assert "partition: [40, 16] sums to 56" in out.stderr


def test_rank_cells_place_each_rank_in_its_stage_slot() -> None:
    from kvtier.planner import RankCells

    # TP=2 x PP=2: ranks 0,1 in stage 0 and 2,3 in stage 1, two cells a slot.
    got = [RankCells.of(4, r, 2, False) for r in range(4)]
    assert [(c.stage, c.cell_index, c.cells, c.is_writer) for c in got] == [
        (0, 0, 2, True),
        (0, 1, 2, True),
        (1, 0, 2, True),
        (1, 1, 2, True),
    ]
    # TP=4 without PP: one stage, four cells.
    assert RankCells.of(4, 3, 1, False) == RankCells(4, 0, 3, 4, True)
    # Replicated (MLA): one cell a slot, written by each stage's first rank only.
    assert [RankCells.of(4, r, 2, True).is_writer for r in range(4)] == [True, False, True, False]
    assert RankCells.of(4, 3, 2, True).cells == 1
    with pytest.raises(kvtier.InvalidArgument, match="rank 4 outside a world of 4"):
        RankCells.of(4, 4, 1, False)
