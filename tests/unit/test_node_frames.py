"""The node's checks of a request's keys and slots (kvtier.node.protocol,
in C: csrc/bindings/frames.cc) and its namespacing of keys: each refuses
exactly what the protocol does not allow, with the protocol's error."""

from __future__ import annotations

from typing import Any

import pytest
from kvtier import _native
from kvtier.errors import InvalidArgument
from kvtier.node import protocol as P


@pytest.mark.parametrize(
    "value",
    [[], [b"k"], [b"x" * P.MAX_KEY_BYTES], [b"a", b"bc"] * 8, [b"k"] * P.MAX_KEYS],
)
def test_keys_within_the_limits_pass_as_they_are(value: list[bytes]) -> None:
    assert P.keys_arg(value) is value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((b"k",), "keys must be a list"),
        (b"k", "keys must be a list"),
        (None, "keys must be a list"),
        ([b"k"] * (P.MAX_KEYS + 1), "keys must be a list"),
        ([b"k", b""], "a key must be"),
        ([b"k", b"x" * (P.MAX_KEY_BYTES + 1)], "a key must be"),
        ([b"k", "k"], "a key must be"),
        ([b"k", bytearray(b"k")], "a key must be"),
        ([b"k", 7], "a key must be"),
        ([b"k", None], "a key must be"),
    ],
)
def test_keys_out_of_the_limits_are_a_protocol_error(value: Any, message: str) -> None:
    with pytest.raises(P.ProtocolError, match=message):
        P.keys_arg(value)


@pytest.mark.parametrize(
    "value",
    [(1, 2), [1, True], [1, 2.0], [1, None], [1, b"2"], [0] * (P.MAX_KEYS + 1), {1: 2}],
)
def test_slots_must_be_a_list_of_ints_not_bools(value: Any) -> None:
    with pytest.raises(P.ProtocolError, match="expected a list of ints"):
        P.int_list_arg(value)
    assert P.int_list_arg([]) == [] and P.int_list_arg([0, 5, 1 << 40]) == [0, 5, 1 << 40]


@pytest.mark.parametrize("value", [[], [None], ["r", 7, None], ["x" * 1024, -1, "é" * 1024]])
def test_request_ids_within_the_limits_pass_as_they_are(value: list[Any]) -> None:
    assert P.reqs_arg(value) is value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (("r",), "request ids must be a list"),
        ("r", "request ids must be a list"),
        ([None] * (P.MAX_KEYS + 1), "request ids must be a list"),
        (["r", True], "a request id must be"),
        (["r", 1.0], "a request id must be"),
        (["r", b"r"], "a request id must be"),
        (["r", "x" * 1025], "a request id must be"),
        (["r", ["r"]], "a request id must be"),
    ],
)
def test_request_ids_out_of_the_limits_are_a_protocol_error(value: Any, message: str) -> None:
    with pytest.raises(P.ProtocolError, match=message):
        P.reqs_arg(value)
    assert not _native.frame_reqs_ok(value, P.MAX_KEYS, 1024)


def test_prefixed_makes_each_namespaced_key_in_order() -> None:
    keys = [b"a", b"\x00" * 40, b"bc"]
    assert _native.prefixed(b"ns-12345", keys) == [b"ns-12345" + k for k in keys]
    assert _native.prefixed(b"", keys) == keys
    assert _native.prefixed(b"p", []) == []
    with pytest.raises(InvalidArgument, match="keys must be bytes"):
        _native.prefixed(b"p", [b"a", "b"])  # type: ignore[list-item]


def test_unprefixed_keeps_only_the_namespaces_keys_without_the_prefix() -> None:
    p = b"ns-12345"
    keys = [p + b"a", b"other-ns" + b"b", p, p + b"\x00" * 40, b"ns-1234", b""]
    assert _native.unprefixed(p, keys) == [b"a", b"", b"\x00" * 40]
    assert _native.unprefixed(b"", [b"a", b""]) == [b"a", b""]
    with pytest.raises(InvalidArgument, match="keys must be bytes"):
        _native.unprefixed(p, [p + b"a", 3])  # type: ignore[list-item]
