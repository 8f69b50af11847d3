"""An engine's step through the node's shared index without a round trip:
its store from the reservation, its step end posted and answered later, the
answers (events, reservation) taken in order, none lost.

The node runs in a thread of this test; the engines are NodeManagers here."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
from kvtier.errors import InvalidArgument
from kvtier.node import protocol as P
from kvtier.node.connection import NodeClient, NodeError, NodeUnavailable
from kvtier.tiers.base import LookupResult
from test_node import BLOCK, NS_A, Node, _remove_pools, content, key, store


def test_a_step_that_asks_nothing_posts_its_end_and_takes_the_reply_later(tmp_path: Path) -> None:
    n = Node(tmp_path, blocks=256, shared_index=True)
    try:
        a, b = n.engine(engine="a"), n.engine(engine="b")
        pool = a.attach_pool()
        store(a, pool, [900])  # a round trip, then 8 slots reserved (256 // 32)
        a.take_events()
        assert a._view is not None and a._view.reserved == 8
        trips = a.client_stats.round_trips
        first = store(a, pool, [0, 1, 2])  # from the reservation; its step end posted
        assert a._client.owed in (0, 1)
        time.sleep(0.2)  # the reply is waiting: the next call must not take it for a hang-up
        second = store(a, pool, [3, 4])
        assert a.client_stats.round_trips == trips
        ev = a.take_events()  # blocks for what is still owed
        assert a._client.owed == 0
        assert [e.keys for e in ev if not e.removed] == [first, second]
        assert a.client_stats.round_trips == trips
        # The reservation was topped up by the posted step ends' replies.
        assert a._view.reserved == 8
        # Another engine finds and loads them, byte for byte.
        keys = first + second
        assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 5
        spec = b.prepare_load(keys)
        for i, s in zip(range(5), spec.slots.tolist()):
            assert np.array_equal(pool.view(s), content(i))
        b.complete_load(keys)
        b.on_schedule_end()
        b.take_events()
        occ = n.status()["classes"]["4096"]["occupancy"]
        assert (occ["blocks"], occ["pinned"], occ["writing"]) == (6, 0, 0)
        a.shutdown()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_posted_calls_replies_are_taken_in_order_and_waited_for(tmp_path: Path) -> None:
    """NodeClient's posted calls: replies that came are taken without
    waiting (and are not a hang-up), ``leave`` bounds what stays owed, a
    reply that never comes is NodeUnavailable after the timeout, and a
    call's own reply comes after the posted ones'."""
    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    c = NodeClient(path, timeout_s=0.3, spin_s=0.0)
    c.connect()
    peer, _ = srv.accept()
    try:
        for _ in range(3):
            c.post_call(P.Op.STEP_END)
        c.flush()
        assert c.owed == 3 and c.replies() == []
        peer.sendall(P.pack([True, "one"]) + P.pack([True, "two"]))
        time.sleep(0.1)
        assert not c.peer_gone()  # replies waiting are not a hang-up
        assert c.replies(True, 1) == ["one", "two"] and c.owed == 1
        peer.sendall(P.pack([True, "three"]) + P.pack([True, "status"]))
        assert c.call(P.Op.STATUS) == "status"  # its own reply after the posted one
        assert c.replies() == ["three"] and c.owed == 0
        c.post_call(P.Op.STEP_END)
        t0 = time.monotonic()
        with pytest.raises(NodeUnavailable):
            c.replies(True)  # never answered
        assert time.monotonic() - t0 >= 0.25 and not c.connected
    finally:
        c.close()
        peer.close()
        srv.close()


def test_a_node_removes_the_index_files_of_dead_nodes_of_its_name(tmp_path: Path) -> None:
    """A SIGKILLed node leaves its index file (named by its pid) in
    /dev/shm: the next node of its name removes it, and leaves alone the
    file of a live process and the files of other names."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    n = Node(tmp_path, shared_index=True)
    prefix = f"/dev/shm/kvnode-{n.name}-ix-4096-"
    other = f"/dev/shm/kvnode-{n.name}x-ix-4096-{dead.pid}"
    files = [f"{prefix}{dead.pid}", f"{prefix}{live.pid}", other]
    try:
        for f in files:
            Path(f).write_bytes(b"\0" * 64)
        a = n.engine(engine="a")  # the class and its index are made now
        assert a._view is not None
        assert [Path(f).exists() for f in files] == [False, True, True]
        assert Path(f"{prefix}{os.getpid()}").exists()  # this node's own
        a.shutdown()
    finally:
        live.kill()
        live.wait()
        n.stop()
        for f in files:
            Path(f).unlink(missing_ok=True)
        _remove_pools(n.name)


def test_one_requests_miss_is_chained_to_its_own_hits_not_another_engines(tmp_path: Path) -> None:
    """The node's scan hint (a MISS's parent is the HIT its scan found
    before it) stays within one engine's request: engine B's first MISS is
    not chained to the blocks engine A's scan hit just before."""
    n = Node(tmp_path)
    try:
        a, b = n.engine(engine="a"), n.engine(engine="b")
        pool = a.attach_pool()
        keys = store(a, pool, [0, 1, 2, 3])
        m = n.server.classes[4096].manager
        ns = bytes.fromhex(NS_A)[:8]
        assert [a.lookup(k) for k in keys] == [LookupResult.HIT] * 4  # ends on a HIT
        assert b.lookup(key(100)) is LookupResult.MISS
        assert ns + key(100) not in m._miss_prev
        for mgr in (a, b):
            mgr.on_schedule_end()
        # Within one request the hint is kept: its MISS follows its HITs.
        assert [a.lookup(k) for k in keys] == [LookupResult.HIT] * 4
        assert a.lookup(key(101)) is LookupResult.MISS
        assert m._miss_prev[ns + key(101)] == ns + keys[-1]
        a.on_schedule_end()
        a.shutdown()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_a_keys_life_through_the_shared_index_makes_no_round_trip(tmp_path: Path) -> None:
    """kvtier bench manager --node's cycle against a node in this process:
    after the first store (which reserves), every lookup, store, load and
    step end goes without a round trip, and every returning key is found."""
    from kvtier.bench.manager import returning_cycles
    from kvtier.node.client import OWED_STEPS, STEPS_PER_END, NodeManager

    n = Node(tmp_path, blocks=8192, shared_index=True)
    try:
        keys = [key(i) for i in range(2000)]
        order = {k: i for i, k in enumerate(keys)}

        def following(k: bytes, ctx: object) -> list[bytes]:
            i = order[k]
            return keys[i + 1 : (i // 16 + 1) * 16]

        m = NodeManager(n.path, NS_A, 4096, engine="bench", key_order=following)
        # A store reaches the node with the step end that covers it: with
        # OWED_STEPS of those unanswered at most, the node has published it
        # this many steps later (the node is a thread here: it runs when the
        # engine waits, so no sooner is sure).
        lag = (OWED_STEPS + 1) * STEPS_PER_END
        _, missed = returning_cycles(m, keys, 16, lag)
        assert missed == 0
        assert m.client_stats.round_trips == 1  # the first PREPARE_STORE
        assert m.stats.loads == 2000 and m.stats.lookups["hit"] == 2000
        m.take_events()
        occ = n.status()["classes"]["4096"]["occupancy"]
        assert (occ["blocks"], occ["pinned"], occ["writing"]) == (2000, 0, 0)
        m.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_loads_through_the_index_are_told_with_the_step_end(tmp_path: Path) -> None:
    """An engine's loads through the shared index send the node nothing
    per load: their slots and the finished request go with the step end,
    where the node counts the loads and uses the blocks (a loaded block
    outlives older ones it was behind); a slot outside the pool there
    closes the connection."""
    n = Node(tmp_path, blocks=64, shared_index=True)
    try:
        a, b = n.engine(engine="a"), n.engine(engine="b")
        pool = a.attach_pool()
        for i in range(0, 8, 2):  # single-block chains 0..7, oldest first
            store(a, pool, [i])
            store(a, pool, [i + 1])
        a.take_events()
        m = n.server.classes[4096].manager
        ns = bytes.fromhex(NS_A)[:8]

        class Req:
            req_id = "r"

        assert b.lookup(key(0), Req) is LookupResult.HIT
        spec = b.prepare_load([key(0)], Req)
        assert np.array_equal(pool.view(int(spec.slots[0])), content(0))
        b.complete_load([key(0)], Req)
        b.on_request_finished(Req)
        assert b._finished == ["r"] and b._loaded == [int(spec.slots[0])]
        assert m.stats.loads == 0  # nothing sent yet
        b.on_schedule_end()
        b.take_events()
        assert b._finished == [] and m.stats.loads == 1
        # Fill the tier: the oldest blocks go, but key 0, used since, stays.
        i = 100
        while ns + key(1) in m.host.entries:
            store(a, pool, [i])
            i += 1
        assert ns + key(0) in m.host.entries
        assert b.lookup(key(0)) is LookupResult.HIT
        b.on_schedule_end()
        b.take_events()
        refused = n.server.counters["protocol_errors"]
        with pytest.raises(NodeError, match="loaded slots outside the pool"):
            b._client.call(P.Op.STEP_END, [], [n.server.classes[4096].pool.num_slots])
        assert not b._client.connected
        assert n.server.counters["protocol_errors"] == refused + 1
        for bad in ([0, -1], [2**64 - 1]):  # below the pool; past what a slot can be
            c = n.engine(engine="c")
            c.on_schedule_end()
            c.take_events()
            with pytest.raises(NodeError, match="loaded slots outside the pool"):
                c._client.call(P.Op.STEP_END, [], bad)
            assert not c._client.connected
            c.shutdown()
        assert n.server.counters["protocol_errors"] == refused + 3
        assert n.server.counters["internal_errors"] == 0
        a.shutdown()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_a_reservation_grows_for_an_engine_that_takes_more_than_a_quarter_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node tops an engine's reservation up to RESERVE, and to four
    times what the engine took since the last top-up when that is more, at
    most RESERVE_MAX (and 1/32 of the class): an engine whose steps end
    many at a time has the slots of those steps in hand; one that takes
    little keeps RESERVE. It never shrinks (the engine holds its slots)."""
    from kvtier.node import state

    monkeypatch.setattr(state, "RESERVE", 4)
    monkeypatch.setattr(state, "RESERVE_MAX", 24)
    n = Node(tmp_path, blocks=1024, shared_index=True)  # 1/32: 32, not the cap here
    c = NodeClient(n.path, timeout_s=5.0)
    try:
        c.call(P.Op.HELLO, P.VERSION, NS_A, BLOCK, "e", False)
        _, slots, _, held = c.call(P.Op.PREPARE_STORE, [key(0)], "r")
        assert len(held) == 4  # RESERVE
        ids = iter(range(1, 1000))

        def take(m: int) -> int:
            """Stores into m reserved slots; the reservation's size after the step end."""
            nonlocal held
            begun = [key(next(ids)) for _ in range(m)]
            c.post(P.Op.STORES, begun + begun, held[:m], ["r", "r"], [m, -m])
            reply = c.call(P.Op.STEP_END, [], [])
            held = held[m:] + reply[3]
            return len(held)

        assert take(1) == 4  # 4 x 1 is not more than 4
        assert take(3) == 12  # 4 x 3
        assert take(12) == 24  # 4 x 12 = 48, at most RESERVE_MAX
        assert take(1) == 24  # kept
        assert len(set(held)) == 24 and slots[0] not in held
    finally:
        c.close()
        n.stop()
        _remove_pools(n.name)


@pytest.mark.parametrize("events", [False, True])
def test_evicted_keys_are_told_only_to_engines_that_take_kv_events(
    tmp_path: Path, events: bool
) -> None:
    """An offer's and a step end's evicted keys (this namespace's, for the
    engine's next PrepareStoreResult) go to an engine that takes KV events;
    one that takes none (vLLM's default; vLLM reads them from no offer) is
    sent none, for blocks evicted just the same."""
    n = Node(tmp_path, blocks=64, shared_index=True)  # a reservation of 2
    c = NodeClient(n.path, timeout_s=5.0)
    try:
        c.call(P.Op.HELLO, P.VERSION, NS_A, BLOCK, "e", events)
        told: list[bytes] = []
        for i in range(0, 120, 4):  # about twice the class
            keys = [key(j) for j in range(i, i + 4)]
            stored, _, evicted, _ = c.call(P.Op.PREPARE_STORE, keys, f"r{i}")
            c.post(P.Op.COMPLETE_STORE, stored, f"r{i}", True)
            told += evicted + c.call(P.Op.STEP_END, [f"r{i}"], [])[4]
        blocks = n.status()["classes"][str(BLOCK)]["occupancy"]["blocks"]
        assert blocks < 64  # blocks were evicted either way
        if events:
            assert len(told) == len(set(told)) >= 120 - 64
            assert set(told) <= {key(j) for j in range(120)}
        else:
            assert told == []
    finally:
        c.close()
        n.stop()
        _remove_pools(n.name)


def test_an_engine_of_the_version_before_still_stores_and_loads(tmp_path: Path) -> None:
    """A node speaks protocol 2 too (upgrade the node first): an engine of
    that release stores by PREPARE_STORE, STORE_BEGIN and COMPLETE_STORE,
    never STORES, and what it stored is there for engines of this one."""
    n = Node(tmp_path, blocks=256, shared_index=True)
    try:
        a = n.engine(engine="new")
        pool = a.attach_pool()
        c = NodeClient(n.path, timeout_s=5.0)
        info = c.call(P.Op.HELLO, 2, NS_A, BLOCK, "old", False)
        assert info["pool"] == a.pool["pool"]
        stored, slots, _, reserved = c.call(P.Op.PREPARE_STORE, [key(1)], "r")
        assert stored == [key(1)] and len(reserved) == 8
        begun = [key(2), key(3)]
        for i, s in ((1, slots[0]), (2, reserved[0]), (3, reserved[1])):
            pool.view(s)[:] = content(i)
        c.post(P.Op.STORE_BEGIN, begun, reserved[:2], "r")
        c.post(P.Op.COMPLETE_STORE, [key(1), *begun], "r", True)
        c.call(P.Op.STEP_END, ["r"], [])
        keys = [key(i) for i in (1, 2, 3)]
        assert [a.lookup(k) for k in keys] == [LookupResult.HIT] * 3
        spec = a.prepare_load(keys)
        assert spec.slots.tolist() == [slots[0], *reserved[:2]]
        for i, s in zip((1, 2, 3), spec.slots.tolist()):
            assert np.array_equal(pool.view(s), content(i))
        a.complete_load(keys)
        a.on_schedule_end()
        c.close()
        a.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_an_engine_of_another_protocol_version_is_refused_with_both(tmp_path: Path) -> None:
    n = Node(tmp_path)
    try:
        c = NodeClient(n.path, timeout_s=5.0)
        with pytest.raises(NodeError, match=r"protocol version 1, this node speaks 2 or 3"):
            c.call(P.Op.HELLO, 1, NS_A, 4096, "old", False)
        assert not c.connected
        assert n.server.counters["protocol_errors"] == 1
        assert n.status()["engines"] == []
    finally:
        n.stop()
        _remove_pools(n.name)


def test_a_node_back_with_another_pool_is_not_read_through_its_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node started again with another pool (another name) answers, but
    this engine's workers map the old pool: the engine serves without the
    node (lookups miss) and never reads the new node's index."""
    from kvtier.node import client_link as node_link

    monkeypatch.setattr(node_link, "REATTACH_PERIOD_S", 0.0)
    n = Node(tmp_path, shared_index=True)
    m = None
    try:
        a = n.engine(engine="a")
        pool = a.attach_pool()
        keys = store(a, pool, [0, 1])
        n.stop()
        _remove_pools(n.name)
        n = Node(tmp_path, shared_index=True)  # the same socket, another pool
        m = n.engine(engine="m")
        mpool = m.attach_pool()
        store(m, mpool, [0, 1])  # the same keys, held by the new node
        a.on_schedule_end()  # notices the old connection closed
        a.on_schedule_end()  # reattaches: another pool
        assert a.client_stats.pool_changed and a._view is None
        assert [a.lookup(k) for k in keys] == [LookupResult.MISS] * 2
        assert a.prepare_store(keys) is None
        a.on_schedule_end()
        a.shutdown()
    finally:
        if m is not None:
            m.shutdown()
        n.stop()
        _remove_pools(n.name)


def test_a_reused_packer_frames_as_pack_does_and_resets_after_a_failure() -> None:
    pack = P.packer()
    frames = [
        [int(P.Op.STORE_BEGIN), [key(i) for i in range(16)], list(range(16)), "r"],
        [10, [], []],
    ]
    for f in frames:
        assert pack(f) == P.pack(f)
    with pytest.raises(TypeError):
        pack([1, object()])  # not packable: nothing of it may lead the next frame
    body = pack(frames[1])
    assert body == P.pack(frames[1])
    assert P.unpack(body[P.HEADER.size :]) == frames[1]


@pytest.mark.parametrize("shared", [False, True])
def test_an_offer_takes_bytes_and_bytearrays_and_refuses_anything_else(
    tmp_path: Path, shared: bool
) -> None:
    class Key(bytes):
        pass

    n = Node(tmp_path, blocks=256, shared_index=shared)
    try:
        a = n.engine(engine="a")
        # The first store reserves slots (with the index) for offers without a round trip.
        store(a, a.attach_pool(), [900])
        assert a.lookup(key(900)) is LookupResult.HIT
        assert (a._fast is not None) is shared  # offers of plain keys would take the reservation
        with pytest.raises(InvalidArgument, match=r"^keys must be bytes, got str$"):
            a.prepare_store([key(1), "k2"])  # type: ignore[list-item]
        offer = [key(1), bytearray(key(2)), Key(key(3))]
        out = a.prepare_store(offer)  # type: ignore[arg-type]
        assert out is not None
        assert out.keys_to_store == [key(1), key(2), key(3)]
        assert [type(k) for k in out.keys_to_store] == [bytes] * 3
        assert a.client_stats.round_trips == (1 if shared else 4)  # from the reservation
        out2 = a.prepare_store([Key(key(4))])  # a list, of a subclass: not the fast path either
        assert out2 is not None and [type(k) for k in out2.keys_to_store] == [bytes]
        a.complete_store([*out.keys_to_store, *out2.keys_to_store])
        a.on_schedule_end()
        a.status()  # (a round trip: the node has published the posted stores)
        assert [a.lookup(key(i)) for i in (1, 2, 3, 4)] == [LookupResult.HIT] * 4
        a.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_an_engine_idle_after_a_store_has_it_completed_at_the_node(tmp_path: Path) -> None:
    """With the shared index a store's completion is posted, not sent at
    once: an engine that then goes idle (vLLM's last step) has it sent by
    its connection's flusher within FLUSH_AFTER_S, so the node does not keep
    the block as being written (unevictable) until the engine's next call."""
    from kvtier.node.connection import FLUSH_AFTER_S

    n = Node(tmp_path, blocks=8192, shared_index=True)  # 256 slots reserved an engine
    try:
        a = n.engine(engine="a")
        pool = a.attach_pool()
        store(a, pool, [900])  # the first: a round trip, which reserves
        a.take_events()
        keys = [key(i) for i in range(4)]
        out = a.prepare_store(keys)
        assert out is not None and a.client_stats.round_trips == 1  # the first PREPARE_STORE
        for i, s in zip(range(4), out.store_spec.slots.tolist()):
            pool.view(s)[:] = content(i)
        a.complete_store(keys)  # posted: the engine makes no call after this
        assert a._client.queued
        deadline = time.monotonic() + 30 * FLUSH_AFTER_S + 2.0
        while True:
            # Asked on another connection: a's own call would flush its queue.
            occ = n.status()["classes"]["4096"]["occupancy"]
            if (occ["blocks"], occ["writing"]) == (5, 0) or time.monotonic() > deadline:
                break
            time.sleep(FLUSH_AFTER_S)
        assert (occ["blocks"], occ["writing"]) == (5, 0)
        assert not a._client.queued
        a.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_quiet_steps_are_ended_at_the_node_a_few_at_a_time_and_lose_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of an engine with the shared index that asked the node nothing
    end there STEPS_PER_END at a time (one frame); their loads, finished
    requests and events all arrive, and a step that asks the node ends at
    once."""
    from kvtier.node import client
    from kvtier.node.client import STEPS_PER_END

    monkeypatch.setattr(client, "END_AFTER_S", 60.0)  # counted steps only, on a slow machine too
    n = Node(tmp_path, blocks=8192, shared_index=True)
    try:
        a, b = n.engine(engine="a"), n.engine(engine="b")
        pool = a.attach_pool()
        store(a, pool, [900])
        a.take_events()
        assert a._unsent_steps == 0  # its step end sent (the engine's first)
        ends: list[int] = []
        post_call = a._client.post_call

        def counting(op: P.Op, *args: object) -> None:
            if op is P.Op.STEP_END:
                ends.append(len(args[1]))  # type: ignore[arg-type]
            post_call(op, *args)

        a._client.post_call = counting  # type: ignore[method-assign]
        stored = [store(a, pool, [10 * s, 10 * s + 1]) for s in range(2 * STEPS_PER_END)]
        assert len(ends) == 2 and a._unsent_steps == 0
        # Every store's event; taking them waits for the node: every store
        # is published.
        ev = a.take_events()
        want = [k for ks in stored for k in ks]
        assert [k for e in ev if not e.removed for k in e.keys] == want
        # Loads through the index: told by slot with the step end that covers them.
        for keys in stored[:STEPS_PER_END]:
            assert [a.lookup(k) for k in keys] == [LookupResult.HIT] * 2
            a.prepare_load(keys)
            a.complete_load(keys)
            a.on_schedule_end()
        assert ends == [0, 0, 2 * STEPS_PER_END] and a._unsent_steps == 0
        status = n.status()
        assert status["classes"]["4096"]["occupancy"]["blocks"] == 1 + 4 * STEPS_PER_END
        # A step that asked the node ends there at once, with the steps before it.
        a.on_schedule_end()
        assert a._unsent_steps == 1 and len(ends) == 3
        trips = a.client_stats.round_trips
        a.load_present([key(5000)])  # a round trip
        a.on_schedule_end()  # another
        assert a.client_stats.round_trips == trips + 2 and a._unsent_steps == 0
        assert len(ends) == 3 and a._client.owed == 0
        a.shutdown()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_a_quiet_step_long_after_the_last_end_ends_at_the_node_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose steps are slow (a real model's) ends each at the node:
    a quiet step END_AFTER_S after the last end sent is not held for the
    next ones, so its stores' events come back with the next step."""
    from kvtier.node import client

    monkeypatch.setattr(client, "END_AFTER_S", 1.0)  # a loaded machine's stall stays under
    n = Node(tmp_path, blocks=8192, shared_index=True)
    try:
        a = n.engine(engine="a")
        pool = a.attach_pool()
        store(a, pool, [900])  # a round trip: its step end is sent
        a.take_events()
        first = store(a, pool, [1])  # quiet and soon after: held here
        assert a._unsent_steps == 1
        time.sleep(1.1)
        second = store(a, pool, [2])  # quiet, but long after: sent with the first
        assert a._unsent_steps == 0
        ev = a.take_events()
        assert [k for e in ev if not e.removed for k in e.keys] == first + second
        a.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_the_benchs_clients_start_together_once_attached(tmp_path: Path) -> None:
    """``kvtier bench manager --node``'s several clients (child processes)
    are each attached before the timed start, and every returning key of
    each is found: the aggregate times cycles, not imports or connections."""
    from kvtier.bench import node as bench

    n = Node(tmp_path, blocks=8192, shared_index=True, max_classes=2)
    gather, attached = bench._gather, []

    def gather_then_count(q: Any, procs: list[Any], k: int, timeout_s: float = 600.0) -> Any:
        got = gather(q, procs, k, timeout_s)
        attached.append(len(n.status()["engines"]))
        return got

    try:
        with mock.patch.object(bench, "_gather", gather_then_count):
            rate, missed, used, node_used = bench._aggregate(n.path, 2 * 512, 16, 2, events=False)
        # Every client still attached once the last one's figures are in:
        # none detached (or exited) while the others' cycles were timed.
        assert attached == [2, 2]
        assert missed == 0 and rate > 0 and used > 0
        assert node_used == 0.0  # no node process named: the node is this test's thread
        status = n.status()
        # Both clients stored every key of theirs (64-byte blocks: a class of its own).
        assert status["classes"][str(bench.PAYLOAD)]["occupancy"]["blocks"] == 2 * 512
    finally:
        n.stop()
        _remove_pools(n.name)


def test_the_bench_fails_at_once_when_a_client_dies(tmp_path: Path) -> None:
    """A bench client that fails (here: the "node" closes its connection)
    ends the several clients' run with an error naming its exit code, as
    soon as it has died, not after the queue's ten-minute wait; the other
    client (attached first, waiting for a reply that never comes) is
    stopped and reaped: no client is left running or a zombie."""
    from kvtier.bench import node as bench

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp_path / "mute.sock"))
    srv.listen(4)
    held: list[socket.socket] = []

    def serve() -> None:  # the first client waits for a reply, the second is refused
        with contextlib.suppress(OSError):
            held.append(srv.accept()[0])
            srv.accept()[0].close()

    threading.Thread(target=serve, daemon=True).start()
    before = _children()
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"bench client \d+ failed \(exit code 1\)"):
            bench._aggregate(str(tmp_path / "mute.sock"), 2 * 64, 16, 2, events=False)
        assert time.monotonic() - t0 < 120  # spawned interpreters' imports, not the 600 s wait
        # Multiprocessing's resource tracker, started with the clients, stays.
        left = {p: c for p, c in _children().items() if p not in before}
        assert [c for c in left.values() if b"resource_tracker" not in c] == []
    finally:
        srv.close()
        for c in held:
            c.close()


def _children() -> dict[str, bytes]:
    """This process's children (running, exiting or zombies: not reaped)
    and their command lines (empty once exiting)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError):  # reaped meanwhile
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
    return out


def _requests(n: Node) -> int:
    return int(n.server.counters["requests"])


def test_a_flushs_stores_go_as_one_frame_and_end_whole(tmp_path: Path) -> None:
    """Three requests' stores from the reservation, begun and ended, go to
    the node as one STORES request when the engine flushes: each block is
    readable there, byte for byte, with nothing left writing or reserved
    beyond the engine's reservation."""
    n = Node(tmp_path, blocks=256, shared_index=True)
    try:
        a = n.engine(engine="a")
        pool = a.attach_pool()
        store(a, pool, [900])
        a.take_events()
        assert a._view is not None and a._view.reserved == 8
        before = _requests(n)
        for r, ids in enumerate(([0, 1], [2], [3, 4, 5])):
            keys = [key(i) for i in ids]
            out = a.prepare_store(keys, SimpleNamespace(req_id=f"r{r}"))
            assert out is not None and out.keys_to_store == keys
            for i, s in zip(ids, out.store_spec.slots.tolist()):
                pool.view(s)[:] = content(i)
            a.complete_store(keys)
        assert a._client.queued and _requests(n) == before  # nothing sent yet
        a._client.flush()
        deadline = time.monotonic() + 5
        while _requests(n) == before:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _requests(n) == before + 1  # the three begins and ends: one request
        host = n.server.classes[BLOCK].manager.host
        assert len(host) == 7 and host.census() == (0, 0, 0)  # none pinned, writing, cascading
        b = n.engine(engine="b")
        keys = [key(i) for i in range(6)]
        assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 6
        spec = b.prepare_load(keys)
        for i, s in enumerate(spec.slots.tolist()):
            assert np.array_equal(pool.view(s), content(i))
        b.complete_load(keys)
        b.on_schedule_end()
        a.shutdown()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_a_key_ended_and_begun_again_in_one_frame_keeps_its_block_and_frees_the_slot(
    tmp_path: Path,
) -> None:
    """An engine ends a key's store and offers it again before the node has
    heard of either (its shared index does not show the key yet): the node
    takes them in order, keeps the first write's block and frees the second
    write's slot only when that write ends, never while it is written."""
    n = Node(tmp_path, blocks=256, shared_index=True)
    try:
        a = n.engine(engine="a")
        pool = a.attach_pool()
        store(a, pool, [900])
        a.take_events()
        view, c = a._view, a._client
        assert view is not None and view.reserved == 8
        keys = [key(7)]
        first = view.native.store_from_reserve(keys)
        assert first is not None
        second = view.native.store_from_reserve(keys)  # the node has not published it: taken again
        assert second is not None and second[1] != first[1]
        pool.view(first[1][0])[:] = content(7)
        c.post_stores(keys, first[1], "r1")
        c.post_stores(keys, None)
        c.post_stores(keys, second[1], "r2")
        c.flush()
        cls = n.server.classes[BLOCK]
        session = next(iter(cls.sessions))
        deadline = time.monotonic() + 5
        while not session.spare:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert session.spare == {session.prefix + keys[0]: second[1]}  # still written
        assert second[1][0] not in session.reserved
        assert cls.manager.host.owner(first[1][0]) == session.prefix + keys[0]
        free = cls.manager.host.free_slots
        c.post_stores(keys, None)  # the second write ends: its slot is free again
        c.flush()
        while session.spare:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert cls.manager.host.free_slots == free + 1 and not session.writes
        b = n.engine(engine="b")
        assert b.lookup(keys[0]) is LookupResult.HIT
        spec = b.prepare_load(keys)
        assert spec.slots.tolist() == first[1]
        assert np.array_equal(pool.view(first[1][0]), content(7))
        b.complete_load(keys)
        b.on_schedule_end()
        a.shutdown()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ([[b"k" * 36], [], [None], [0]], "nonzero count"),
        ([[b"k" * 36], [], ["r"], [2]], "nonzero count"),
        ([[b"k" * 36], [], ["r"], [1]], "one slot per key"),
        ([[b"k" * 36], [0, 1], ["r"], [1]], "one slot per key"),
        ([[b"k" * 36], [12345], ["r"], [1]], "not reserved"),
        ([[b"k" * 36], [1], ["r", None], [1]], "nonzero count"),
    ],
)
def test_a_malformed_stores_request_closes_only_its_connection(
    tmp_path: Path, args: list, why: str
) -> None:
    n = Node(tmp_path, shared_index=True)
    try:
        a = n.engine(engine="steady")
        pool = a.attach_pool()
        store(a, pool, [1])
        c = NodeClient(n.path, timeout_s=5.0)
        c.call(P.Op.HELLO, P.VERSION, NS_A, BLOCK, "bad", False)
        with pytest.raises(NodeError, match=why):
            c.call(P.Op.STORES, *args)
        assert not c.connected
        assert a.lookup(key(1)) is LookupResult.HIT
        a.on_schedule_end()
        a.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_a_shut_down_manager_refuses_lookups_even_of_keys_its_scan_answered(
    tmp_path: Path,
) -> None:
    """lookup is the native ScanAnswers' (kvtier._native.scan_answers): a
    key the request's scan answered is taken from there without Python;
    shutdown empties the answers, so every lookup reaches the check."""
    from kvtier.errors import ClosedError
    from kvtier.node.client import NodeManager

    n = Node(tmp_path, blocks=256, shared_index=True)
    try:
        keys = [key(i) for i in range(4)]
        m = NodeManager(n.path, NS_A, BLOCK, engine="a", key_order=lambda k, c: keys[1:])
        store(m, m.attach_pool(), [0, 1])
        m.on_schedule_end()
        assert m.lookup(keys[0], None) is LookupResult.HIT
        assert m.lookup(keys[1], req_context=None) is LookupResult.HIT  # answered by the scan
        assert m.lookup(keys[2]) is LookupResult.MISS
        assert m.stats.lookups == {"hit": 2, "hit_pending": 0, "retry": 0, "miss": 1}
        m.on_schedule_end()
        assert m.lookup(keys[0]) is LookupResult.HIT  # keys[1:]'s answers are stored again
        m.shutdown()
        with pytest.raises(ClosedError, match="shut down"):
            m.lookup(keys[1])
        assert m.stats.lookups["hit"] == 3
    finally:
        n.stop()
        _remove_pools(n.name)
