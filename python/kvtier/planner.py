"""Pipeline-parallel KV memory planner.

With an uneven layer split, engines give every stage the same KV memory, yet
every request needs its blocks on every stage, so each stage can use only the
block count of the tightest one and the rest is dead memory. The planner gives
each stage KV memory in proportion to its KV bytes per token, so that block
counts are equal and nothing is wasted.

Who calls: ``kvtier plan``, the vLLM shim (host pool and disk share per
pipeline stage) and users' scripts. Pure arithmetic: nothing blocks, no native code is loaded.

Any process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.options.tiers import DiskOptions
from kvtier.units import FreeFraction

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class ModelKV:
    """What makes a model's KV cache size: per layer, bytes per token.

    ``mla_latent`` (DeepSeek-style MLA) replaces K and V by one latent vector
    of that many elements per token and layer. ``sliding`` lists the layers
    with a sliding window of ``window`` tokens: in a sequence of
    ``context_tokens`` they keep only ``min(window, context)`` tokens, so their
    amortized cost per token is scaled by that fraction.
    """

    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "bfloat16"
    mla_latent: int = 0
    sliding: tuple[int, ...] = ()
    window: int = 0
    context_tokens: int = 0

    def __post_init__(self) -> None:
        _positive("layers", self.layers)
        if self.dtype.lower() not in DTYPE_BYTES:
            raise InvalidArgument(
                f"dtype: unknown {self.dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
            )
        if self.mla_latent:
            _positive("mla_latent", self.mla_latent)
        else:
            _positive("kv_heads", self.kv_heads)
            _positive("head_dim", self.head_dim)
        if self.sliding:
            _positive("window", self.window)
            _positive("context_tokens", self.context_tokens)
            bad = [i for i in self.sliding if not 0 <= i < self.layers]
            if bad:
                raise InvalidArgument(f"sliding: layer indices {bad} not in [0, {self.layers})")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype.lower()]

    @property
    def full_layer_bytes_per_token(self) -> int:
        if self.mla_latent:
            return self.mla_latent * self.dtype_bytes
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def layer_bytes_per_token(self, layer: int) -> float:
        b = self.full_layer_bytes_per_token
        if layer in self._sliding_set:
            return b * min(self.window, self.context_tokens) / self.context_tokens
        return float(b)

    @property
    def _sliding_set(self) -> frozenset[int]:
        return frozenset(self.sliding)

    def stage_bytes_per_token(self, partition: list[int]) -> list[float]:
        out, start = [], 0
        for n in partition:
            out.append(sum(self.layer_bytes_per_token(i) for i in range(start, start + n)))
            start += n
        return out


@dataclass
class StagePlan:
    layers: int
    kv_bytes: int
    blocks: int
    max_tokens: int
    bytes_per_block: int


@dataclass
class Plan:
    block_tokens: int
    partition: list[int]
    stages: list[StagePlan]
    uniform: dict[str, Any]
    saved_bytes: int
    capacity_gain: float
    mode: str
    settings: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["capacity_gain"] = round(self.capacity_gain, 6)
        return d


def _positive(field_name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidArgument(f"{field_name}: must be > 0, got {value!r}")


def even_partition(layers: int, stages: int) -> list[int]:
    """vLLM's default split: equal shares, the remainder going one layer each
    to the stages before the last, from the second-to-last backwards."""
    _positive("layers", layers)
    _positive("stages", stages)
    if stages > layers:
        raise InvalidArgument(f"stages: {stages} stages for {layers} layers")
    parts = [layers // stages] * stages
    for i in range(2, layers % stages + 2):
        parts[-i] += 1
    return parts


def parse_partition(text: str | list[int], layers: int) -> list[int]:
    try:
        parts = [int(x) for x in text.split(",")] if isinstance(text, str) else list(text)
    except ValueError:
        raise InvalidArgument(f"partition: layers per stage like 48,16, got {text!r}") from None
    if not parts or any(p <= 0 for p in parts):
        raise InvalidArgument(f"partition: every stage needs > 0 layers, got {parts}")
    if sum(parts) != layers:
        raise InvalidArgument(
            f"partition: {parts} sums to {sum(parts)}, the model has {layers} layers"
        )
    return parts


def _block_bytes(model: ModelKV, partition: list[int], block_tokens: int) -> list[int]:
    return [max(1, round(b * block_tokens)) for b in model.stage_bytes_per_token(partition)]


def plan_per_device(
    model: ModelKV, partition: list[int], block_tokens: int, kv_memory: int | list[int]
) -> Plan:
    """Each device can give ``kv_memory`` bytes (one figure or one per stage).

    Uniform: every stage takes its whole budget but only the tightest stage's
    block count is usable. Proportional: each stage takes just what that
    block count needs; the rest is saved.
    """
    _positive("block_tokens", block_tokens)
    budgets = kv_memory if isinstance(kv_memory, list) else [kv_memory] * len(partition)
    if len(budgets) != len(partition):
        raise InvalidArgument(f"kv_memory: {len(budgets)} budgets for {len(partition)} stages")
    for b in budgets:
        _positive("kv_memory", b)
    bb = _block_bytes(model, partition, block_tokens)
    own = [m // b for m, b in zip(budgets, bb)]
    if min(own) < 1:
        s = own.index(min(own))
        raise InvalidArgument(
            f"kv_memory: stage {s} has {budgets[s]} bytes, less than one block ({bb[s]} bytes)"
        )
    blocks = min(own)
    stages = _proportional(partition, bb, blocks, block_tokens)
    saved = sum(budgets) - sum(s.kv_bytes for s in stages)
    uniform = _uniform(partition, budgets, own, bb, block_tokens, blocks, saved)
    return Plan(
        block_tokens, partition, stages, uniform, saved, 1.0, "per-device", _settings(stages)
    )


def plan_total(model: ModelKV, partition: list[int], block_tokens: int, total: int) -> Plan:
    """One total budget: split in proportion to each stage's KV bytes per
    token, against an even split (reported as capacity gain)."""
    _positive("block_tokens", block_tokens)
    _positive("total_kv_memory", total)
    bb = _block_bytes(model, partition, block_tokens)
    blocks = total // sum(bb)
    if blocks < 1:
        raise InvalidArgument(
            f"total_kv_memory: {total} bytes is less than one block on every stage ({sum(bb)} bytes)"
        )
    even = total // len(partition)
    own = [even // b for b in bb]
    u_blocks = min(own)
    stages = _proportional(partition, bb, blocks, block_tokens)
    wasted = sum(even - u_blocks * b for b in bb)
    evens = [even] * len(partition)
    uniform = _uniform(partition, evens, own, bb, block_tokens, u_blocks, wasted)
    saved = total - sum(s.kv_bytes for s in stages)
    gain = blocks / u_blocks if u_blocks else float("inf")
    return Plan(block_tokens, partition, stages, uniform, saved, gain, "total", _settings(stages))


def _proportional(
    partition: list[int], bb: list[int], blocks: int, block_tokens: int
) -> list[StagePlan]:
    """Every stage holds ``blocks`` blocks of its own size ``bb[i]``."""
    return [
        StagePlan(n, blocks * b, blocks, blocks * block_tokens, b) for n, b in zip(partition, bb)
    ]


def _uniform(
    partition: list[int],
    budgets: list[int],
    own: list[int],
    bb: list[int],
    block_tokens: int,
    usable: int,
    wasted: int,
) -> dict[str, Any]:
    """What engines do: stage i takes ``budgets[i]`` (``own[i]`` blocks), but
    only ``usable`` blocks (the tightest stage's) serve requests."""
    stages = [
        StagePlan(n, m, o, o * block_tokens, b) for n, m, o, b in zip(partition, budgets, own, bb)
    ]
    return {
        "stages": [asdict(s) for s in stages],
        "usable_blocks": usable,
        "usable_tokens": usable * block_tokens,
        "kv_bytes": sum(budgets),
        "wasted_bytes": wasted,
    }


def _settings(stages: list[StagePlan]) -> list[dict[str, Any]]:
    return [
        {"pp_rank": i, "kv_cache_memory_bytes": s.kv_bytes, "num_gpu_blocks": s.blocks}
        for i, s in enumerate(stages)
    ]


def host_pool_per_rank(
    model: ModelKV,
    partition: list[int],
    block_tokens: int,
    total_host_bytes: int,
    blocks_per_chunk: int = 1,
) -> list[dict[str, int]]:
    """Size kvtier's host pool per pipeline rank: equal slot counts, slot bytes
    proportional to each rank's layers (so no rank's pool holds dead slots)."""
    _positive("total_host_bytes", total_host_bytes)
    _positive("blocks_per_chunk", blocks_per_chunk)
    slot = [b * blocks_per_chunk for b in _block_bytes(model, partition, block_tokens)]
    slot = [-(-s // 64) * 64 for s in slot]  # pools want 64-byte multiples
    n = total_host_bytes // sum(slot)
    if n < 1:
        raise InvalidArgument(f"total_host_bytes: {total_host_bytes} holds no chunk on every rank")
    return [
        {"pp_rank": i, "slot_bytes": s, "num_slots": n, "pool_bytes": n * s}
        for i, s in enumerate(slot)
    ]


def host_pool_for_chunks(
    cell_bytes: int,
    cells_per_slot: int,
    host_bytes: int,
    *,
    trailer_bytes: int = 0,
    num_slots: int | None = None,
    setting: str = "host_bytes",
) -> tuple[int, int]:
    """``(num_slots, slot_bytes)`` of one host pool whose slot holds
    ``cells_per_slot`` cells of ``cell_bytes`` back to back (one chunk of every
    rank sharing the pool), padded to 4 KiB for direct I/O, plus
    ``trailer_bytes`` (a disk record's trailer). ``num_slots`` given wins over
    ``host_bytes`` (pipeline stages must agree on it); ``setting`` names the
    size in the error when not one slot fits.

    Who calls: the vLLM shim, for each process's pool. Pure arithmetic.
    """
    _positive("cell_bytes", cell_bytes)
    _positive("cells_per_slot", cells_per_slot)
    payload = -(-(cell_bytes * cells_per_slot) // 4096) * 4096
    slot_bytes = payload + trailer_bytes
    n = num_slots if num_slots is not None else host_bytes // slot_bytes
    if n < 1:
        raise InvalidArgument(f"{setting}: {host_bytes} B holds no chunk of {slot_bytes} B")
    return n, slot_bytes


@dataclass(frozen=True)
class RankCells:
    """Where one engine rank's KV goes in a host slot: a slot holds one chunk
    of every rank of its pipeline stage, each rank's cell back to back (each
    stage has its own pool: with uneven layer splits their cells differ). A
    replicated layout (MLA: every TP rank holds the same latent) keeps one
    cell a slot, written by the stage's first rank and read by all, so the
    latent is stored once and its blocks do not depend on the TP size."""

    tp_size: int
    stage: int
    cell_index: int
    cells: int
    is_writer: bool

    @classmethod
    def of(cls, world_size: int, rank: int, pp_size: int, replicated: bool) -> RankCells:
        """Who calls: the vLLM shim's spec, in every process. Pure."""
        _positive("world_size", world_size)
        _positive("pp_size", pp_size)
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} outside a world of {world_size}")
        tp = max(1, world_size // pp_size)
        in_stage = rank % tp if pp_size > 1 else rank
        cells = 1 if replicated else (tp if pp_size > 1 else world_size)
        stage = rank // tp if pp_size > 1 else 0
        return cls(tp, stage, 0 if replicated else in_stage, cells, not replicated or in_stage == 0)


def stage_disks(disk: DiskOptions, payloads: Sequence[int]) -> list[DiskOptions]:
    """One disk tier's options per pipeline stage (``payloads``: each stage's
    bytes of a block): its own directory ``stage<i>`` under ``disk.path`` and a
    share of the capacity in proportion to its part of a block. A share of
    the free space (``80%``) is resolved once for all stages before the first
    allocates (their own slabs count as free); that reads the file system.

    Who calls: the vLLM shim's spec, with pipeline parallelism (one stage: ``[disk]``).
    """
    if len(payloads) == 1:
        return [disk]
    if disk.path is None:
        raise InvalidArgument("stage_disks: the disk options have no path")
    capacity = disk.capacity_bytes
    if isinstance(capacity, FreeFraction):
        from kvtier.tiers.disk.directory import resolve_capacity

        root = Path(disk.path)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        capacity = resolve_capacity(capacity, root, root.glob("stage*/kvtier-*/slab-*.dat"))
    return [
        replace(
            disk,
            path=str(Path(disk.path) / f"stage{st}"),
            capacity_bytes=capacity * p // sum(payloads),
        )
        for st, p in enumerate(payloads)
    ]


def recommend_partition(
    model: ModelKV,
    stages: int,
    block_tokens: int,
    device_memory: int | list[int],
    weight_bytes_per_layer: int,
    embedding_bytes: int = 0,
    lm_head_bytes: int = 0,
) -> tuple[list[int], int]:
    """The layer partition that maximises the common block count.

    Stage s holds ``l_s`` layers of weights plus KV for B blocks; embeddings
    sit on the first stage, the LM head on the last. For a given B each stage
    can take at most ``floor(free_s / (w + B * kv_layer_block))`` layers, so B
    is feasible iff those maxima sum to the layer count: binary search on B.
    Assumes uniform layers (no sliding/full mix). Returns (partition, blocks).
    """
    _positive("stages", stages)
    _positive("weight_bytes_per_layer", weight_bytes_per_layer)
    mem = device_memory if isinstance(device_memory, list) else [device_memory] * stages
    if len(mem) != stages:
        raise InvalidArgument(f"device_memory: {len(mem)} values for {stages} stages")
    free = list(mem)
    free[0] -= embedding_bytes
    free[-1] -= lm_head_bytes
    kv_layer_block = model.full_layer_bytes_per_token * block_tokens

    def max_layers(b: int) -> list[int]:
        return [max(0, f // (weight_bytes_per_layer + b * kv_layer_block)) for f in free]

    def ok(b: int) -> bool:
        m = max_layers(b)
        return min(m) >= 1 and sum(m) >= model.layers

    if not ok(1):
        raise InvalidArgument(
            "device_memory: too small for the weights plus one KV block per stage"
        )
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    parts = max_layers(lo)
    excess = sum(parts) - model.layers
    while excess > 0:  # take layers back from the stages with the most slack
        s = max(range(stages), key=lambda i: (parts[i] > 1, parts[i]))
        parts[s] -= 1
        excess -= 1
    return parts, lo


def model_from_hf_config(
    path: str | Path, context_tokens: int = 0, dtype: str | None = None
) -> ModelKV:
    """Read a Hugging Face ``config.json``: standard, MLA (kv_lora_rank) and
    sliding-window (layer_types / sliding_window_pattern) models."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"model_config: cannot read {p}: {e}") from None
    cfg = cfg.get("text_config", cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
    except KeyError:
        raise InvalidArgument(f"model_config: {p} has no num_hidden_layers") from None
    dt = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if cfg.get("kv_lora_rank"):
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))
        return ModelKV(layers, dtype=dt, mla_latent=latent)
    heads = int(cfg.get("num_attention_heads", 0))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg["hidden_size"]) // heads if heads else 0))
    sliding: tuple[int, ...] = ()
    window = int(cfg.get("sliding_window") or 0)
    if window:
        if "layer_types" in cfg:
            sliding = tuple(i for i, t in enumerate(cfg["layer_types"]) if "sliding" in str(t))
        elif cfg.get("sliding_window_pattern"):
            k = int(cfg["sliding_window_pattern"])  # every k-th layer is global
            sliding = tuple(i for i in range(layers) if (i + 1) % k != 0)
        else:
            sliding = tuple(range(layers))
    ctx = context_tokens or int(cfg.get("max_position_embeddings") or 0)
    if sliding and not ctx:
        raise InvalidArgument("context_tokens: needed for a sliding-window model")
    return ModelKV(
        layers,
        kv_heads,
        head_dim,
        dt,
        sliding=sliding,
        window=window if sliding else 0,
        context_tokens=ctx if sliding else 0,
    )
