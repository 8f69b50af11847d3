"""The one error hierarchy of kvtier.

Every public entry point raises these (the native core's errors are translated
into them once, in ``csrc/bindings/``). Catch :class:`KvtierError` for all of
them; the standard-library bases let callers that know nothing of kvtier catch
``ValueError``, ``OSError`` or ``TimeoutError`` as usual.

Any process: defining and raising them never blocks. Who calls: every
kvtier module raises them; engines and users catch them.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of every error raised by kvtier."""


class InvalidArgument(KvtierError, ValueError):
    """Bad input at an API boundary: sizes, alignment, ranges, unknown names."""


class UnsupportedEngine(InvalidArgument):
    """The engine's configuration cannot consume offloaded KV correctly
    (its attention backend never computes a prompt on top of cached
    context): refused at start-up rather than serving wrong tokens."""


class IoError(KvtierError, OSError):
    """A system call failed; ``errno`` holds the error number."""


class NoSpace(IoError):
    """A file system lacks the space asked of it (errno ENOSPC): a disk tier
    larger than the free space, or a file system that filled up."""


class InUse(IoError):
    """Another process owns the resource (errno EBUSY): a disk tier directory
    held open by a live process."""


class TlsError(IoError):
    """A TLS connection failed: a certificate that does not verify (wrong CA,
    wrong name, expired), a client certificate refused, a CA, certificate or
    key file that cannot be loaded. The message names the server and
    OpenSSL's reason."""


class CudaError(KvtierError):
    """The CUDA runtime reported an error (or could not be loaded)."""


class Busy(KvtierError):
    """A queue is at its in-flight byte budget: back off and resubmit later."""


class ClosedError(KvtierError):
    """The object (pool, engine, tier, manager) was closed."""


class Timeout(KvtierError, TimeoutError):
    """A blocking wait ran past its timeout."""


__all__ = [
    "Busy",
    "ClosedError",
    "CudaError",
    "InUse",
    "InvalidArgument",
    "IoError",
    "KvtierError",
    "NoSpace",
    "Timeout",
    "TlsError",
    "UnsupportedEngine",
]
