"""SGLang HiCache shim, for the benchmark and the tests only: SGLang's host
KV pools (MHA and MLA) on CPU tensors and its cache controller's storage
code, where SGLang's real classes cannot be imported (their modules import
SGLang's model configurations, whose dependencies, torchvision and SGLang's
CPU kernels, are not installed here); and the few SGLang calls the
benchmark makes, so that this package stays the only kvtier code importing
sglang.

The stand-in runs SGLang's own code: the page methods (``init_kv_buffer``,
``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page``,
``get_page_buffer_meta``, ``get_size_per_token``, the ``k_buffer``/
``v_buffer`` and ``logical_*`` properties) are compiled from the installed
SGLang's source of ``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` and
``HostKVCache``, not rewritten; only the attributes their constructors set
are set here (:data:`STANDIN_ATTRIBUTES`, which a test checks against the
real classes). :func:`controller` does the same for the cache controller.
Who calls: ``kvtier bench sglang`` and tests, never the library; the
compilations read SGLang's source files (blocking, once per call).

Runs in the command-line tool's process (``kvtier bench sglang``) or a
test's.
"""

from __future__ import annotations
import __future__

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

#: Attributes both pool kinds' stand-ins set (see STANDIN_ATTRIBUTES).
_POOL_ATTRS = (
    "dtype",
    "page_size",
    "size",
    "page_num",
    "layout",
    "device",
    "pin_memory",
    "allocator",
    "_transfer_device",
    "dcp_size",
    "dcp_rank",
    "kv_buffer",
    "start_layer",
    "end_layer",
)
#: Methods and properties taken from SGLang's classes, per pool kind.
METHODS = {
    "mha": (
        "init_kv_buffer",
        "get_data_page",
        "get_dummy_flat_data_page",
        "set_from_flat_data_page",
        "get_page_buffer_meta",
        "get_size_per_token",
        "k_buffer",
        "v_buffer",
    ),
    "mla": (
        "init_kv_buffer",
        "get_data_page",
        "get_dummy_flat_data_page",
        "set_from_flat_data_page",
        "_storage_page_index",
    ),
}
BASE_METHODS = ("logical_size", "logical_page_size")
CLASSES = {"mha": ("mha.py", "MHATokenToKVPoolHost"), "mla": ("mla.py", "MLATokenToKVPoolHost")}
#: Attributes the stand-in sets, as SGLang's constructors do (a test checks
#: each is set or defined by the real class or its base).
STANDIN_ATTRIBUTES = {
    "mha": (
        "layer_num",
        "head_num",
        "head_dim",
        "v_head_dim",
    )
    + _POOL_ATTRS,
    "mla": (
        "layer_num",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "kv_cache_dim",
    )
    + _POOL_ATTRS,
}


def pool_host_dir() -> Path:
    """The installed SGLang's ``srt/mem_cache/pool_host`` directory (raises
    ModuleNotFoundError without SGLang; does not import it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("sglang is not installed (pip install --no-deps sglang)")
    return Path(next(iter(spec.submodule_search_locations))) / "srt" / "mem_cache" / "pool_host"


def class_def(file: str, name: str) -> ast.ClassDef:
    """The AST of class ``name`` in SGLang's ``pool_host/<file>``."""
    tree = ast.parse((pool_host_dir() / file).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"SGLang's {file} defines no class {name}")


def defined_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class defines (methods, properties, class attributes) or sets
    on ``self`` anywhere in its body."""
    names: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in cls.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _compile(cls: ast.ClassDef, wanted: tuple[str, ...], env: dict[str, Any]) -> dict[str, Any]:
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    missing = set(wanted) - {f.name for f in funcs}
    if missing:
        raise LookupError(f"SGLang's {cls.name} no longer defines {sorted(missing)}")
    ns: dict[str, Any] = dict(env)
    # As in SGLang's modules (from __future__ import annotations): annotations stay text.
    flags = __future__.annotations.compiler_flag
    module = ast.Module(body=list(funcs), type_ignores=[])
    code = compile(module, f"<sglang {cls.name}>", "exec", flags=flags, dont_inherit=True)
    exec(code, ns)  # SGLang's own method bodies, bound below
    return {name: ns[name] for name in wanted}


def _alloc(dims: Any, dtype: torch.dtype, **_: Any) -> torch.Tensor:
    return torch.empty(dims, dtype=dtype)


def host_pool(
    kind: str = "mha",
    layout: str = "page_first",
    *,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    pages: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    kv_lora_rank: int = 64,
    qk_rope_head_dim: int = 32,
) -> Any:
    """A host pool of ``kind`` ``"mha"`` or ``"mla"`` in ``layout``
    (``layer_first``, ``page_first``, ``page_first_direct``) holding
    ``pages`` pages of ``page_size`` tokens (plus SGLang's padding page),
    its buffer filled with zeros. Its page methods are SGLang's."""
    file, name = CLASSES[kind]
    env = {"torch": torch, "ALLOC_MEMORY_FUNCS": {"cpu": _alloc}}
    methods = _compile(class_def(file, name), METHODS[kind], env)
    methods.update(_compile(class_def("base.py", "HostKVCache"), BASE_METHODS, env))
    standin = type(f"StandIn{name}", (), methods)
    pool = standin()
    attrs: dict[str, Any] = dict(
        layer_num=layers,
        dtype=dtype,
        page_size=page_size,
        page_num=pages + 1,
        size=(pages + 1) * page_size,
        layout=layout,
        device="cpu",
        pin_memory=False,
        allocator=None,
        _transfer_device=SimpleNamespace(type="cpu"),
        dcp_size=1,
        dcp_rank=0,
        start_layer=0,
        end_layer=layers,
    )
    if kind == "mha":
        attrs.update(head_num=heads, head_dim=head_dim, v_head_dim=head_dim)
    else:
        attrs.update(
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            kv_cache_dim=kv_lora_rank + qk_rope_head_dim,
        )
    for k, v in attrs.items():
        setattr(pool, k, v)
    pool.kv_buffer = pool.init_kv_buffer()
    pool.kv_buffer.zero_()
    return pool


def storage_config(
    extra: dict[str, Any],
    *,
    layout: str = "page_first",
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "org/model",
) -> Any:
    """SGLang's ``HiCacheStorageConfig`` for one rank (imports SGLang's storage module)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first",
        model_name=model,
        extra_config=extra,
    )


def open_storage(extra: dict[str, Any], pool: Any, **config: Any) -> Any:
    """kvtier's SGLang backend for ``extra``, with ``pool`` registered as
    SGLang registers its KV host pool (``config``: :func:`storage_config`'s)."""
    from kvtier.integrations.sglang import KVTierStorage

    s = KVTierStorage(storage_config(extra, layout=pool.layout, **config), {})
    try:
        s.register_mem_pool_host(pool)
    except BaseException:
        s.close()
        raise
    return s


def fill(pool: Any, seed: int) -> None:
    """Random bytes (from ``seed``) in the whole of ``pool``'s buffer."""
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_bytes(pool: Any, i: int) -> bytes:
    """Page ``i``'s bytes as SGLang's flat data page."""
    return bytes(pool.get_data_page(i * pool.page_size).contiguous().view(torch.uint8).numpy())


def token_indices(pool: Any, first: int, n: int) -> torch.Tensor:
    """SGLang's host indices of pages ``[first, first + n)``."""
    return torch.arange(first * pool.page_size, (first + n) * pool.page_size)


#: SGLang's cache-controller code that drives a storage backend: its storage
#: operations and the controller methods of the hit query, the prefetch
#: transfer and the backup (zero-copy and generic page calls).
CONTROLLER_CLASSES = ("StorageOperation", "PrefetchOperation", "PrefetchAck")
CONTROLLER_METHODS = (
    "_storage_hit_query",
    "_page_transfer",
    "_page_transfer_kv_batch",
    "_page_get_zero_copy",
    "_generic_page_get",
    "_page_set_zero_copy",
    "_generic_page_set",
    "_page_backup",
)


def controller(backend: Any, host_pool: Any, zero_copy: bool = True) -> Any:
    """SGLang's ``HiCacheController`` as far as it drives a storage backend:
    its own methods (:data:`CONTROLLER_METHODS`) and operation classes,
    compiled from the installed ``managers/cache_controller.py`` (whose
    module cannot be imported here), over ``backend`` and ``host_pool``.
    ``zero_copy``: the page calls SGLang picks for a dynamic backend with
    ``interface_v1`` (else its generic ones). The returned object also
    carries ``StorageOperation``, ``PrefetchOperation`` and ``PrefetchAck``."""
    import dataclasses
    import logging
    import queue
    import threading
    import time

    import sglang.srt.mem_cache.hicache_storage as hs
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    path = pool_host_dir().parent.parent / "managers" / "cache_controller.py"
    tree = ast.parse(path.read_text())
    nodes: list[ast.stmt] = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in CONTROLLER_CLASSES
    ]
    if len(nodes) != len(CONTROLLER_CLASSES):
        raise LookupError("SGLang's cache_controller.py changed its storage operations")
    ctl = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HiCacheController"
    )
    env: dict[str, Any] = {
        "torch": torch,
        "dataclass": dataclasses.dataclass,
        "threading": threading,
        "time": time,
        "logger": logging.getLogger("sglang.cache_controller"),
        "get_storage_hash_str": get_storage_hash_str,
        **{
            k: getattr(hs, k)
            for k in (
                "STORAGE_BATCH_SIZE",
                "HiCacheStorageExtraInfo",
                "PoolName",
                "PoolTransfer",
                "count_pool_hits",
            )
        },
    }
    code = compile(
        ast.Module(body=nodes, type_ignores=[]),
        "<sglang cache_controller>",
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, env)  # SGLang's own classes
    methods = _compile(ctl, CONTROLLER_METHODS, env)
    standin = type("StandInHiCacheController", (), methods)()
    standin.storage_backend = backend
    standin.storage_host_pool = standin.mem_pool_host = host_pool
    standin.page_size = host_pool.page_size
    standin.prefetch_sync_queue = queue.Queue()
    get = "_page_get_zero_copy" if zero_copy else "_generic_page_get"
    put = "_page_set_zero_copy" if zero_copy else "_generic_page_set"
    standin.page_get_func, standin.page_set_func = getattr(standin, get), getattr(standin, put)
    for name in CONTROLLER_CLASSES:
        setattr(standin, name, env[name])
    return standin


def hicache_file(extra: dict[str, Any], layout: str = "page_first") -> Any:
    """SGLang's own file backend (``HiCacheFile``) for ``extra``."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    return HiCacheFile(storage_config(extra, layout=layout))


def page_hashes(tokens: list[int], page_tokens: int) -> list[str]:
    """SGLang's storage keys of the pages of ``tokens`` (a chain from the start)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes: list[str] = get_storage_hash_str(tokens, None, page_size=page_tokens)
    return hashes


def storage_batch_pages() -> int:
    """Pages per storage call of SGLang's controller (its STORAGE_BATCH_SIZE)."""
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    return int(STORAGE_BATCH_SIZE)


def sglang_version() -> str:
    import sglang

    return str(sglang.__version__)
