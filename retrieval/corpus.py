"""The Python 3.11 documentation as a `docs` table: the demo's corpus and the benchmarks'.

Debian's ``python3.11-doc`` ships the reST sources of the documentation (497 documents,
PSF license) under ``/usr/share/doc/python3.11/html/_sources``. Each becomes one row:
``id`` (path without suffix, e.g. ``library/os``), ``title`` (the first heading) and
``body`` (the reST text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PYDOCS = Path("/usr/share/doc/python3.11/html/_sources")
SUFFIX = ".rst.txt"

_UNDERLINE = re.compile(r"^([=\-*^~#+\"'`.:_])\1{2,}\s*$")


class CorpusError(Exception):
    """The corpus is not where it should be."""


@dataclass(frozen=True)
class Doc:
    id: str
    title: str
    body: str


def section_titles(text: str) -> list[str]:
    """The reST section titles of a document (overlined or not), in order."""
    lines = text.splitlines()
    titles = []
    for i in range(1, len(lines)):
        above = lines[i - 1].strip()
        if _UNDERLINE.match(lines[i]) and above and not _UNDERLINE.match(above):
            titles.append(above)
    return titles


def title_of(text: str, default: str) -> str:
    titles = section_titles(text)
    return titles[0] if titles else default


def load_pydocs(root: Path = PYDOCS, limit: int | None = None) -> list[Doc]:
    """The documents under ``root``, sorted by id; the first ``limit`` of them if given."""
    if not root.is_dir():
        raise CorpusError(
            f"{root} does not exist: install the Debian package python3.11-doc (apt-get install python3.11-doc)."
        )
    paths = sorted(root.rglob(f"*{SUFFIX}"))
    docs = []
    for path in paths[:limit] if limit is not None else paths:
        doc_id = str(path.relative_to(root))[: -len(SUFFIX)]
        body = path.read_text(encoding="utf-8", errors="replace")
        docs.append(Doc(doc_id, title_of(body, doc_id), body))
    if not docs:
        raise CorpusError(f"no *{SUFFIX} documents under {root}.")
    return docs
