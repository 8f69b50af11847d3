"""MkDocs hooks (mkdocs.yml ``hooks:``): the plots under bench/results go into
the site as ``results/...``, so benchmark pages show them from where the runs
keep them, without a second copy in docs/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.rglob("*.png")):
        uri = "results/" + png.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


# Docstrings here use Sphinx roles (:class:`X`, :meth:`X`); mkdocstrings shows
# the role's name before the code. Keep the code, drop the role, and the
# leading "~" Sphinx uses to shorten a dotted name.
_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):<code>~?")


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    return _ROLE.sub("<code>", html)
