"""Hostile input at the public entry points, fuzzed with hypothesis: size and
duration strings, remote URLs, the vLLM shim's ``kv_connector_extra_config``,
trace files, CLI options, and the disk tier's own files handed to us damaged,
truncated, from another version or made of random bytes.

Every input either works or raises a KvtierError subclass (argparse's usage
error, exit code 2, for the CLI): never another exception, never a traceback.
Examples are bounded so the whole file runs in a few seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import finish
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvtier.errors import InvalidArgument, IoError, KvtierError
from kvtier.tiers import LookupResult
from kvtier.units import FreeFraction, parse_capacity, parse_duration, parse_size, to_bytes

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

size_text = st.one_of(
    st.text(max_size=20),
    st.from_regex(r"\A[ +-]?[0-9]{0,400}(\.[0-9]{0,5})?(e[+-]?[0-9]{1,4})?\s*[a-zA-Z%]{0,4}\Z"),
)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


# -- sizes and durations ------------------------------------------------------
@FAST
@given(size_text)
@example("1e999")
@example("9" * 400)
@example("-0")
@example("nan")
@example("inf")
@example("1.5.5GiB")
def test_size_strings(text: str) -> None:
    try:
        n = parse_size(text)
    except InvalidArgument as e:
        assert repr(text) in str(e) or "size" in str(e)
    else:
        assert isinstance(n, int) and n > 0
    try:
        c = parse_capacity(text)
    except InvalidArgument:
        pass
    else:
        assert (isinstance(c, int) and c > 0) or (
            isinstance(c, FreeFraction) and 0 < c.fraction <= 1
        )
    try:
        d = parse_duration(text)
    except InvalidArgument:
        pass
    else:
        assert math.isfinite(d) and d > 0


@FAST
@given(st.integers(1, 1 << 50), st.sampled_from(["", "b", "KiB", "MiB", "GiB", "k", "M"]))
def test_sizes_people_write(n: int, unit: str) -> None:
    mult = {"": 1, "b": 1, "KiB": 1024, "k": 1024, "MiB": 1 << 20, "M": 1 << 20, "GiB": 1 << 30}
    assert parse_size(f"{n}{unit}") == n * mult[unit]
    assert parse_size(f" {n} {unit} ") == n * mult[unit]


@FAST
@given(json_value)
def test_to_bytes_any_value(value: Any) -> None:
    try:
        n = to_bytes("kvtier_host_bytes", value)
    except InvalidArgument as e:
        assert "kvtier_host_bytes" in str(e) or "size" in str(e)
    else:
        assert isinstance(n, int) and n > 0


@FAST
@given(st.text(max_size=12))
@example("150%")
@example("nan%")
@example("0%")
@example("%")
def test_capacity_percent(text: str) -> None:
    try:
        c = parse_capacity(text + "%")
    except InvalidArgument:
        return
    assert isinstance(c, FreeFraction) and 0 < c.fraction <= 1


# -- remote URLs --------------------------------------------------------------
@FAST
@given(
    st.one_of(
        st.text(max_size=40),
        st.builds(
            lambda s, rest: f"{s}://{rest}",
            st.sampled_from(["redis", "redis-cluster", "http", "rediss", ""]),
            st.text(alphabet="ab:@[],/%0123456789.-x ", max_size=30),
        ),
    )
)
@example("redis://[::1")
@example("redis://host:99999")
@example("redis://host:-1")
@example("redis://host:0")
@example("redis://host:6379/-2")
@example("redis-cluster://a:1,,b:2")
@example("redis://:@")
def test_remote_urls(url: str) -> None:
    from kvtier.tiers.remote import parse_url

    try:
        cfg = parse_url(url)
    except InvalidArgument as e:
        assert "URL" in str(e)
        return
    assert cfg["seeds"] and all(h and 0 < p < 65536 for h, p in cfg["seeds"])
    assert cfg["db"] >= 0


# -- the vLLM shim's kv_connector_extra_config --------------------------------
def _shim() -> Any:
    pytest.importorskip("vllm", reason="the shim's module imports vLLM's light base modules")
    import kvtier.integrations.vllm as shim

    return shim


@FAST
@given(
    st.one_of(
        st.dictionaries(
            st.one_of(
                st.sampled_from(
                    [
                        "kvtier_host_bytes",
                        "kvtier_disk_bytes",
                        "kvtier_disk_path",
                        "kvtier_admit_after",
                        "kvtier_disk_timeout_s",
                        "kvtier_remote_url",
                        "kvtier_num_slots",
                        "kvtier_disk_reserve",
                        "kvtier_policy",
                        "spec_name",
                        "kvtier_nope",
                        "block_size",
                    ]
                ),
                st.text(max_size=10),
                st.integers(),
                st.none(),
            ),
            json_value,
            max_size=6,
        ),
        json_value,
    )
)
@example({"kvtier_host_bytes": "64GiB", "kvtier_disk_bytes": "80%"})
@example({1: 2})
@example("kvtier_host_bytes")
@example({"kvtier_admit_after": -3})
@example({"kvtier_disk_timeout_s": float("nan")})
def test_extra_config(extra: Any) -> None:
    shim = _shim()
    try:
        out = shim.parse_extra_config(extra)
    except InvalidArgument as e:
        assert "kv_connector_extra_config" in str(e) or "kvtier_" in str(e)
        return
    assert all(k.startswith("kvtier_") for k in out.given)
    # 0 is "none" (SGLang's memory tier); the vLLM spec refuses it as too small.
    assert out.host.bytes is None or (isinstance(out.host.bytes, int) and out.host.bytes >= 0)
    if out.disk is not None and out.disk.reserve_bytes is not None:
        assert isinstance(out.disk.reserve_bytes, int) and out.disk.reserve_bytes > 0


# -- trace files ----------------------------------------------------------------
@contextlib.contextmanager
def _file(data: bytes) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "trace.jsonl"
        p.write_bytes(data)
        yield p


trace_line = st.one_of(
    st.builds(lambda ids: json.dumps({"hash_ids": ids}), st.lists(st.integers(), max_size=5)),
    st.builds(lambda v: json.dumps({"hash_ids": v}), json_value),
    st.builds(json.dumps, json_value),
    st.text(max_size=30),
    st.just("[" * 100_000),
)


@FAST
@given(st.one_of(st.binary(max_size=200), st.lists(trace_line, max_size=5).map(
    lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass"))))  # fmt: skip
@example(b"")
@example(b"\xff\xfe\x00garbage\n")
@example(b'{"hash_ids": [18446744073709551616]}\n')
@example(b'{"hash_ids": [-1]}\n')
@example(b'{"hash_ids": [true]}\n')
@example(b'{"hash_ids": [1, 2]}\n{"hash_ids": ')
def test_trace_reader(data: bytes) -> None:
    from kvtier.replay import key_of, read_trace

    with _file(data) as p:
        try:
            trace = read_trace(p)
        except InvalidArgument as e:
            assert str(p) in str(e)
            return
    for ids in trace:
        for h in ids:
            assert type(h) is int and 0 <= h < 1 << 63
            key_of(h)


def test_trace_reader_refuses_what_is_not_a_readable_file(tmp_path: Path) -> None:
    from kvtier.replay import read_trace

    with pytest.raises(InvalidArgument, match="trace file not found"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(InvalidArgument, match="is a directory"):
        read_trace(tmp_path)
    p = tmp_path / "secret.jsonl"
    p.write_text('{"hash_ids": [1]}\n')
    p.chmod(0)
    if os.geteuid() != 0:  # root reads it anyway
        with pytest.raises(IoError, match="cannot read trace"):
            read_trace(p)


# -- CLI options ----------------------------------------------------------------
def _run_cli(argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` -> (exit code, stderr), failing the test on any
    exception other than argparse's exit."""
    from kvtier.cli import main

    err = io.StringIO()
    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: usage error (2) or --help (0)
            code = int(e.code or 0)
    text = err.getvalue()
    assert "Traceback" not in text
    return code, text


def _assert_clean(code: int, err: str) -> None:
    if code == 0:
        return
    assert code == 2, err
    lines = err.strip().splitlines()
    if lines and lines[0].startswith("kvtier: error:"):
        assert len(lines) == 1, err  # one line, no traceback
    else:
        assert lines and lines[0].startswith("usage:") and "error:" in lines[-1], err


opt_text = st.one_of(size_text, st.sampled_from(["", "-1", "0", "1e999", "abc", "1,2,,3", "nan"]))


@FAST
@given(
    layers=opt_text, kv=opt_text, partition=opt_text, tokens=opt_text, dtype=opt_text,
    stages=opt_text, host=opt_text,
)  # fmt: skip
@example(layers="4", kv="1GiB", partition="a,b", tokens="16", dtype="bf16", stages="", host="")
def test_cli_plan(
    layers: str, kv: str, partition: str, tokens: str, dtype: str, stages: str, host: str
) -> None:
    argv = ["plan", "--layers", layers, "--kv-heads", "8", "--head-dim", "128",
            "--kv-memory", kv, "--block-tokens", tokens, "--dtype", dtype]  # fmt: skip
    argv += ["--partition", partition] if partition else ["--stages", stages or "0"]
    if host:
        argv += ["--host-memory", host]
    _assert_clean(*_run_cli([a if a.strip() else "x" for a in argv]))


def _mostly(*good: str) -> st.SearchStrategy[str]:
    """Usually a value that works (so later checks run), sometimes anything."""
    return st.one_of(st.sampled_from(good), st.sampled_from(good), opt_text)


@SLOW
@given(
    block=_mostly("4KiB", "64KiB", "16", "17"), host=_mostly("1MiB", "inf", "4KiB"),
    disk=_mostly("1MiB", "50%", "100%", "0%", "1KiB"), seed=st.integers(-5, 5),
    admit=st.integers(-2, 3), policy=st.sampled_from(["lru", "arc", "nope", "x.y.Z", ""]),
    maxreq=st.integers(-3, 3),
)  # fmt: skip
@example(block="4KiB", host="1MiB", disk="50%", seed=0, admit=1, policy="lru", maxreq=2)
def test_cli_replay(
    block: str, host: str, disk: str, seed: int, admit: int, policy: str, maxreq: int
) -> None:
    with tempfile.TemporaryDirectory() as d:
        argv = ["replay", "--no-data", "--no-progress", "--synthetic-requests", "3",
                "--max-requests", str(maxreq), "--block-bytes", block or "x", "--host",
                host or "x", "--seed", str(seed), "--admit-after", str(admit),
                "--policy", policy or "x", "--disk", f"{d}/disk:{disk}"]  # fmt: skip
        _assert_clean(*_run_cli(argv))


@FAST
@given(block=opt_text, total=opt_text, qd=st.integers(-3, 5000))
def test_cli_bench_options(block: str, total: str, qd: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        # A --dir that does not exist: whatever the sizes, nothing is measured.
        argv = ["bench", "disk", "--dir", f"{d}/missing", "--block-bytes", block or "x",
                "--total", total or "x", "--queue-depth", str(qd), "--out", ""]  # fmt: skip
        code, err = _run_cli(argv)
        _assert_clean(code, err)
        assert code == 2 and os.listdir(d) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "nope"],
        ["replay", "--host", "2GiB", "--host-blocks", "3"],
        ["replay", "--max-requests", "many"],
        ["plan", "--layers", "4"],
        ["doctor", "--bogus"],
        [],
    ],
)
def test_cli_usage_errors(argv: list[str]) -> None:
    code, err = _run_cli(argv)
    assert code == 2 and err.startswith("usage:")


# -- the disk tier's own files, handed to us ----------------------------------
_J = struct.Struct("<4sBxxxQ16sQQI")
BLOCK = 4096


def _entry(magic: bytes, op: int, rec: int, dig: bytes, length: int, seq: int) -> bytes:
    body = _J.pack(magic, op, rec, dig, length, seq, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


u64 = st.integers(0, (1 << 64) - 1)
entry = st.builds(
    _entry,
    st.sampled_from([b"KVJ1", b"KVJ0", b"KVJ2", b"\0\0\0\0"]),
    st.sampled_from([1, 2, 0, 255]),
    st.one_of(st.integers(0, 10), u64),
    st.binary(min_size=16, max_size=16),
    st.sampled_from([BLOCK, BLOCK * 2, 0, (1 << 64) - 1]),
    u64,
)
index_file = st.one_of(
    st.binary(max_size=300),
    st.lists(entry, max_size=8).map(b"".join),
    st.tuples(st.lists(entry, max_size=8), st.integers(0, 60)).map(
        lambda t: b"".join(t[0])[: max(0, len(b"".join(t[0])) - t[1])]  # truncated
    ),
)


@FAST
@given(journal=index_file, ckpt=index_file, lock=st.binary(max_size=40))
@example(journal=_entry(b"KVJ1", 1, 0, b"\1" * 16, BLOCK, (1 << 64) - 1), ckpt=b"", lock=b"1\n")
def test_index_files_from_elsewhere(journal: bytes, ckpt: bytes, lock: bytes) -> None:
    from kvtier.tiers.disk import DiskTier

    with tempfile.TemporaryDirectory() as d:
        t0 = DiskTier(d, 8 * 8192, BLOCK, no_data=True)
        t0.close()
        (t0.dir / "index.journal").write_bytes(journal)
        (t0.dir / "index.ckpt").write_bytes(ckpt)
        (t0.dir / "owner.lock").write_bytes(lock)  # a dead owner's, or garbage
        t = DiskTier(d, 8 * 8192, BLOCK, no_data=True)
        assert 0 <= t.stats()["recovered"] <= t.num_records
        assert len(t.index) == t.stats()["recovered"]
        assert all(0 <= r < t.num_records for r in t.index.values())
        # The tier keeps working: a store is journaled after whatever was there.
        assert t.submit_store([b"k"], [0]) is not None
        t.poll()
        t.close()
        # Whatever came before it (entries of either format, a torn tail),
        # the new entry was appended where a restart reads it.
        t2 = DiskTier(d, 8 * 8192, BLOCK, no_data=True)
        assert t2.lookup(b"k") is LookupResult.HIT
        t2.close()


@SLOW
@given(data=st.binary(min_size=1, max_size=4096), offset=st.integers(0, 8 * 8192))
def test_slab_bytes_from_elsewhere_are_never_served(data: bytes, offset: int) -> None:
    """A slab overwritten by someone else (random bytes at a random place,
    or truncated): every load either returns the bytes stored or fails
    verification; nothing else reaches the caller."""
    from kvtier.pool import HostPool
    from kvtier.tiers.disk import DiskTier, record_bytes

    slot = record_bytes(BLOCK)
    with tempfile.TemporaryDirectory() as d, HostPool(8, slot) as p:
        t = DiskTier(d, 8 * slot, BLOCK, backend="pread")
        t.attach(p)
        keys = [b"key-%d" % i for i in range(4)]
        for i in range(4):
            p.view(i)[:BLOCK] = i + 1
        finish(t, t.submit_store(keys, [0, 1, 2, 3]))
        t.close()
        with open(t.paths[0], "r+b") as f:
            f.seek(offset)
            f.write(data)
            if data[0] % 4 == 0:
                f.truncate(offset)
        t = DiskTier(d, 8 * slot, BLOCK, backend="pread")
        t.attach(p)
        p.view(4, 4)[:] = 0
        oks = finish(t, t.submit_load(keys, [4, 5, 6, 7]))
        for i, ok in enumerate(oks):
            if ok:
                assert (p.view(4 + i)[:BLOCK] == i + 1).all()
        assert t.stats()["load_failures"] == oks.count(False)
        t.close()


@pytest.mark.parametrize("name", ["index.journal", "index.ckpt", "slab-000.dat", "owner.lock"])
def test_tier_files_that_are_directories(tmp_path: Path, name: str) -> None:
    from kvtier.tiers.disk import DiskTier

    t = DiskTier(tmp_path, 8 * 8192, BLOCK)
    t.close()
    target = t.dir / name
    with contextlib.suppress(FileNotFoundError):
        target.unlink()
    target.mkdir()
    before = sorted(p.name for p in t.dir.iterdir())
    with pytest.raises(KvtierError, match=name):
        DiskTier(tmp_path, 8 * 8192, BLOCK)
    assert sorted(p.name for p in t.dir.iterdir()) == before  # left as it was found


def test_cli_output_path_that_cannot_be_written() -> None:
    code, err = _run_cli(["replay", "--no-data", "--no-progress", "--max-requests", "1",
                          "--json", "/proc/kvtier-nope/out.json"])  # fmt: skip
    _assert_clean(code, err)
    assert code == 2 and err.startswith("kvtier: error: ") and "cannot write /proc/" in err
