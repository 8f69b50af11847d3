"""Each option defined once (issue 50): every surface (vLLM's and SGLang's
extra config, the vLLM secondary tiers' arguments, ``kvtier replay``'s
flags, the reference page) is derived from ``kvtier.options``, and an option
given on one surface and not on another says why."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
from kvtier.errors import InvalidArgument
from kvtier.options import (
    DiskOptions,
    EngineOptions,
    HostOptions,
    RemoteOptions,
    SglangOptions,
    VllmOptions,
)
from kvtier.options.fields import SURFACES, Option, convert, options_of
from kvtier.options.surfaces import (
    add_tier_arguments,
    engine_keys,
    parse_engine_config,
    secondary_options,
    tier_options_from_args,
)
from kvtier.units import FreeFraction

PKG = Path(__file__).resolve().parents[2] / "python" / "kvtier"
TOOLS = ("cli.py", "replay.py")
CLASSES = (HostOptions, DiskOptions, RemoteOptions, EngineOptions, VllmOptions, SglangOptions)
# The surfaces an option of each class could be given on.
APPLICABLE = {
    HostOptions: {"vllm", "sglang", "cli"},  # a secondary tier has vLLM's host tier in front
    DiskOptions: set(SURFACES),
    RemoteOptions: set(SURFACES),
    EngineOptions: {"vllm", "sglang", "secondary", "cli"},
    VllmOptions: {"vllm"},
    SglangOptions: {"sglang"},
}
# One valid value per kind, as an engine's JSON would give it.
SAMPLE = {"str": "x", "int": 3, "bool": True, "seconds": 1.5, "milliseconds": 5,
          "bytes": "2MiB", "capacity": "80%", "rate": "1GiB", "entries": 16}  # fmt: skip


def _all() -> list[Option]:
    return [o for cls in CLASSES for o in options_of(cls)]


def _sample(o: Option) -> Any:
    if o.choices:
        return o.choices[-1]
    if o.name == "policy":
        return "lru"
    if o.name == "url":
        return "redis://127.0.0.1:1"
    return SAMPLE[o.kind]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_option_is_documented_and_its_defaults_construct(cls: type) -> None:
    cls()  # the defaults pass the class's own checks
    for o in options_of(cls):
        assert len(o.doc) > 10, o.name
        assert o.default == getattr(cls(), o.name)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_an_option_missing_from_a_surface_says_why(cls: type) -> None:
    for o in options_of(cls):
        missing = APPLICABLE[cls] - o.surfaces
        if cls in (EngineOptions,) and o.name == "namespace":
            missing -= {"secondary", "cli"}
        assert not missing or o.absent, f"{cls.__name__}.{o.name}: not on {missing}, no reason"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engine_key_tables_are_the_options_on_that_engine(engine: str) -> None:
    from importlib import util

    # The shims' tables, loaded by file: their packages import the engines.
    path = PKG / "integrations" / engine / "config.py"
    spec = util.spec_from_file_location(f"_cfg_{engine}", path)
    assert spec is not None and spec.loader is not None
    mod = util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    want = {o.key for o in _all() if engine in o.surfaces}
    assert set(mod.CONFIG_KEYS) == want == set(engine_keys(engine))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_engine_key_parses_into_its_option(engine: str) -> None:
    opts = [o for cls in (HostOptions, DiskOptions, RemoteOptions) for o in options_of(cls)]
    opts += options_of(VllmOptions if engine == "vllm" else SglangOptions)
    for o in (o for o in opts if engine in o.surfaces):
        extra = {"kvtier_disk_path": "/d", "kvtier_remote_url": "redis://h:1", o.key: _sample(o)}
        if o.name == "pool_index":  # needs the stream it reads
            extra["kvtier_pool_events"] = True
        cfg = parse_engine_config(extra, engine, "cfg")
        holder = {"HostOptions": cfg.host, "DiskOptions": cfg.disk, "RemoteOptions": cfg.remote}
        got = getattr(holder.get(o.owner, cfg.engine), o.name)
        assert got == convert(o, _sample(o), "x"), o.key
        assert o.key in cfg.given


def test_engine_config_errors_name_the_key() -> None:
    with pytest.raises(InvalidArgument, match="unknown cfg key 'kvtier_disk'; known: "):
        parse_engine_config({"kvtier_disk": "/x"}, "vllm", "cfg")
    with pytest.raises(InvalidArgument, match="kvtier_disk_queue_depth: expected int, got True"):
        parse_engine_config({"kvtier_disk_queue_depth": True}, "vllm", "cfg")
    with pytest.raises(InvalidArgument, match=r"cfg: kvtier_disk_timeout_s: must be > 0, got 0\.0"):
        parse_engine_config({"kvtier_disk_path": "/d", "kvtier_disk_timeout_s": 0}, "vllm", "cfg")
    with pytest.raises(InvalidArgument, match="kvtier_lower_writes: must be one of on_store, on_r"):
        parse_engine_config({"kvtier_lower_writes": "never"}, "vllm", "cfg")
    with pytest.raises(InvalidArgument, match="cfg keys must be strings"):
        parse_engine_config({1: 2}, "vllm", "cfg")
    # SGLang passes its own non-string keys; a kvtier_ key of vLLM's only is unknown there.
    assert parse_engine_config({1: 2}, "sglang", "cfg").disk is None
    with pytest.raises(InvalidArgument, match="unknown cfg key 'kvtier_promote'"):
        parse_engine_config({"kvtier_promote": True}, "sglang", "cfg")


def test_lower_writes_on_reuse_sets_both_lower_tiers_unless_given() -> None:
    base = {"kvtier_disk_path": "/d", "kvtier_remote_url": "redis://h:1"}
    cfg = parse_engine_config({**base, "kvtier_lower_writes": "on_reuse"}, "vllm", "c")
    assert cfg.disk is not None and cfg.remote is not None
    assert (cfg.disk.admit_after, cfg.remote.admit_after) == (2, 2)
    cfg = parse_engine_config(
        {**base, "kvtier_lower_writes": "on_reuse", "kvtier_disk_admit_after": 3}, "vllm", "c"
    )
    assert cfg.disk is not None and cfg.disk.admit_after == 3


@pytest.mark.parametrize("cls", [DiskOptions, RemoteOptions], ids=lambda c: c.__name__)
def test_the_secondary_tiers_take_exactly_their_options(cls: type) -> None:
    on = [o for o in options_of(cls) if "secondary" in o.surfaces]
    got = secondary_options(cls, {o.name: _sample(o) for o in on if o.name != "pool_index"}, "t")
    for o in on:
        if o.name != "pool_index":
            assert getattr(got, o.name) == convert(o, _sample(o), "x")
    internal = next(o.name for o in options_of(cls) if not o.surfaces)
    with pytest.raises(InvalidArgument, match=f"t: unknown argument\\(s\\) {internal}; known: "):
        secondary_options(cls, {internal: 1}, "t")
    # The shim's classes take vLLM's arguments, namespace, and the options as keywords.
    from importlib import util

    if util.find_spec("vllm") is None:
        return
    from kvtier.integrations.vllm.secondary import KVTierDiskTier, KVTierRedisTier

    shim = KVTierDiskTier if cls is DiskOptions else KVTierRedisTier
    params = inspect.signature(shim.__init__).parameters
    assert list(params)[-1] == "settings" and "namespace" in params


def _replay_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_tier_arguments(p)
    return p


def test_replay_flags_are_the_options_on_the_command_line() -> None:
    from kvtier.cli import build_parser

    sub = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["replay"]
    flags = {f for a in sub._actions for f in a.option_strings}
    for o in _all():
        if "cli" in o.surfaces and o.owner in ("HostOptions", "DiskOptions", "RemoteOptions"):
            assert set(o.flags) <= flags, o.name


def test_replay_flags_parse_into_the_options() -> None:
    args = _replay_parser().parse_args(
        ["--disk", "/d:80%", "--disk-policy", "clock:3", "--lower-admit-after", "2",
         "--remote", "rediss://h:1", "--remote-tls-ca", "/ca.pem", "--remote-ttl-s", "30",
         "--no-prefix-eviction", "--remote-pool-events", "0"]
    )  # fmt: skip
    host, disk, remote = tier_options_from_args(args)
    assert host == HostOptions(prefix_eviction=False)
    assert disk == DiskOptions("/d", FreeFraction(0.8), policy="clock:3", admit_after=2)
    assert remote == RemoteOptions(
        "rediss://h:1", tls_ca_file="/ca.pem", ttl_s=30.0, admit_after=2, pool_events=0
    )
    assert tier_options_from_args(_replay_parser().parse_args([]))[1:] == (None, None)
    with pytest.raises(InvalidArgument, match="--disk-queue-depth: expected a number, got 'x'"):
        tier_options_from_args(_replay_parser().parse_args(["--disk-queue-depth", "x"]))


def test_no_library_file_spells_an_engine_key() -> None:
    """A key is spelled once, in kvtier.options: no library module outside it
    holds one as a string (``extra.get("kvtier_disk_path")``); examples in
    docstrings and the tools, which write configs as users do, may."""
    keys = {*engine_keys("vllm"), *engine_keys("sglang")}
    offenders = []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        if rel.startswith(("options/", "bench/")) or rel in TOOLS:
            continue
        tree = ast.parse(p.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
        }  # fmt: skip
        offenders += [
            f"{rel}: {n.value}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in keys and id(n) not in docs
        ]
    assert offenders == []


def test_tls_settings_are_spelled_in_the_options_and_their_uses_only() -> None:
    """``tls_server_name`` was spelled in 10 files: now its declaration, the
    native client's argument order, and the tier's docstring."""
    files = sorted(
        str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "tls_server_name" in p.read_text()
    )
    assert files == ["options/tiers.py", "tiers/remote/tier.py", "tiers/remote/url.py"]


def test_options_are_frozen_and_replaceable() -> None:
    d = DiskOptions("/d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.path = "/e"  # type: ignore[misc]
    assert dataclasses.replace(d, policy="plfu").policy == "plfu"
    with pytest.raises(InvalidArgument, match="disk tier policy must be lru, clock"):
        dataclasses.replace(d, policy="fifo")
