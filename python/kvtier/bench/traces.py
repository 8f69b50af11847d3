"""Request traces for ``kvtier replay`` and the benchmarks: the Mooncake
JSONL format read and checked, and generated workloads (chat sessions, RAG,
agent loops) as lists of prefix-block hash ids.

A command-line tool's module (never imported by the library): runs in the
process of whoever replays, on its calling thread. Who calls:
:mod:`kvtier.replay`, ``kvtier bench soak``, ``route`` and ``vllm``, ``bench/policy_sweep.py``.
Blocks while it reads a file or generates a trace (CPU only).
"""

from __future__ import annotations

import errno
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument, IoError

_MAX_HASH_ID = 1 << 63  # key_of packs a signed 64-bit int


def read_trace(path: str | Path, max_requests: int | None = None) -> list[list[int]]:
    """Mooncake-format JSONL: one object per line with ``hash_ids`` (prefix
    block hashes, ints in [0, 2**63)). Raises InvalidArgument naming the file
    and line of the first bad record, IoError when the file cannot be read."""
    return [r["hash_ids"] for r in read_records(path, max_requests)]


def read_records(path: str | Path, max_requests: int | None = None) -> list[dict[str, Any]]:
    """As :func:`read_trace`, but each line's whole object (``timestamp``,
    ``input_length``, ``output_length`` as the file has them, unchecked), for
    replays that keep time (``kvtier bench route``)."""
    p = Path(path)
    if p.is_dir():
        raise InvalidArgument(f"trace file {p} is a directory")
    if not p.is_file():
        raise InvalidArgument(f"trace file not found: {p}")
    out: list[dict[str, Any]] = []
    try:
        f = p.open("rb")
    except OSError as e:
        raise IoError(e.errno or errno.EIO, f"cannot read trace {p}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ids = obj["hash_ids"]
            except (ValueError, KeyError, TypeError, IndexError) as e:  # ValueError: bad UTF-8 too
                raise InvalidArgument(f"{p}:{lineno}: not a trace record ({e})") from None
            except RecursionError:
                raise InvalidArgument(
                    f"{p}:{lineno}: not a trace record (nested too deep)"
                ) from None
            if not isinstance(ids, list) or not all(
                type(h) is int and 0 <= h < _MAX_HASH_ID for h in ids
            ):
                raise InvalidArgument(
                    f"{p}:{lineno}: hash_ids must be a list of ints in [0, 2**63)"
                )
            out.append(obj)
            if max_requests is not None and len(out) >= max_requests:
                break
    return out


def synthetic_requests(
    seed: int = 0, system_prompts: int = 24, zipf_a: float = 1.3
) -> Iterator[list[int]]:
    """Multi-turn chat sessions sharing system prompts chosen with Zipf
    popularity, without end (``kvtier bench soak`` replays for minutes).

    Each turn's prompt is the session's previous prompt plus a new user message
    and the previous answer, so consecutive turns share a growing prefix. At
    most 64 sessions are open and a prompt has at most 124 blocks, so the
    generator's memory stays bounded however long it runs.
    """
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prompts = [fresh(int(rng.integers(2, 9))) for _ in range(system_prompts)]
    active: list[list[int]] = []
    while True:
        if not active or (len(active) < 64 and rng.random() < 0.35):
            k = min(int(rng.zipf(zipf_a)) - 1, system_prompts - 1)
            active.append(list(prompts[k]))
        i = int(rng.integers(0, len(active)))
        session = active[i]
        session.extend(fresh(int(rng.integers(1, 5))))
        yield list(session)
        if len(session) > 120 or rng.random() < 0.15:
            active.pop(i)


def synthetic_trace(
    num_requests: int = 4000, seed: int = 0, system_prompts: int = 24, zipf_a: float = 1.3
) -> list[list[int]]:
    """The first ``num_requests`` of :func:`synthetic_requests`."""
    return list(itertools.islice(synthetic_requests(seed, system_prompts, zipf_a), num_requests))


class _Trie:
    """Prefix-block ids as a trace has them: one id per (parent id, block content)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, int], int] = {}

    def ids_of(self, blocks: Sequence[int]) -> list[int]:
        out: list[int] = []
        parent = -1
        for b in blocks:
            parent = self.ids.setdefault((parent, b), len(self.ids))
            out.append(parent)
        return out


def rag_trace(num_requests: int = 6000, seed: int = 0) -> list[list[int]]:
    """Retrieval-augmented QA: one of 4 system prompts (2 blocks), one of 600
    documents (4-24 blocks) chosen with Zipf(1.1) popularity, then a question
    of 1-2 blocks seen once. A shallow tree whose reuse is popularity."""
    rng = np.random.default_rng(seed)
    trie, fresh = _Trie(), itertools.count(1 << 40)
    docs = [[next(fresh) for _ in range(int(rng.integers(4, 25)))] for _ in range(600)]
    out: list[list[int]] = []
    for _ in range(num_requests):
        doc = docs[min(int(rng.zipf(1.1)) - 1, len(docs) - 1)]
        sys_p = int(rng.integers(0, 4))
        q = [next(fresh) for _ in range(int(rng.integers(1, 3)))]
        out.append(trie.ids_of([sys_p, sys_p + 4, *doc, *q]))
    return out


def agent_trace(num_requests: int = 6000, seed: int = 0) -> list[list[int]]:
    """Agent loops beside one-off scans: 24 tasks at a time, each on one of 6
    tool prompts (6-20 blocks), re-sent every step with 1-3 blocks of tool
    output appended, for 5-40 steps; a quarter of the requests are one-off
    documents of 20-60 blocks (a scan). Short reuse distances, deep chains."""
    rng = np.random.default_rng(seed)
    trie, fresh = _Trie(), itertools.count(1 << 40)
    tools = [[next(fresh) for _ in range(int(rng.integers(6, 21)))] for _ in range(6)]
    tasks: list[tuple[list[int], int]] = []
    out: list[list[int]] = []
    while len(out) < num_requests:
        if rng.random() < 0.25:
            out.append(trie.ids_of([next(fresh) for _ in range(int(rng.integers(20, 61)))]))
            continue
        while len(tasks) < 24:
            tasks.append((list(tools[int(rng.integers(0, 6))]), int(rng.integers(5, 41))))
        i = int(rng.integers(0, len(tasks)))
        blocks, left = tasks[i]
        blocks.extend(next(fresh) for _ in range(int(rng.integers(1, 4))))
        out.append(trie.ids_of(blocks))
        if left <= 1:
            tasks.pop(i)
        else:
            tasks[i] = (blocks, left - 1)
    return out


WORKLOADS: dict[str, Callable[[int, int], list[list[int]]]] = {
    "chat": lambda n, seed: synthetic_trace(n, seed=seed),
    "rag": rag_trace,
    "agent": agent_trace,
}
