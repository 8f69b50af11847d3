"""Write or check one generated docs page: the shared ``main`` of
docs/gen_cli.py and docs/gen_config.py.

Called by those scripts (``make docs`` runs them; tests/unit/test_docs.py
compares their ``render()`` with the committed pages). Blocks on the file only.
"""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(page: Path, text: str, script: str, argv: list[str]) -> int:
    """With ``--check`` in ``argv``: 1 (writing nothing) when ``page`` differs
    from ``text``, else 0. Without: write ``text`` where it differs."""
    current = page.read_text() if page.exists() else None
    if "--check" in argv:
        if current != text:
            print(f"{page} is stale: run `make docs` (or python {script})", file=sys.stderr)
            return 1
        return 0
    if current != text:
        page.write_text(text)
        print(f"wrote {page}")
    return 0
