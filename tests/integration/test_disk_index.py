"""The disk tier's native index through the tier: policies chosen by name,
their victims, the bulk checkpoint and what a warm restart makes of it
(index only: ``no_data``, so these need no device)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import kvtier
import numpy as np
import pytest
from kvtier import _native
from kvtier.engine import crc32c
from kvtier.tiers import LookupResult
from kvtier.tiers.disk import DiskTier, key_digest, record_bytes
from kvtier.tiers.disk.journal import (
    JOURNAL_ENTRY_BYTES,
    IndexJournal,
    JournalOp,
    RecordState,
    journal_entry,
)
from kvtier.tiers.events import vllm_event_id

BLOCK = 4096
REC = record_bytes(BLOCK)
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def K(i: int) -> bytes:
    return b"key-%08d" % i


def V(i: int, group: int = 0) -> bytes:
    """A key of vLLM's shape: a 32-byte block hash, then its group index."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def E(i: int) -> bytes:
    """K(i)'s event id."""
    return vllm_event_id(K(i))


def tier(path: Path, records: int, policy: str = "lru") -> DiskTier:
    return DiskTier(path, records * REC, BLOCK, no_data=True, policy=policy)


def store(t: DiskTier, *ids: int) -> None:
    assert t.submit_store([K(i) for i in ids], list(range(len(ids)))) is not None
    (c,) = t.poll()
    assert c.ok


def load(t: DiskTier, *ids: int) -> list[bool]:
    assert t.submit_load([K(i) for i in ids], list(range(len(ids)))) is not None
    (c,) = t.poll()
    assert c.key_ok is not None
    return list(c.key_ok)


def resident(t: DiskTier, n: int) -> list[int]:
    return [i for i in range(n) if t.lookup(K(i)) is HIT]


@pytest.mark.parametrize(
    "policy,match",
    [
        ("arc", "disk tier policy must be lru, clock, clock:N"),
        ("lru:2", "disk tier policy must be lru, clock, clock:N"),
        ("clock:x", "disk tier policy must be lru, clock, clock:N"),
        ("clock:0", "N must be in 1..255"),
        ("clock:256", "N must be in 1..255"),
    ],
)
def test_unknown_policies_are_clear_errors(tmp_path: Path, policy: str, match: str) -> None:
    with pytest.raises(kvtier.InvalidArgument, match=match):
        tier(tmp_path, 4, policy)


def test_lru_evicts_the_least_recently_loaded(tmp_path: Path) -> None:
    t = tier(tmp_path, 4)
    store(t, 0, 1, 2, 3)
    assert load(t, 0) == [True]  # order now 1, 2, 3, 0
    store(t, 4)
    assert resident(t, 5) == [0, 2, 3, 4]
    store(t, 5, 6)
    assert resident(t, 7) == [0, 4, 5, 6]
    assert t.stats()["evictions"] == 3
    t.close()


def test_clock_gives_a_loaded_record_a_second_chance(tmp_path: Path) -> None:
    t = tier(tmp_path, 3, "clock")
    store(t, 0, 1, 2)
    assert load(t, 0, 2) == [True, True]
    store(t, 3)  # the hand passes 0 (clearing its bit) and takes 1
    assert resident(t, 4) == [0, 2, 3]
    store(t, 4)  # 2 loses its bit, then 0 (its chance spent) goes
    assert resident(t, 5) == [2, 3, 4]
    t.close()


def test_clock_n_keeps_records_used_more_often(tmp_path: Path) -> None:
    t = tier(tmp_path, 3, "clock:3")
    store(t, 0, 1, 2)
    for _ in range(3):
        assert load(t, 0) == [True]
    assert load(t, 1) == [True]
    store(t, 3)  # 0 has 3 references, 1 one: 2 goes first
    store(t, 4)  # then 1 (spent its one), while 0 still has references
    assert resident(t, 5) == [0, 3, 4]
    t.close()


def test_checkpoint_restart_keeps_lru_order(tmp_path: Path) -> None:
    t = tier(tmp_path, 4)
    store(t, 0, 1, 2, 3)
    assert load(t, 0, 1) == [True, True]  # order now 2, 3, 0, 1
    t.checkpoint()
    t.close()
    assert (tmp_path / t.dir.name / "index.journal").stat().st_size == 0
    t2 = tier(tmp_path, 4)
    assert t2.stats()["recovered"] == 4
    store(t2, 4, 5)
    assert resident(t2, 6) == [0, 1, 4, 5]
    # Recovered records are named by their event ids, which the checkpoint kept.
    removed, stored = t2.take_events()
    assert removed.removed and removed.keys == [] and removed.ids == [E(2), E(3)]
    assert not stored.removed and stored.keys == [K(4), K(5)]
    t2.close()


def test_restart_from_checkpoint_and_journal_and_after_reset(tmp_path: Path) -> None:
    t = tier(tmp_path, 8)
    store(t, 0, 1, 2)
    t.checkpoint()
    store(t, 3, 4)  # in the journal only
    t.close()
    t2 = tier(tmp_path, 8)
    assert t2.stats()["recovered"] == 5
    assert resident(t2, 6) == [0, 1, 2, 3, 4]
    t2.reset()
    t2.close()
    t3 = tier(tmp_path, 8)
    assert t3.stats()["recovered"] == 0
    t3.close()


def test_a_damaged_checkpoint_is_ignored_with_a_warning(tmp_path: Path) -> None:
    t = tier(tmp_path, 8)
    store(t, 0, 1, 2)
    t.checkpoint()
    store(t, 3)
    t.close()
    ckpt = t.dir / "index.ckpt"
    data = bytearray(ckpt.read_bytes())
    data[-1] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="index.ckpt is damaged: ignored"):
        t2 = tier(tmp_path, 8)
    assert resident(t2, 4) == [3]  # the journal since the checkpoint still counts
    t2.close()


def test_checkpoint_in_the_journal_format_is_still_read(tmp_path: Path) -> None:
    t = tier(tmp_path, 8)
    t.close()
    entries = b""
    for rec, i in ((5, 0), (2, 1)):
        body = struct.pack("<4sBxxxQ16sQQ", b"KVJ1", 1, rec, key_digest(K(i)), BLOCK, rec)
        entries += body + struct.pack("<I", zlib.crc32(body))
    (t.dir / "index.ckpt").write_bytes(entries + b"torn")
    t2 = tier(tmp_path, 8)
    assert t2.stats()["recovered"] == 2
    assert t2.index[key_digest(K(0))] == 5 and t2.index[key_digest(K(1))] == 2
    t2.close()


def test_a_journal_python_writes_is_what_the_native_index_reads(tmp_path: Path) -> None:
    # IndexJournal's file, entry by entry, is what the native replay reads
    # (both ends in csrc/core/disk/journal.cc, Python only appending bytes).
    j = IndexJournal(tmp_path, BLOCK, 8, sync=False)
    j.recover(_native.DiskIndex(8))  # nothing to recover: opens the journal
    for rec in range(4):
        j.append(JournalOp.PUT, rec, key_digest(K(rec)))
    j.append(JournalOp.DROP, 2, key_digest(K(2)))
    j.append(JournalOp.PUT, 5, key_digest(K(0)))  # the same digest in a later record
    assert j.flush()
    j.close()
    data = (tmp_path / "index.journal").read_bytes()
    assert len(data) == 6 * JOURNAL_ENTRY_BYTES
    other = journal_entry(JournalOp.PUT, 6, key_digest(K(6)), 2 * BLOCK, 7)  # other blocks
    ix = _native.DiskIndex(8)
    good, seq, applied = ix.replay_journal(data + other + b"torn", BLOCK)
    assert (good, seq, applied) == (len(data) + len(other), 7, 6)
    assert ix.rebuild() == 3
    states = [RecordState(ix.state(r)) for r in range(8)]
    ready, free = RecordState.READY, RecordState.FREE
    assert states == [free, ready, free, ready, free, ready, free, free]
    assert ix[key_digest(K(0))] == 5 and ix.holds(3, key_digest(K(3)))
    # The index keeps bytes 0-7 and 12-13 of a digest (its table the 2).
    d = key_digest(K(3))
    assert ix.digest(3) == d[:8] + bytes(4) + d[12:14] + bytes(2)
    assert not ix.holds(3, key_digest(K(1))) and not ix.holds(2, d)


def test_journal_entries_keep_the_bytes_of_the_documented_layout() -> None:
    # KVJ3 (csrc/core/disk/journal.h): the record is 32-bit, a PUT names the
    # record before it in its chain and 16 bits of that block's digest
    # (bytes 2-3 of it, DiskIndex.fingerprint), and a crc32c ends it.
    layout = struct.Struct("<4sBBHII16sQQ8s")
    parent = key_digest(K(4))
    fp = int.from_bytes(parent[2:4], "little") or 1
    named = layout.pack(b"KVJ3", 1, E(5)[11], fp, 5, 4, key_digest(K(5)), BLOCK, 7, E(5)[:8])
    unnamed = layout.pack(b"KVJ3", 2, 63, 0, 1, 2**32 - 1, key_digest(K(1)), BLOCK, 9, bytes(8))
    for body, entry in (
        (named, journal_entry(JournalOp.PUT, 5, key_digest(K(5)), BLOCK, 7, E(5), (4, parent))),
        (unnamed, journal_entry(JournalOp.DROP, 1, key_digest(K(1)), BLOCK, 9)),
    ):
        assert entry == body + struct.pack("<I", crc32c(body))
        assert len(entry) == JOURNAL_ENTRY_BYTES


def test_journal_entries_refuse_bad_input() -> None:
    with pytest.raises(kvtier.InvalidArgument, match="a key digest is 16 bytes, got 3"):
        journal_entry(JournalOp.PUT, 0, b"abc", BLOCK, 1)
    with pytest.raises(kvtier.InvalidArgument, match="an event id is 12 bytes, got 8"):
        journal_entry(JournalOp.PUT, 0, key_digest(K(0)), BLOCK, 1, bytes(8))
    with pytest.raises(kvtier.InvalidArgument, match=r"op is 1 \(put\) or 2 \(drop\), got 3"):
        journal_entry(3, 0, key_digest(K(0)), BLOCK, 1)


def test_record_states_are_the_native_index_states() -> None:
    ix = _native.DiskIndex(4)
    assert ix.state(0) == RecordState.FREE
    ix.insert(b"x" * 16, 0)
    assert ix.state(0) == RecordState.WRITING
    ix.set_ready(0)
    assert ix.state(0) == RecordState.READY
    ix.remove(0, hold=True)
    assert ix.state(0) == RecordState.HELD
    ix.release(0)
    assert ix.state(0) == RecordState.FREE
    assert [s.value for s in RecordState] == [0, 1, 2, 3]


def test_native_index_rejects_bad_input() -> None:
    ix = _native.DiskIndex(4, "clock", 2)
    with pytest.raises(kvtier.InvalidArgument, match="a key digest is 16 bytes, got 3"):
        ix.claim(b"abc")
    with pytest.raises(kvtier.InvalidArgument, match=r"record 4 out of range \[0, 4\)"):
        ix.touch(4)
    with pytest.raises(kvtier.InvalidArgument, match="policy must be lru, clock or plfu"):
        _native.DiskIndex(4, "arc")
    with pytest.raises(kvtier.InvalidArgument, match="num_records must be"):
        _native.DiskIndex(0)
    ix[b"x" * 16] = 1
    with pytest.raises(kvtier.InvalidArgument, match="digest already present"):
        ix[b"x" * 16] = 2
    with pytest.raises(KeyError):
        ix[b"y" * 16]
    assert ix.get(b"y" * 16) is None and len(ix) == 1
    ready = ix.ready_fn()  # lookup's fast path: the same answers and errors
    assert ready(b"x" * 16) is True and ready(b"y" * 16) is False
    with pytest.raises(kvtier.InvalidArgument, match="a key digest is 16 bytes, got 3"):
        ready(b"abc")
    del ix
    assert ready(b"x" * 16) is True  # it keeps its index alive


def test_bench_disk_index_writes_json_only_where_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli import main

    out = tmp_path / "sub" / "r.json"
    assert (
        main(["bench", "disk-index", "--records", "3000", "--policy", "clock", "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "restart from checkpoint" in text and f"wrote {out}" in text
    r = json.loads(out.read_text())
    assert r["records"] == 3000 and r["policy"] == "clock"
    assert r["checkpoint_bytes"] == 48 + 29 * 3000  # header, then 29 bytes per record
    assert r["journal_bytes"] == 60 * 3000
    assert r["restart_checkpoint_per_s"] > 0 and r["store_per_s"] > 0
    assert list(tmp_path.iterdir()) == [tmp_path / "sub"]


def test_event_ids_of_vllm_keys_are_their_int_block_hashes() -> None:
    key = bytes(range(100, 132)) + (5).to_bytes(4, "big")
    name = vllm_event_id(key)
    # What vLLM publishes for the key's block hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
    assert int.from_bytes(name[:8], "big") == int.from_bytes(key[:-4], "big") & (2**64 - 1)
    assert name[8:] == key[-4:]
    other = vllm_event_id(b"key-00000001")  # not vLLM's shape: 8 bytes of a hash, group 0
    assert len(other) == 12 and other[8:] == bytes(4)
    assert vllm_event_id(bytes(32) + (63).to_bytes(4, "big"))[8:] == bytes(4)  # group too large


def test_every_eviction_of_a_restarted_tier_is_named(tmp_path: Path) -> None:
    # Records from the checkpoint, from the journal, and stored since: each
    # eviction names its block by event id, and a reset names what it drops.
    t = tier(tmp_path, 4, "clock")
    keys = [V(i, i % 2) for i in range(6)]
    assert t.submit_store(keys[:2], [0, 1]) is not None and t.poll()[0].ok
    t.checkpoint()
    assert t.submit_store(keys[2:4], [0, 1]) is not None and t.poll()[0].ok
    t.close()
    t2 = tier(tmp_path, 4, "clock")
    assert t2.stats()["recovered"] == 4
    assert t2.submit_store(keys[4:], [0, 1]) is not None and t2.poll()[0].ok
    removed, stored = t2.take_events()
    assert removed.ids == [vllm_event_id(k) for k in keys[:2]] == [k[-12:] for k in keys[:2]]
    assert stored.keys == keys[4:]
    t2.reset()
    (gone,) = t2.take_events()
    assert gone.removed and sorted(gone.ids) == sorted(k[-12:] for k in keys[2:])
    assert t2.stats()["unnamed_removals"] == 0
    t2.close()


def test_files_of_the_earlier_formats_are_read_unnamed(tmp_path: Path) -> None:
    # A KVC2 checkpoint and KVJ1 journal entries (no event ids): the records
    # are recovered, and their evictions counted as unnamed.
    t = tier(tmp_path, 2)
    t.close()
    recs = np.array([0], np.uint32)
    body = recs.tobytes() + key_digest(K(0))
    head = struct.pack("<4sIQQQQI4x", b"KVC2", 1, BLOCK, 2, 1, 1, zlib.crc32(body))
    (t.dir / "index.ckpt").write_bytes(head + body)
    entry = struct.pack("<4sBxxxQ16sQQ", b"KVJ1", 1, 1, key_digest(K(1)), BLOCK, 2)
    new = journal_entry(JournalOp.PUT, 1, key_digest(K(1)), BLOCK, 3, E(1))
    (t.dir / "index.journal").write_bytes(entry + struct.pack("<I", zlib.crc32(entry)) + new)
    t2 = tier(tmp_path, 2)
    assert t2.stats()["recovered"] == 2
    store(t2, 2, 3)
    (removed, _) = t2.take_events()
    assert removed.ids == [E(1)]  # the KVJ2 entry after the KVJ1 one named record 1
    assert t2.stats()["unnamed_removals"] == 1 and t2.stats()["evictions"] == 2
    t2.close()


def test_native_index_checks_event_ids() -> None:
    ix = _native.DiskIndex(2)
    with pytest.raises(kvtier.InvalidArgument, match="an event id is 12 bytes, got 3"):
        ix.claim(b"x" * 16, b"abc")
    with pytest.raises(kvtier.InvalidArgument, match="group must be below 63, got 63"):
        ix.claim(b"x" * 16, bytes(8) + (63).to_bytes(4, "big"))
    assert len(ix) == 0  # refused: nothing claimed
    assert ix.claim(b"x" * 16, V(7)[-12:]) == (0, None)
    assert ix.event_id(0) == V(7)[-12:]
    assert ix.claim(b"y" * 16) == (1, None)
    assert ix.event_id(1) is None
