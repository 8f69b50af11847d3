"""The serving soak's client: its workload (returning conversations with
shared prefixes, fresh prompts, long bursts) and an open-loop HTTP client of
vLLM's ``/v1/completions`` that records every request.

:class:`Workload` draws each next prompt from a seeded generator: a
conversation's next turn (a system prompt shared by several conversations,
then the conversation's own turns, growing by one turn each time, so the
tiers see its prefix again) or a fresh prompt nobody sent before.
:func:`send` sends one request, streamed, greedy (temperature 0, fixed
``max_tokens``, ``ignore_eos``), and records when it was sent, its time to
first token, the token ids received and how it ended: ``answered``,
``aborted`` (the client closed the connection on purpose: before the first
token, ``abort="prefill"``, or after some tokens, ``abort="decode"``) or
``failed`` (an HTTP error or a broken connection: a lost request).
:func:`replay` sends recorded prompts again, unstreamed, to the reference
server.

A command-line tool's module: runs in the ``kvtier bench soak --server``
driver process (each request in a thread of its own). Who calls:
:mod:`kvtier.bench.soak_server` and the tests. :class:`Workload` is pure;
:func:`send` and :func:`replay` block on the network.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

VOCAB = (4, 2048)  # token ids drawn from [4, 2048): the generated model's vocabulary, no specials


@dataclass
class Request:
    """One request of the soak: what was sent and what came back."""

    id: int
    prompt: list[int]
    max_tokens: int
    kind: str  # "turn", "fresh", "burst" (KV-cache pressure)
    conversation: int = -1
    turn: int = 0
    abort: str = ""  # "prefill" or "decode": the client hangs up on purpose
    abort_after_s: float = 0.0  # prefill: hang up this long after sending
    abort_after_tokens: int = 0  # decode: hang up after this many tokens
    sent: float = 0.0  # wall clock (time.time())
    ttft_s: float | None = None
    done: float = 0.0
    status: str = "pending"  # answered, aborted, failed
    error: str = ""
    tokens: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "prompt"}
        d["prompt_tokens"] = len(self.prompt)
        return d


@dataclass
class Workload:
    """Seeded prompts: ``conversations`` live conversations over
    ``systems`` shared system prompts; a conversation ends after its prompt
    passes ``max_prompt`` tokens and a new one takes its place."""

    seed: int = 0
    systems: int = 4
    system_tokens: int = 384
    conversations: int = 16
    turn_tokens: int = 160
    max_prompt: int = 1600
    fresh_share: float = 0.25
    fresh_tokens: tuple[int, int] = (256, 1024)
    max_tokens: int = 16

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.system = [self._tokens(self.system_tokens) for _ in range(self.systems)]
        self.convs: dict[int, list[int]] = {}
        self.turns: dict[int, int] = {}
        self.next_conv = 0
        self.next_id = 0
        for _ in range(self.conversations):
            self._new_conversation()

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(*VOCAB) for _ in range(n)]

    def _new_conversation(self) -> None:
        c = self.next_conv
        self.next_conv += 1
        self.convs[c] = list(self.rng.choice(self.system))
        self.turns[c] = 0

    def _request(self, prompt: list[int], kind: str, max_tokens: int, **kw: Any) -> Request:
        r = Request(self.next_id, prompt, max_tokens, kind, **kw)
        self.next_id += 1
        return r

    def next(self, busy: set[int]) -> Request:
        """The next request: a turn of a conversation not in ``busy`` (its
        previous turn still in flight), or a fresh prompt."""
        free = [c for c in self.convs if c not in busy]
        if not free or self.rng.random() < self.fresh_share:
            return self.fresh()
        c = self.rng.choice(free)
        self.convs[c] += self._tokens(self.turn_tokens)
        self.turns[c] += 1
        r = self._request(
            list(self.convs[c]), "turn", self.max_tokens, conversation=c, turn=self.turns[c]
        )
        if len(self.convs[c]) + self.turn_tokens > self.max_prompt:
            del self.convs[c], self.turns[c]
            self._new_conversation()
        return r

    def fresh(self, tokens: int | None = None, kind: str = "fresh", max_tokens: int = 0) -> Request:
        n = tokens or self.rng.randrange(*self.fresh_tokens)
        return self._request(self._tokens(n), kind, max_tokens or self.max_tokens)


def _body(model: str, r: Request, stream: bool) -> str:
    body: dict[str, Any] = {
        "model": model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    return json.dumps(body)


def send(host: str, port: int, model: str, r: Request, timeout_s: float = 300.0) -> Request:
    """Send ``r`` streamed and fill in what came back (see the module
    docstring). Never raises for the server's or the network's faults:
    they are ``failed`` with the error. Blocks until the request ends."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    r.sent = time.time()
    t0 = time.perf_counter()
    try:
        conn.request(
            "POST", "/v1/completions", _body(model, r, True), {"Content-Type": "application/json"}
        )
        if r.abort == "prefill" and conn.sock is not None:
            conn.sock.settimeout(r.abort_after_s)
        resp = conn.getresponse()
        if resp.status != 200:
            r.status, r.error = "failed", f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return r
        finished = False
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                finished = True
                break
            msg = json.loads(data)
            if "error" in msg:
                r.status, r.error = "failed", str(msg["error"])[:300]
                return r
            for ch in msg.get("choices", []):
                ids = ch.get("token_ids") or []
                if ids and r.ttft_s is None:
                    r.ttft_s = time.perf_counter() - t0
                r.tokens.extend(ids)
            if r.abort == "decode" and len(r.tokens) >= r.abort_after_tokens:
                r.status = "aborted"
                return r
        if finished and len(r.tokens) == r.max_tokens:
            r.status = "answered"
        elif not finished:
            r.status, r.error = "failed", "stream ended without [DONE]"
        else:
            r.status, r.error = "failed", f"{len(r.tokens)} tokens of {r.max_tokens}"
    except TimeoutError as e:
        if r.abort == "prefill" and not r.tokens:
            r.status = "aborted"
        else:
            r.status, r.error = "failed", f"timeout: {e}"
    except (OSError, http.client.HTTPException, ValueError) as e:
        r.status, r.error = "failed", f"{type(e).__name__}: {e}"
    finally:
        r.done = time.time()
        conn.close()  # an abort: the server sees the connection go
    return r


class OpenLoop:
    """Sends requests at the instants the driver picks, each in its own
    thread, and keeps every request. Who calls: the driver, from one thread."""

    def __init__(self, host: str, port: int, model: str) -> None:
        self.host, self.port, self.model = host, port, model
        self.requests: list[Request] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def busy(self) -> set[int]:
        """Conversations with a turn in flight."""
        with self._lock:
            return {r.conversation for r in self.requests if r.status == "pending"}

    def start(self, r: Request) -> None:
        with self._lock:
            self.requests.append(r)
        t = threading.Thread(target=send, args=(self.host, self.port, self.model, r), daemon=True)
        t.start()
        self._threads.append(t)
        self._threads = [x for x in self._threads if x.is_alive()]

    def in_flight(self) -> int:
        with self._lock:
            return sum(r.status == "pending" for r in self.requests)

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every request to end."""
        deadline = time.monotonic() + timeout_s
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))


def complete(host: str, port: int, model: str, r: Request, timeout_s: float = 300.0) -> list[int]:
    """The token ids of ``r``'s prompt, unstreamed. Blocks; raises on failure."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request(
            "POST", "/v1/completions", _body(model, r, False), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"reference request {r.id}: HTTP {resp.status}: {data[:300]!r}")
        return list(json.loads(data)["choices"][0]["token_ids"])
    finally:
        conn.close()


def top_logprobs(
    host: str, port: int, model: str, prompt: list[int], k: int = 5, timeout_s: float = 300.0
) -> dict[int, float]:
    """The ``k`` likeliest next tokens after ``prompt`` and their log
    probabilities, by token id (one greedy step). Blocks; raises on failure."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": k,
        "return_tokens_as_token_ids": True,
    }
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"logprobs request: HTTP {resp.status}: {data[:300]!r}")
        top = json.loads(data)["choices"][0]["logprobs"]["top_logprobs"][0]
        # "token_id:123" keys with return_tokens_as_token_ids.
        return {int(t.rsplit(":", 1)[1]): float(lp) for t, lp in top.items()}
    finally:
        conn.close()


def replay(
    host: str, port: int, model: str, reqs: list[Request], concurrency: int = 1
) -> dict[int, list[int]]:
    """Each request's prompt sent again (``max_tokens`` the same), at most
    ``concurrency`` at a time in the order sent; token ids by request id."""
    with ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(lambda r: complete(host, port, model, r), reqs))
    return {r.id: o for r, o in zip(reqs, outs, strict=True)}
