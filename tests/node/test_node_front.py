"""An engine's native manager front (csrc/bindings/node_front.cc) against
the Python methods it stands in for: the same calls give the same answers
and counts, whatever the front takes itself and whatever it hands back to
Python (keys in a list, a tuple or a set as vLLM passes some, or not plain
bytes, failed stores, keyword arguments, contexts with and without request
ids).

The nodes run in threads of this test; the engines are NodeManagers here."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier._native import scan_answers
from kvtier.node import client, connection
from kvtier.node.client import NodeManager
from kvtier.tiers.base import LookupResult
from test_node import Node, _remove_pools, key


def _python_only(m: NodeManager) -> None:
    """The manager as it was without the front: its class's methods."""
    for name in client._NATIVE:
        delattr(m, name)
    names = tuple(r.name.lower() for r in client._ANSWER)
    m.lookup = scan_answers(m._answers, m.stats.lookups, client._ANSWER, names, m._scan).lookup  # type: ignore[method-assign]


def _ctx(rng: random.Random, n: int) -> Any:
    return rng.choice([SimpleNamespace(req_id=f"r{n}"), SimpleNamespace(req_id=n), None, object()])


def _run(m: NodeManager, seed: int) -> list[Any]:
    """A random engine's calls: each request looks its keys up, loads them
    when all HIT, else stores them (some stores fail); what each call
    answered, in order, then the manager's counts."""
    rng = random.Random(seed)
    out: list[Any] = []
    stored_in: dict[bytes, set[int]] = {}  # slots of each key's successful stores
    n = 0
    for _ in range(120):
        for _ in range(rng.randint(1, 3)):
            n += 1
            ctx = _ctx(rng, n)
            first = rng.randrange(48)
            keys = [key(i) for i in range(first, min(48, first + rng.randint(1, 12)))]
            m.on_new_request(ctx)
            found = []
            for k in keys:
                r = m.lookup(k, ctx)
                out.append(r)
                if r is not LookupResult.HIT:
                    break
                found.append(k)
            if found == keys:
                asked: Any = tuple(keys) if n % 5 == 0 else keys
                spec = (
                    m.prepare_load(asked, req_context=ctx) if n % 2 else m.prepare_load(asked, ctx)
                )
                # A block loads from a slot it was stored into. (A key offered
                # again before the node has taken its first store's frame is
                # stored twice: the index shows a store once the node did.)
                assert all(s in stored_in[k] for k, s in zip(keys, spec.slots.tolist()))
                out.append(("load", len(spec)))
                m.complete_load(set(keys) if n % 3 == 0 else keys, ctx)  # vLLM's: a set
            else:
                offer: Any = tuple(keys) if rng.random() < 0.15 else keys
                got = m.prepare_store(offer, ctx) if n % 3 else m.prepare_store(keys=offer)
                assert got is not None
                stored, spec, evicted = got
                out.append(("store", stored, evicted))
                ok = rng.random() > 0.15
                for k, s in zip(stored, spec.slots.tolist()):
                    if ok:
                        stored_in.setdefault(k, set()).add(s)
                if n % 4:
                    m.complete_store(set(stored) if n % 3 else stored, ctx, ok)
                else:
                    m.complete_store(stored, req_context=ctx, success=ok)
            if rng.random() < 0.5:
                m.on_request_finished(ctx)
            else:
                m.on_request_finished(req_context=ctx)
        m.on_schedule_end()
        # The node's answers to what went out, waited for: what the index
        # shows next is the same in both runs (not when the node took it).
        m.take_events()
    out.append(dataclasses.asdict(m.stats))
    return out


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "rpc"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_native_front_answers_as_the_python_methods(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool, seed: int
) -> None:
    # Each Python method the front falls back to, counted.
    calls: dict[str, int] = {}
    for name in client._FALLBACKS:
        fn = getattr(NodeManager, name)

        def counted(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **kw)

        monkeypatch.setattr(NodeManager, name, counted)
    # Frames go out by count and at step ends, never by the clock: both runs
    # send the same frames at the same calls, on a slow machine too.
    monkeypatch.setattr(client, "END_AFTER_S", 60.0)
    monkeypatch.setattr(connection, "FLUSH_AFTER_S", 60.0)
    runs, fell_back = [], []
    for native in (True, False):
        d = tmp_path / ("native" if native else "python")
        d.mkdir()
        # Blocks for every key and a full reservation: nothing evicted.
        n = Node(d, blocks=16384, shared_index=shared)
        try:
            m = n.engine()
            if not native:
                _python_only(m)
            calls.clear()
            runs.append(_run(m, seed))
            fell_back.append(dict(calls))
            m.shutdown()
            occ = n.status()["classes"]["4096"]["occupancy"]
            assert (occ["pinned"], occ["writing"]) == (0, 0)
        finally:
            n.stop()
            _remove_pools(n.name)
    assert runs[0] == runs[1]
    assert runs[0][-1]["stores"] > 0 and runs[0][-1]["loads"] > 0
    # A finished request is kept for the step end by the front itself.
    finished = [f.pop("on_request_finished", 0) for f in fell_back]
    assert finished[0] < finished[1] / 10
    if shared:  # the front took most calls itself
        assert sum(fell_back[0].values()) < sum(fell_back[1].values()) / 3
    else:  # no shared index: each is the Python method's
        assert fell_back[0] == fell_back[1]


def test_the_native_front_takes_the_python_methods_arguments(tmp_path: Path) -> None:
    n = Node(tmp_path, blocks=64, shared_index=True)
    try:
        m = n.engine()
        for call, msg in [
            (lambda: m.prepare_store(), "prepare_store(keys, req_context=None)"),
            (
                lambda: m.prepare_store([key(1)], None, None),
                "prepare_store(keys, req_context=None)",
            ),
            (lambda: m.prepare_load([key(1)], ctx=None), "prepare_load(keys, req_context=None)"),
            (
                lambda: m.complete_store([key(1)], success=True, keys=[key(1)]),
                "complete_store(keys, req_context=None, success=True)",
            ),
            (lambda: m.on_schedule_end(1, 2), "on_schedule_end(context=None)"),
            (lambda: m.on_request_finished(None, x=1), "on_request_finished(req_context=None)"),
        ]:
            with pytest.raises(TypeError, match=msg.replace("(", r"\(").replace(")", r"\)")):
                call()
        assert m.lookup(key(1)) is LookupResult.MISS
        out = m.prepare_store(keys=[key(1)], req_context=SimpleNamespace(req_id="r"))
        assert out is not None and out.keys_to_store == [key(1)]
        m.complete_store(keys=out.keys_to_store, success=True)
        m.on_request_finished(req_context=SimpleNamespace(req_id="r"))
        m.on_schedule_end(context=None)
        assert m.lookup(key(1)) is LookupResult.HIT
        spec = m.prepare_load(keys=[key(1)])
        assert spec.slots.tolist() == out.store_spec.slots.tolist()
        m.complete_load(keys=[key(1)], req_context=None)
        m.on_schedule_end()
        assert (m.stats.stores, m.stats.loads, m.stats.loaded_from) == (1, 1, {"host": 1})
        m.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_the_front_lets_go_of_a_dead_nodes_index(tmp_path: Path) -> None:
    """The front remembers the engine view it last used; once the manager
    has dropped a dead node's index, the front's next call lets go of it
    too (the view keeps the index's mapping while anything holds it)."""
    n = Node(tmp_path, blocks=64, shared_index=True)
    m = n.engine()
    try:
        assert m.lookup(key(1)) is LookupResult.MISS
        out = m.prepare_store([key(1)])  # the front's: it remembers the view
        assert out is not None and m._view is not None
        view = m._view.native
        n.stop()
        m.on_schedule_end()  # the step end finds the node gone
        assert m._view is None and not m.attached
        held = sys.getrefcount(view)
        assert m.prepare_store([key(2)]) is None  # dropped (the node is gone)
        assert sys.getrefcount(view) == held - 1
    finally:
        m.shutdown()
        _remove_pools(n.name)
