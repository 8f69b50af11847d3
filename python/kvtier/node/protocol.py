"""The node's wire protocol: length-prefixed msgpack frames over a Unix socket.

Any process. Who calls: the node (:mod:`kvtier.node.server`) and its
clients (:mod:`kvtier.node.client`). Pure functions and constants; nothing blocks.

A frame is a 4-byte little-endian length, then that many bytes of one
msgpack array. A request is ``[op, *args]`` (``op`` a small int of
:class:`Op`); a reply is ``[True, result]`` or ``[False, kind, message]``.
One request per manager call: a lookup carries the request's keys from the
one asked about on (the node answers up to the first MISS), a store or a
load all of its keys.

msgpack (a C extension) rather than a hand-written codec: it bounds every
length it decodes (``max_*_len`` below), so garbage from a peer is an
exception, never an allocation the size of a claimed length.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import Any

import msgpack

from kvtier._native import frame_ints_ok, frame_keys_ok, frame_reqs_ok
from kvtier.errors import InvalidArgument

# 2: STEP_END carries the requests finished since the last one and the
# slots of the blocks loaded through the shared index since (LOAD_SHARED,
# op 17, which named them by key, one frame per load, is gone). POOL's second
# argument (the engine a worker writes for) is optional: not a new version.
# 3: STORES, a flush's store begins and ends in one frame. A node speaks
# every version in VERSIONS (a version 2 engine never sends STORES).
VERSION = 3
VERSIONS = (2, 3)
HEADER = struct.Struct("<I")
# The largest frame either side accepts: a 128k-token prompt at 16 tokens a
# block is 8,192 keys of 36-40 bytes (about 0.4 MB with framing); 16 MiB
# leaves room for a status reply of many engines and refuses a peer that
# claims gigabytes.
MAX_FRAME = 16 << 20
MAX_KEYS = 1 << 17  # keys in one call
MAX_KEY_BYTES = 256


class Op(enum.IntEnum):
    """What a request asks; the node dispatches on it."""

    HELLO = 1
    LOOKUP = 2
    PREPARE_LOAD = 3
    COMPLETE_LOAD = 4
    LOAD_FAILED = 5
    TOUCH = 6
    PREPARE_STORE = 7
    COMPLETE_STORE = 8
    REQUEST_FINISHED = 9
    STEP_END = 10
    RESET = 11
    STATUS = 12
    POOL = 13
    LOAD_PINNED = 14
    CONTAINS = 15
    LOAD_PRESENT = 16
    STORE_BEGIN = 18
    STORES = 19


# Calls that change nothing the engine reads back: the client sends them
# without waiting for a reply (the node serves a connection's requests in
# order, so they take effect before the next one). Measured, kvtier bench
# manager --node at 16 keys a call: five round trips a cycle became three.
NO_REPLY = frozenset(
    {
        Op.COMPLETE_LOAD,
        Op.LOAD_FAILED,
        Op.TOUCH,
        Op.COMPLETE_STORE,
        Op.REQUEST_FINISHED,
        Op.LOAD_PINNED,
        Op.STORE_BEGIN,
        Op.STORES,
    }
)

# Lookup answers on the wire (kvtier.tiers.base.LookupResult by name).
ANSWERS = ("MISS", "HIT", "HIT_PENDING", "RETRY")


class ProtocolError(InvalidArgument):
    """A frame that is not a valid request or reply: the connection that sent
    it is closed (the node and its other clients go on)."""


def pack(obj: Any) -> bytes:
    """One frame holding ``obj`` (header included)."""
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise InvalidArgument(f"frame of {len(body)} bytes exceeds the limit of {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def packer() -> Callable[[Any], bytes]:
    """:func:`pack` over one reused msgpack Packer, for one connection's
    thread: ``packb`` makes a Packer a call, half of a 16-key frame's cost
    (0.9 us against 1.8, timeit)."""
    p = msgpack.Packer(use_bin_type=True)
    head = HEADER.pack

    def pack_frame(obj: Any) -> bytes:
        body: bytes = p.pack(obj)  # resets itself when packing fails
        if len(body) > MAX_FRAME:
            raise InvalidArgument(f"frame of {len(body)} bytes exceeds the limit of {MAX_FRAME}")
        return head(len(body)) + body

    return pack_frame


def unpack(body: bytes) -> Any:
    """The object of one frame's body; :class:`ProtocolError` when it is not
    exactly one msgpack value within the limits."""
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_FRAME,
            max_str_len=1 << 16,
            max_array_len=MAX_KEYS,
            max_map_len=1 << 12,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several types for bad input
        raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None


class FrameReader:
    """Frames out of a byte stream fed in arbitrary pieces (the node reads
    non-blocking sockets). ``feed`` returns the complete frames' bodies."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise ProtocolError(f"frame of {n} bytes exceeds the limit of {MAX_FRAME}")
            if len(self._buf) < HEADER.size + n:
                break
            out.append(bytes(self._buf[HEADER.size : HEADER.size + n]))
            del self._buf[: HEADER.size + n]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)


def keys_arg(v: Any) -> list[bytes]:
    """A request's list of keys, checked: bytes of at most MAX_KEY_BYTES each."""
    # One pass in C (csrc/bindings/frames.cc): three passes of map() over the
    # keys were 1.5 us a 16-key list, two per 16-key store at the node.
    if not frame_keys_ok(v, MAX_KEYS, MAX_KEY_BYTES):
        if not isinstance(v, list) or len(v) > MAX_KEYS:
            raise ProtocolError(f"keys must be a list of at most {MAX_KEYS} bytes values")
        raise ProtocolError(f"a key must be 1-{MAX_KEY_BYTES} bytes")
    return v


def int_list_arg(v: Any) -> list[int]:
    """A list of ints (slots) of at most MAX_KEYS items."""
    if not frame_ints_ok(v, MAX_KEYS):
        raise ProtocolError("expected a list of ints")
    return v


def req_arg(v: Any) -> str | int | None:
    """A request id as the engine names it (vLLM: a str)."""
    if v is None or type(v) is int or (isinstance(v, str) and len(v) <= 1024):
        return v
    raise ProtocolError("a request id must be a str, an int or None")


def reqs_arg(v: Any) -> list[str | int | None]:
    """A list of request ids (:func:`req_arg` each), at most MAX_KEYS."""
    if frame_reqs_ok(v, MAX_KEYS, 1024):  # one pass in C
        return v
    if not isinstance(v, list) or len(v) > MAX_KEYS:
        raise ProtocolError(f"request ids must be a list of at most {MAX_KEYS}")
    return [req_arg(r) for r in v]  # raises for the one that is not


def hello_args(args: list[Any]) -> tuple[str, Any, str, bool]:
    """HELLO's arguments checked: (namespace, payload_bytes as sent, engine,
    whether it takes KV events); ProtocolError for anything else. A fifth
    argument (later clients) says whether the engine takes KV events."""
    if len(args) not in (4, 5):
        raise ProtocolError(f"expected 4 or 5 arguments, got {len(args)}")
    version, namespace, payload_bytes, engine = args[:4]
    events = args[4] if len(args) == 5 else True
    if type(events) is not bool:
        raise ProtocolError("events must be a bool")
    if version not in VERSIONS or type(version) is not int:
        speaks = " or ".join(map(str, VERSIONS))
        raise ProtocolError(f"protocol version {version!r}, this node speaks {speaks}")
    if not isinstance(namespace, str) or len(namespace) != 32:
        raise ProtocolError("namespace must be 32 hex digits")
    try:
        bytes.fromhex(namespace)
    except ValueError:
        raise ProtocolError("namespace must be 32 hex digits") from None
    if not isinstance(engine, str) or len(engine) > 256:
        raise ProtocolError("engine must be a str")
    return namespace, payload_bytes, engine, events


def plain_keys(keys: list[Any]) -> list[bytes]:
    """``keys`` as plain bytes (bytearrays, subclasses copied), as a frame
    carries them; InvalidArgument for anything else. Who calls: the client,
    for an offer whose keys are not all ``bytes``."""
    for k in keys:
        if not isinstance(k, (bytes, bytearray)):
            raise InvalidArgument(f"keys must be bytes, got {type(k).__name__}")
    return [bytes(k) for k in keys]
