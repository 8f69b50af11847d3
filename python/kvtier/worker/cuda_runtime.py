"""Finding the CUDA runtime (libcudart) without importing torch.

Process: any (the engine's workers, ``kvtier doctor``, benchmarks). Who
calls: :class:`~kvtier.worker.transfer.DeviceTransfer`'s CUDA backend and the
doctor, before the native core first needs the runtime. Blocks while the
library loads (once per process).

The native core looks first for ``KVTIER_CUDART``, then for a libcudart the
process has loaded already (torch's: one runtime per process), then on the
dynamic loader's path. pip's CUDA wheels put libcudart where the loader does
not look (``site-packages/nvidia/cu13/lib``, ``nvidia/cuda_runtime/lib``), so
a process that has not imported torch would not find it; this module lists
those places, and ``CUDA_HOME``'s, for the core to try last.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def search_paths() -> list[str]:
    """Full paths of libcudart files in pip's nvidia packages and CUDA_HOME,
    CUDA 13 before 12, each once, in that order. Pure file-system lookups."""
    found: list[Path] = []
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        if base.is_dir():
            found += sorted(base.glob("cu*/lib/libcudart.so*"), reverse=True)
            found += sorted(base.glob("cuda_runtime/lib/libcudart.so*"), reverse=True)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if root := os.environ.get(var):
            found += sorted(Path(root).glob("lib64/libcudart.so*"), reverse=True)
    found += sorted(Path("/usr/local/cuda/lib64").glob("libcudart.so*"), reverse=True)

    def major(p: Path) -> int:
        tail = p.name.split(".so")[-1].lstrip(".").split(".")[0]
        return int(tail) if tail.isdigit() else 0

    out: list[str] = []
    for p in sorted(found, key=major, reverse=True):  # stable: the order above within a major
        s = str(p)
        if s not in out and p.is_file():
            out.append(s)
    return out


def load() -> tuple[str, int, bool, str]:
    """Loads the runtime (once per process) and says which: its path, its
    version (e.g. 13000), whether it has batched copies, and how it was found.
    Raises :class:`kvtier.errors.CudaError` when there is none."""
    from kvtier import _native

    path, version, batch, found = _native.cuda_runtime(search_paths())
    return str(path), int(version), bool(batch), str(found)
