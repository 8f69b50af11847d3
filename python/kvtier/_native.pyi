# Type stub of the compiled core, kept by hand beside csrc/bindings/ (one
# section per binding file); mypy checks every call into the core against it.
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

# codes.cc (csrc/core/codes.h)
class StatusCode(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    IO_ERROR = 2
    BUSY = 3
    CUDA = 4
    CLOSED = 5
    TIMEOUT = 6
    CANCELLED = 7
    INTERNAL = 8
    TLS = 9

class ItemStatus(enum.IntEnum):
    OK = 0
    BUSY = 16
    NO_SPACE = 28
    TIMED_OUT = 110
    CANCELLED = 125
    BAD_TRAILER = -1
    WRONG_KEY = -2
    BAD_CHECKSUM = -3
    SHORT_READ = -4
    MISSING = -5
    BAD_LENGTH = -6
    SERVER_ERROR = -7

def item_error(code: int) -> str: ...

# pool.cc
class HostPool:
    # read-only: Final marks them so in a stub
    name: Final[str]
    num_slots: Final[int]
    slot_bytes: Final[int]
    owner: Final[bool]
    @staticmethod
    def create(
        num_slots: int, slot_bytes: int, name: str = "", mlock: bool = False, prefault: bool = True
    ) -> HostPool: ...
    @staticmethod
    def attach(name: str) -> HostPool: ...
    @staticmethod
    def reap_stale() -> int: ...
    locked: Final[bool]
    closed: Final[bool]
    address: Final[int]
    def slot_address(self, index: int) -> int: ...
    def array(self, first: int, count: int) -> npt.NDArray[np.uint8]: ...
    fence_address: Final[int]
    fence_bytes: Final[int]
    def arm_fences(self, slots: Sequence[int]) -> list[int]: ...
    def settle_fence(self, slot: int, armed: int, ok: bool) -> bool: ...
    def fence_word(self, slot: int) -> int: ...
    def close(self) -> None: ...

# engine.cc
class JobResult:
    # read-only fields of the completion record
    job_id: Final[int]
    ok: Final[bool]
    error: Final[str]
    nbytes: Final[int]
    seconds: Final[float]
    def __iter__(self) -> Iterator[int | bool | str | float]: ...
    items: Final[list[int]]
    timed_out: Final[bool]
    held: Final[bool]
    released: Final[bool]

class Engine:
    def __init__(
        self,
        num_threads: int,
        queues: Sequence[tuple[int, bool] | tuple[int, bool, float]],
        nice: int = 0,
    ) -> None: ...
    def submit_sleep(
        self, seconds: float, nbytes: int = 0, fail: str = "", queue: int = 0
    ) -> int: ...
    def poll(self) -> list[JobResult]: ...
    def wait(self, job_ids: Sequence[int], timeout: float = -1.0) -> None: ...
    def close(self, cancel: bool = False) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def num_threads(self) -> int: ...
    @property
    def nice(self) -> int: ...
    def in_flight_bytes(self, queue: int = 0) -> int: ...
    def register_region(self, address: int, nbytes: int) -> None: ...
    def unregister_region(self, address: int) -> None: ...
    # copy.cc
    def submit_copy(
        self,
        descs: npt.NDArray[np.int64],
        queue: int = 0,
        fences: npt.NDArray[np.int64] | None = None,
        fence_timeout_s: float = 30.0,
    ) -> int: ...
    def copy_inline(self, descs: npt.NDArray[np.int64]) -> None: ...
    def submit_cuda(
        self,
        copier: CudaCopier,
        direction: int,
        descs: npt.NDArray[np.int64],
        wait_stream: int = 0,
        deps: Sequence[int] = ...,
        queue: int = 0,
        fences: npt.NDArray[np.int64] | None = None,
        fence_timeout_s: float = 30.0,
    ) -> int: ...
    # disk.cc
    def submit_disk(
        self,
        store: DiskStore,
        write: bool,
        records: npt.NDArray[np.int64],
        keys: npt.NDArray[np.uint8],
        queue: int = 0,
        fences: npt.NDArray[np.int64] | None = None,
    ) -> int: ...
    def submit_disk_range(
        self,
        store: DiskStore,
        records: npt.NDArray[np.int64],
        keys: npt.NDArray[np.uint8],
        lo: int,
        hi: int,
        queue: int = 0,
    ) -> int: ...
    # remote.cc
    def submit_remote(
        self,
        store: RemoteStore,
        kind: str,
        keys: Sequence[bytes],
        slots: npt.NDArray[np.int64],
        payload_len: int,
        digests: npt.NDArray[np.uint8],
        queue: int = 0,
        fences: npt.NDArray[np.int64] | None = None,
        commands: Sequence[Sequence[bytes]] | None = None,
    ) -> int: ...

# copy.cc
def cuda_runtime(search: Sequence[str] = ()) -> tuple[str, int, bool, str]: ...
def cuda_devices() -> dict[str, Any]: ...

class CudaCopier:
    def __init__(
        self,
        device: int,
        host_regions: Sequence[tuple[int, int]],
        device_regions: Sequence[tuple[int, int]],
        use_batch: bool = True,
    ) -> None: ...
    def stats(self) -> dict[str, int]: ...
    @property
    def runtime_path(self) -> str: ...
    @property
    def runtime_version(self) -> int: ...
    @property
    def device(self) -> int: ...

# disk.cc
class DiskStore:
    def __init__(
        self,
        paths: Sequence[str],
        file_bytes: int,
        backend: str = "auto",
        queue_depth: int = 32,
        max_io_bytes: int = 1048576,
        direct: bool = True,
        sync: bool = False,
        ns: bytes = ...,
        buffers: Sequence[tuple[int, int]] = ...,
        trailer_in_slot: bool = True,
    ) -> None: ...
    @property
    def backend(self) -> str: ...
    @property
    def direct(self) -> bool: ...
    @property
    def note(self) -> str: ...

DISK_TRAILER_BYTES: Final[int]

def disk_record_bytes(payload_len: int) -> int: ...
def disk_journal_entry(
    op: int,
    record: int,
    digest: bytes,
    block_bytes: int,
    seq: int,
    event_id: bytes | None = None,
) -> bytes: ...

DISK_JOURNAL_ENTRY_BYTES: Final[int]
DISK_JOURNAL_MAGIC: Final[bytes]
DISK_CHECKPOINT_MAGIC: Final[bytes]
DISK_CHECKPOINT_HEAD_BYTES: Final[int]
DISK_CHECKPOINT_ENTRY_BYTES: Final[int]
DISK_UNNAMED_GROUP: Final[int]

def uring_compiled_in() -> bool: ...

# disk_index.cc
class DiskIndex:
    """The disk tier's index: digest -> record, record state, LRU, CLOCK or PLFU."""

    def __init__(self, num_records: int, policy: str = "lru", clock_max: int = 1) -> None: ...
    @property
    def num_records(self) -> int: ...
    @staticmethod
    def policy_bytes_per_record(policy: str) -> int: ...
    @property
    def plfu(self) -> dict[str, float | int | list[float]] | None: ...
    @property
    def table_slots(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, digest: bytes) -> bool: ...
    def __getitem__(self, digest: bytes) -> int: ...
    def __setitem__(self, digest: bytes, record: int) -> None: ...
    def get(self, digest: bytes, default: int | None = None) -> int | None: ...
    def find(self, digest: bytes) -> int: ...
    def ready(self, digest: bytes) -> bool: ...
    def ready_fn(self) -> Callable[[bytes], bool]: ...
    def state(self, record: int) -> int: ...
    def digest(self, record: int) -> bytes: ...
    def loading(self, record: int) -> int: ...
    def event_id(self, record: int) -> bytes | None: ...
    def allocate(self) -> tuple[int, bytes | None]: ...
    def claim(self, digest: bytes, event_id: bytes | None = None) -> tuple[int, bytes | None]: ...
    def pin_ready(self, digest: bytes) -> int: ...
    def insert(
        self, digest: bytes, record: int, ready: bool = False, event_id: bytes | None = None
    ) -> None: ...
    def set_ready(self, record: int) -> None: ...
    def touch(self, record: int) -> None: ...
    def link(self, rec: int, parent: int) -> None: ...
    def children(self, rec: int) -> int: ...
    def pin(self, record: int) -> None: ...
    def unpin(self, record: int) -> None: ...
    def remove(self, record: int, hold: bool = False) -> None: ...
    def release(self, record: int) -> None: ...
    def values(self) -> list[int]: ...
    def loading_counts(self) -> npt.NDArray[np.uint16]: ...
    def ready_records(self) -> npt.NDArray[np.uint32]: ...
    def replay_journal(self, data: Buffer, block_bytes: int) -> tuple[int, int, int]: ...
    def encode_checkpoint(self, block_bytes: int, seq: int) -> bytes: ...
    def apply_checkpoint(self, data: Buffer, block_bytes: int) -> tuple[str, int, int]: ...
    def rebuild(self) -> int: ...

# plfu.cc (csrc/core/disk/plfu.h): kvtier.policy.plfu's ranking for the host tier
class PlfuVictims:
    def __iter__(self) -> Iterator[object]: ...
    def __next__(self) -> object: ...

class PlfuPolicy:
    bytes_per_key: Final[int]
    def insert(self, key: object) -> None: ...
    def touch(self, key: object) -> None: ...
    def remove(self, key: object, evicted: bool = False) -> None: ...
    def victims(self) -> PlfuVictims: ...
    def __len__(self) -> int: ...
    def ghosts(self) -> int: ...
    @property
    def beta(self) -> float: ...
    @property
    def weights(self) -> list[float]: ...
    @property
    def horizon(self) -> float: ...

# options: kvtier.policy.plfu.PLFUPolicy's (variants None: its VARIANTS)
def plfu_policy(capacity: int, **options: object) -> PlfuPolicy: ...

# remote.cc
class RemoteStore:
    def __init__(
        self,
        seeds: Sequence[tuple[str, int]],
        cluster: bool,
        user: str,
        password: str,
        db: int,
        connect_timeout_ms: int,
        io_timeout_ms: int,
        pipeline: int,
        ttl_ms: int,
        lazy: bool,
        ns: bytes,
        window_bytes: int = ...,
        tls: bool = False,
        tls_ca_file: str = "",
        tls_cert_file: str = "",
        tls_key_file: str = "",
        tls_server_name: str = "",
    ) -> None: ...
    def call(self, key: bytes, args: Sequence[bytes]) -> Any:
        """One command on this thread's own connection to ``key``'s node;
        the reply as bytes, int, None or lists of them. Releases the GIL."""
        ...
    @property
    def nodes(self) -> list[str]: ...
    @property
    def redirects(self) -> int: ...

REMOTE_HEADER_BYTES: Final[int]

# module.cc
def crc32c(data: Buffer, crc: int = 0) -> int: ...
def crc32c_backend() -> str: ...
def build_info() -> dict[str, str]: ...
