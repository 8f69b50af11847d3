"""vLLM's own scheduler with KVTierConnector, built in-process on CPU, and
a stand-in for its model runner and offloading worker that knows what each
KV block holds; free of pytest so that the engine's Python (vLLM 0.32, no
pytest there) runs it too: ``python tests/integration/vllm_scheduler_case.py``
prints ``ok``.

The case (issue 58): two requests share a prefix that kvtier holds in a
lower tier (the worker streams it from disk, so its load can fail), and the
first one's load fails. vLLM caches a synchronous hit's blocks when it
allocates them; a second request that found them in its local prefix hit
counted them as computed before the first one recomputed them, and its
first token was computed on blocks the load never filled.

The stand-in samples :data:`RIGHT` for a request whose step read only
blocks holding the KV of its own prefix, :data:`WRONG` otherwise. A step's
writes are visible to every read of the same step (vLLM writes a layer's
new KV into the cache before that layer's attention reads it), which is
how vLLM lets a request share blocks another request computes in the same
step.

Who calls: tests/integration/test_vllm_scheduler_failed_load.py, in-process
(vLLM 0.33) and as a child process of the engine's Python (0.32). Blocks:
the disk tier's writes (a few ms).
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm import ModelRegistry, SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BS = 16  # tokens per block
NUM_BLOCKS = 64
RIGHT, WRONG = 5, 6  # the token sampled on the right KV, and on any other
PREFIX = list(range(100, 164))  # 4 blocks, the shared prefix
ARCH = "KVTierSchedulerCaseForCausalLM"
# A Llama-shaped config.json for vLLM's ModelConfig (no weights: nothing runs).
MODEL = {
    "architectures": [ARCH],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


class _NoModel(nn.Module):
    """Stands for the model in vLLM's configuration (its registry inspects
    the architecture); never run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def compute_logits(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def embed_input_ids(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def build_scheduler(tmp: Path, async_scheduling: bool) -> Any:
    """vLLM's scheduler (asynchronous or not) with KVTierConnector over a
    host tier and a disk tier under ``tmp``; disk hits are streamed by the
    worker (no promotion), so they may fail to load."""
    ModelRegistry.register_model(ARCH, _NoModel)
    init_none_hash(sha256)
    model_dir = tmp / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MODEL))
    extra = {
        "kvtier_host_bytes": "1MiB",
        "kvtier_num_slots": 8,
        "kvtier_promote": False,
        "kvtier_scan_wait_ms": 0,
        "kvtier_disk_path": str(tmp / "disk"),
        "kvtier_disk_bytes": "4MiB",
    }
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        ),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float32)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=2 * page * NUM_BLOCKS,
        layers=["l0", "l1"],
        layer_stride=page * NUM_BLOCKS,
        block_stride=page,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)],
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
    )


def request(rid: str, tokens: list[int]) -> Request:
    """A request of one output token (the first token is the one checked)."""
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def store(scheduler: Any, tokens: list[int], lower: bool) -> None:
    """Put the KV blocks of ``tokens`` in kvtier through the connector's
    manager: in the host tier, or (``lower``) in the disk tier only."""
    m = scheduler.connector.connector_scheduler.manager
    keys = [make_offload_key(h, 0) for h in request("seed", tokens).block_hashes]
    ctx = ReqContext(req_id="seed")
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    with m.lock:
        assert m.prepare_store(keys, ctx) is not None
        m.complete_store(keys, ctx)
    if not lower:
        return
    disk = m.m.lower[0]
    deadline = time.monotonic() + 10
    while not all(disk.lookup(bytes(k)).name == "HIT" for k in keys):
        assert time.monotonic() < deadline, "the cascade to disk did not finish"
        with m.lock:
            m.on_schedule_end(end)
        time.sleep(0.005)
    with m.lock:
        m.reset_cache()
        m.on_reset_flushed()
        m.on_schedule_end(end)


class Engine:
    """vLLM's engine-core loop over ``scheduler``: ``EngineCore.step``, or
    under asynchronous scheduling ``step_with_batch_queue`` (a step is
    scheduled before the previous one's output is processed); and a
    stand-in for the model runner and the offloading worker. A synchronous
    load is done before its step's forward pass and reported with its
    output; an asynchronous one and a store are reported a step later. The
    loads of the requests in ``failing`` fail: their blocks are reported
    invalid, as KVTierWorker reports a record that failed its check."""

    def __init__(self, scheduler: Any, failing: set[str]) -> None:
        self.s = scheduler
        self.failing = failing
        self.kv: dict[int, tuple[int, ...]] = {}  # block -> the token prefix whose KV it holds
        self.loads: list[tuple[str, bool]] = []  # (request, synchronous) of each load job
        self.steps: list[tuple[str, int, int, bool]] = []  # (request, computed, new, right)
        self._async: list[tuple[int, Any]] = []
        self._stores: list[int] = []
        self._queue: collections.deque[tuple[Any, Any]] = collections.deque()
        self._depth = 2 if scheduler.vllm_config.scheduler_config.async_scheduling else 1

    def step(self) -> None:
        """One engine step: schedule and run a batch; process the oldest
        batch's output once the queue is full (or nothing is left to run)."""
        if self.s.has_requests():
            out = self.s.schedule()
            self._queue.appendleft((out, self._execute(out)))
            if len(self._queue) < self._depth:
                return
        if self._queue:
            out, result = self._queue.pop()
            self.s.update_from_output(out, result)

    def run(self, max_steps: int = 50) -> None:
        """Step until no request is left, then process the batches still
        queued. Not ``has_requests()``: vLLM 0.33 keeps stepping while the
        connector has work pending (kvtier's cascade to disk, a background
        thread), so on a loaded machine that count of steps depends on time
        (CI once ran 50 steps with no request left); it is not waited for."""
        for _ in range(max_steps):
            if not self.s.requests:
                while self._queue:
                    out, result = self._queue.pop()
                    self.s.update_from_output(out, result)
                return
            self.step()
        raise AssertionError(f"requests left after {max_steps} steps: {list(self.s.requests)}")

    def _load(self, entry: Any) -> tuple[bool, set[int]]:
        tokens = list(self.s.requests[entry.req_id].all_token_ids)
        first = int(entry.dst_spec.block_indices[0])
        blocks = [int(b) for b in entry.dst_spec.block_ids]
        ok = entry.req_id not in self.failing
        for i, b in enumerate(blocks, first):
            if ok:
                self.kv[b] = tuple(tokens[: (i + 1) * BS])
            else:
                self.kv.pop(b, None)  # never filled: whatever it held before
        return ok, set(blocks)

    def _execute(self, out: Any) -> ModelRunnerOutput:
        meta = out.kv_connector_metadata
        done = dict.fromkeys(self._stores, 1)
        invalid: set[int] = set()
        received = set()
        self._stores = list(getattr(meta, "store_jobs", None) or ())
        for job, entry in self._async:
            ok, blocks = self._load(entry)
            done[job] = 1
            received.add(entry.req_id)
            invalid |= set() if ok else blocks
        self._async = []
        for job, entry in (getattr(meta, "load_jobs", None) or {}).items():
            sync = getattr(entry, "sync", None)
            if sync is None:  # vLLM 0.32: KVTierConnector names them
                sync = job in (getattr(meta, "kvtier_sync_loads", None) or ())
            self.loads.append((entry.req_id, bool(sync)))
            if not sync:
                self._async.append((job, entry))
                continue
            ok, blocks = self._load(entry)
            done[job] = 1
            invalid |= set() if ok else blocks
        sampled = self._forward(out)
        kvo = KVConnectorOutput(
            finished_recving=received or None,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done)
            if done
            else None,
        )
        ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
            kv_connector_output=kvo,
        )

    def _forward(self, out: Any) -> dict[str, list[int]]:
        """Which scheduled requests read only blocks holding their own
        prefix (blocks written in the step by such a request included), the
        blocks' contents after the step, and each request's sampled tokens."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        work = {}
        for rid, n in out.num_scheduled_tokens.items():
            c = computed[rid]
            blocks = self.s.kv_cache_manager.get_block_ids(rid)[0]
            tokens = tuple(self.s.requests[rid].all_token_ids)
            writes = {
                blocks[i]: tokens[: min((i + 1) * BS, c + n)]
                for i in range(c // BS, -(-(c + n) // BS))
            }
            reads = [(blocks[i], tokens[: min((i + 1) * BS, c)]) for i in range(-(-c // BS))]
            work[rid] = (c, n, writes, reads)
        right = dict.fromkeys(work, True)
        changed = True
        while changed:  # down to the requests whose reads are all right
            changed = False
            # A block a wrong request writes holds garbage for every reader.
            written = {b: kv if right[r] else () for r, w in work.items() for b, kv in w[2].items()}
            for rid, (_, _, _, reads) in work.items():
                if right[rid] and any(
                    written.get(b, self.kv.get(b, ()))[: len(want)] != want for b, want in reads
                ):
                    right[rid] = False
                    changed = True
        sampled = {}
        for rid, (c, n, writes, _) in work.items():
            for b, kv in writes.items():
                if right[rid]:
                    self.kv[b] = kv
                else:
                    self.kv.pop(b, None)
            self.steps.append((rid, c, n, right[rid]))
            done = c + n >= self.s.requests[rid].num_prompt_tokens
            sampled[rid] = [RIGHT if right[rid] else WRONG] if done else []
        return sampled


def shared_prefix(
    tmp: Path,
    async_scheduling: bool = True,
    on_disk: bool = True,
    a_fails: bool = True,
    abort_a: bool = False,
) -> dict[str, Any]:
    """Request A has a hit of :data:`PREFIX` (``on_disk``: the disk tier
    alone, streamed; else ready host slots) whose load fails when
    ``a_fails``; C, with the same prefix, comes one step later. With
    ``abort_a`` A's client hangs up right after its first step (vLLM keeps
    a failed load's blocks cached for the request to recompute; then
    nobody does). What came of it: the first tokens, the load jobs, the
    steps and the manager's count of failed loads."""
    s = build_scheduler(tmp, async_scheduling)
    try:
        store(s, PREFIX, lower=on_disk)
        engine = Engine(s, failing={"A"} if a_fails else set())
        a = request("A", PREFIX + list(range(200, 208)))
        s.add_request(a)
        engine.step()
        if abort_a:
            s.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
        c = request("C", PREFIX + list(range(300, 308)))
        s.add_request(c)
        engine.run()
        return {
            "first_tokens": {"A": list(a.output_token_ids), "C": list(c.output_token_ids)},
            "loads": engine.loads,
            "steps": engine.steps,
            "load_failures": s.connector.connector_scheduler.manager.m.stats.load_failures,
        }
    finally:
        s.shutdown()


# shared_prefix's outcome for a hit in ready host slots that loads: within
# A's step, and C shares the blocks A loaded.
HOST_HIT = {
    "first_tokens": {"A": [RIGHT], "C": [RIGHT]},
    "loads": [("A", True)],
    "steps": [("A", 64, 8, True), ("C", 64, 8, True)],
    "load_failures": 0,
}


def check_all() -> None:
    """Every case's expected outcome (the tests assert the same, one by one)."""
    for async_scheduling in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            r = shared_prefix(Path(tmp), async_scheduling, abort_a=not async_scheduling)
        assert r["load_failures"] == len(PREFIX) // BS, r
        assert r["first_tokens"]["C"] == [RIGHT], r
        assert r["loads"][0] == ("A", False), r
    with tempfile.TemporaryDirectory() as tmp:
        r = shared_prefix(Path(tmp), on_disk=False, a_fails=False)
    assert r == HOST_HIT, r


if __name__ == "__main__":
    check_all()
    print("ok")
    sys.exit(0)
