"""Write docs/reference/configuration.md from kvtier's option definitions
(``kvtier.options``: every key of every surface, with its default, unit and
meaning).

``make docs`` runs it before ``mkdocs build``; ``--check`` exits 1, writing
nothing, when the committed page differs from what the definitions give
(tests/unit/test_docs.py runs that). Never edit configuration.md by hand:
edit the option's declaration, or the closing notes below.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gen_page import write_or_check
from kvtier.options.surfaces import reference_markdown

PAGE = Path(__file__).resolve().parent / "reference" / "configuration.md"

# What the options do not cover, and where it is documented: (where, what).
NOTES = [
    (
        "vLLM's own keys beside kvtier's",
        "`spec_name`, `spec_module_path`, `block_size`, `blocks_per_chunk`, "
        "`sync_load_budget_bytes`, ... ([vLLM guide](../guides/vllm.md))",
    ),
    ("Python: the manager", "[`ManagerOptions`](api/manager.md) (the vLLM options above set it)"),
    ("Redis and Valkey URLs, TLS, ACL users", "[Redis, Valkey and clusters](../guides/redis.md)"),
    ("command line beyond the tiers", "[Command line](cli.md), generated from the parsers"),
    (
        "environment",
        "`KVTIER_CUDART` (the path of the libcudart to load, tried before any other), "
        "`KVTIER_IO_NICE` (the remote tier's worker niceness, "
        "[Redis guide](../guides/redis.md#defaults-and-what-they-cost-the-server)); vLLM's "
        "`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` ([Events](../guides/events.md))",
    ),
]


def render() -> str:
    """The page: the generated tables, then the notes above. Pure."""
    rows = [f"| {where} | {what} |" for where, what in NOTES]
    notes = ["## Beyond the options", "", "| where | what |", "| --- | --- |", *rows]
    return reference_markdown().rstrip("\n") + "\n\n" + "\n".join(notes) + "\n"


def main(argv: list[str]) -> int:
    return write_or_check(PAGE, render(), "docs/gen_config.py", argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
