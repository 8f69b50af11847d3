"""Typed reader specs: what a lower tier hands an engine worker so that the
worker opens the medium itself. They cross a process boundary (scheduler ->
worker) inside the engine's metadata, so they must pickle, and each opens
its own reader."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
from kvtier.pool import HostPool
from kvtier.tiers.base import ReaderSpec
from kvtier.tiers.disk import DiskIO, DiskReaderSpec, DiskTier
from kvtier.tiers.remote import RemoteConnection
from kvtier.tiers.remote.worker import RemoteReaderSpec

BLOCK = 4096


def test_a_disk_spec_pickles_and_opens_a_reader_of_the_tiers_records(tmp_path: Path) -> None:
    rec = DiskTier.slot_bytes_for(BLOCK)
    pool = HostPool(2, rec)
    ring = HostPool(2, rec)
    disk = DiskTier(tmp_path, 8 * rec, BLOCK, backend="pread")
    try:
        disk.attach(pool)
        pool.view(0)[:BLOCK] = 7
        assert disk.submit_store([b"k"], [0]) is not None
        assert disk.wait([1], 10)
        assert [c.ok for c in disk.poll()] == [True]

        spec = disk.reader_spec()
        assert isinstance(spec, DiskReaderSpec) and isinstance(spec, ReaderSpec)
        back = pickle.loads(pickle.dumps(spec))
        assert back == spec and back is not spec
        with pytest.raises(dataclasses.FrozenInstanceError):
            back.block_bytes = 1  # type: ignore[misc]

        locs, digs = disk.pin_for_read([b"k"])
        io = back.open(ring)
        try:
            assert isinstance(io, DiskIO)
            jid = io.submit([1], locs, digs)
            io.engine.wait([jid], 10)
            (r,) = io.engine.poll()
            assert r.ok and list(r.items) in ([], [0])
            assert (ring.view(1)[:BLOCK] == 7).all()
        finally:
            io.close()
            disk.unpin_read(locs[:, 0].tolist())
    finally:
        disk.close()
        ring.close()
        pool.close()


def test_a_disk_tier_without_data_has_no_spec(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 8 * DiskTier.slot_bytes_for(BLOCK), BLOCK, no_data=True)
    assert disk.reader_spec() is None
    disk.close()


def test_a_remote_spec_pickles_with_named_fields_and_hides_the_password() -> None:
    conn = RemoteConnection(
        seeds=(("127.0.0.1", 6379),), cluster=False, user="u", password="secret", db=0,
        connect_timeout_ms=2000, io_timeout_ms=2000, pipeline=64, ttl_ms=0, lazy=True,
        ns=b"n" * 16, window_bytes=512 << 10, tls=False,
    )  # fmt: skip
    spec = RemoteReaderSpec(conn, BLOCK, b"kvt:0123:", 2.0)
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and back.connection.seeds == (("127.0.0.1", 6379),)
    assert "secret" not in repr(spec)
    assert isinstance(back, ReaderSpec)
