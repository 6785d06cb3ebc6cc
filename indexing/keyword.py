"""The keyword (BM25) index of an index version: a tantivy index beside the vector shards.

``index build`` writes one tantivy index per full build, over every row of its shards
(title and text, stemmed English; the names the chunk defines, whole; the ACL groups as raw
terms), and names its files in the
manifest, so it is published, verified (sha256) and garbage-collected with the shards.
An incremental version shares its base's keyword index as it shares the base's shards:
its delta rows are added by the replica when it opens the version (a delta is at most
``--max-delta`` of the rows), and its dead rows are filtered like the dense path's.

A document's ``key`` says which row it is: ``shard << 32 | faiss_id`` for an index row,
``TAIL | row`` for a row of the lake's tail (``retrieval.keyword`` adds those). Queries
are tokenised here with the same analyser as the ``en_stem`` field, so no query syntax is
parsed: a user's text cannot fail to parse or turn into field queries.

A replica works on a *copy*: the version's files are fetched once into a pristine
directory, and each copy hard-links them (tantivy never rewrites a segment file) and adds
its own documents, so term statistics (BM25's idf) are those of one index holding both the
version's rows and the fresh ones, and a freshly changed document scores as it would
after the next build.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import tantivy

from indexing.lists import ListTable, decode_id_map
from indexing.manifest import FileRef, ShardRef, get_verified, put_file, sha256
from indexing.store import ObjectStore

log = logging.getLogger(__name__)

#: the key bit of a tail row's document (index rows: shard << 32 | faiss id)
TAIL = 1 << 63
#: the ACL term of a public row; a group's term is ``GROUP`` + its name, so no group name
#: (whatever a source row holds) can make a row public
PUBLIC = "public"
GROUP = "g:"
#: the columns a keyword document is made of
COLUMNS = ["title", "text", "acl", "chunk_id"]
#: the API names a chunk defines, as reference docs and code write a definition: a Sphinx
#: directive (``.. function:: replace(src, dst)``), a Python ``def``/``class``, a Markdown
#: heading that is a signature (``### `os.replace(src, dst)` ``)
_DEFINITIONS = (
    re.compile(
        r"^\s*\.\. (?:py:)?(?:function|method|class|exception|data|attribute|property|decorator|"
        r"decoratormethod|classmethod|staticmethod|abstractmethod|coroutinefunction|coroutinemethod|"
        r"module|cmdoption|option|envvar|opcode|type|macro|member|var)::\s*([^\s(\[]+)",
        re.M,
    ),
    re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+([A-Za-z_]\w*)", re.M),
    re.compile(r"^#{1,6}\s+`?([A-Za-z_][\w.]*)\(", re.M),
)
#: substrings each of ``_DEFINITIONS`` cannot match without: most chunks define nothing, and
#: looking for these is a fraction of running the patterns (which took 6 of a document's
#: 9 µs, the largest part of building a keyword index)
_NEEDS: tuple[tuple[str, ...], ...] = ((".. ",), ("def", "class"), ("#",))
#: every substring of ``_NEEDS``, in one tuple: a text holding none of them defines nothing
_ANY_NEED = tuple(dict.fromkeys(need for needs in _NEEDS for need in needs))
#: the module a chunk's definitions belong to: a Sphinx module directive in the chunk, else
#: its document's title (``:mod:`os` --- ...`` in reST, ``os — ...`` as rendered)
_MODULE = re.compile(r"^\s*\.\. (?:py:)?(?:module|currentmodule)::\s*([\w.]+)", re.M)
_TITLE_MODULE = re.compile(r":mod:`[!~]?([\w.]+)`|^([A-Za-z_][\w.]*)\s+(?:—|---|--)\s")
#: a name as users paste it: a dotted identifier, or a command line option
_IDENTIFIER = re.compile(r"(?<![\w-])-{1,2}[A-Za-z][\w-]*|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
#: a name term's weight against a text term's. A name scores as BM25 with no length
#: normalisation (idf × weight, once per chunk): a field that most chunks leave empty makes
#: tantivy's normalisation crush a chunk that defines a few names. A definition of the name a
#: query holds then outranks the chunks that only mention it (benchmarks/quality.py,
#: identifier queries: keyword recall@10 0.63 without the field, 0.97 at weights 0.5 to 3)
NAMES_WEIGHT = 1.0
#: tantivy's writer heap (it needs at least 15 MB per thread)
WRITER_HEAP = 64 << 20
#: a tantivy file that is never part of an index's content
_LOCKS = (".tantivy-meta.lock", ".tantivy-writer.lock")


def index_key(shard: int, faiss_id: int) -> int:
    return shard << 32 | faiss_id


def schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_text_field("title", tokenizer_name="en_stem", index_option="freq")
    builder.add_text_field("text", tokenizer_name="en_stem", index_option="freq")
    builder.add_text_field("acl", tokenizer_name="raw", index_option="basic")
    # an index row's chunk id (older replicas exclude superseded chunks by it: still written for them)
    builder.add_text_field("chunk", tokenizer_name="raw", index_option="basic")
    # read by document address (a fast field), never searched: an inverted index of a million
    # distinct keys cost a 1M build ~1 CPU second and a fifth of the keyword index's bytes
    builder.add_unsigned_field("key", indexed=False, fast=True)
    # the names the chunk defines, each with its module and every dotted suffix (defined_names);
    # last, so an index built before it has the same field ids for the others
    builder.add_text_field("names", tokenizer_name="raw", index_option="basic")
    return builder.build()


SCHEMA = schema()
#: tantivy's ``en_stem`` analyser, rebuilt to tokenise queries exactly as documents were
ANALYZER = (
    tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
    .filter(tantivy.Filter.remove_long(40))
    .filter(tantivy.Filter.lowercase())
    .filter(tantivy.Filter.stemmer("english"))
    .build()
)
#: (field, weight). Every chunk carries its document's title, so a title term matches every chunk
#: of the document: at weight 1 it buried the FAQ answers (keyword nDCG@10 0.373 against 0.417
#: without titles) though it found more API definitions (recall@10 0.69 against 0.58); at 0.2:
#: 0.412 and 0.63 (the Python docs, benchmarks/quality.py)
FIELDS = (("title", 0.2), ("text", 1.0))


def terms(query: str) -> list[str]:
    """The query's distinct terms, in order."""
    return list(dict.fromkeys(ANALYZER.analyze(query)))


def _suffixes(name: str) -> list[str]:
    """``imaplib.IMAP4.read`` → imaplib.imap4.read, imap4.read, read (an option stays whole)."""
    if name.startswith("-"):
        return [name.lower()]
    parts = [p for p in name.lower().split(".") if p]
    return [".".join(parts[i:]) for i in range(len(parts))]


def may_define(text: str) -> bool:
    """Whether any of ``_DEFINITIONS`` can match ``text`` (it holds one of ``_NEEDS``): most
    chunks define nothing. A plain loop over ``_ANY_NEED`` (60 ns a call more than the four
    checks written out, which repeated ``_NEEDS`` and could have drifted from it)."""
    for need in _ANY_NEED:
        if need in text:
            return True
    return False


def definitions(text: str) -> list[str]:
    """The names ``_DEFINITIONS`` find in a text, in pattern order; a pattern runs only when
    the text holds what it needs (``_NEEDS``)."""
    if not may_define(text):
        return []  # none can match: the common case
    return [name for pattern, needs in zip(_DEFINITIONS, _NEEDS, strict=True)
            if any(n in text for n in needs) for name in pattern.findall(text)]  # fmt: skip


def defined_names(text: str | None, title: str | None) -> list[str]:
    """The ``names`` terms of a chunk: each name it defines, qualified by its module, and every
    dotted suffix of that (so ``os.replace``, ``replace`` and a class's ``Path.replace`` all match)."""
    if not text:
        return []
    found = definitions(text)
    if not found:
        return []
    in_text = _MODULE.search(text)
    in_title = _TITLE_MODULE.search(title or "")
    module = in_text.group(1) if in_text else next((g for g in in_title.groups() if g), None) if in_title else None
    out: dict[str, None] = {}
    for name in found:
        own = name.startswith("-") or not module or name == module or name.startswith(module + ".")
        qualified = name if own else f"{module}.{name}"
        out.update(dict.fromkeys(_suffixes(qualified)))
    return list(out)


def _code_like(token: str) -> bool:
    return "." in token or "_" in token or token.startswith("-") or re.search(r"[a-z][A-Z]", token) is not None


def query_names(query: str) -> list[str]:
    """The ``names`` terms a query asks for: its code-like tokens (dotted, snake_case, camelCase,
    options), or its only word, with their dotted suffixes."""
    tokens = _IDENTIFIER.findall(query)
    wanted = tokens if len(tokens) == 1 else [t for t in tokens if _code_like(t)]
    return list(dict.fromkeys(term for t in wanted for term in _suffixes(t)))


def mentions_code(query: str) -> bool:
    """A sentence that holds a code-like token (``why does os.replace fail``): hybrid search
    weighs its keyword ranking as ``EngineOptions.code_weight``."""
    return any(_code_like(t) for t in _IDENTIFIER.findall(query))


def identifier_query(query: str) -> bool:
    """A query that is a name, not a sentence: at most three words, one token or only code-like
    ones (``os.replace``, ``dirs_exist_ok``, ``EAGAIN``, ``--user``). Hybrid search weighs its
    keyword ranking more (``EngineOptions.identifier_weight``)."""
    tokens = _IDENTIFIER.findall(query)
    return bool(tokens) and len(query.split()) <= 3 and (len(tokens) == 1 or all(_code_like(t) for t in tokens))


def document(
    key: int, title: str | None, text: str | None, acl: Sequence[str] | None, chunk_id: str | None = None
) -> tantivy.Document:
    doc = tantivy.Document()
    doc.add_unsigned("key", key)
    if chunk_id is not None:
        doc.add_text("chunk", chunk_id)
    if title:
        doc.add_text("title", title)
    doc.add_text("text", text or "")
    # asked here, not only in ``definitions``: most chunks define nothing, and a build makes a
    # document per row (the calls to ``defined_names`` and ``definitions`` it saves were a
    # share of the 1M keyword stage)
    if text and may_define(text):
        for name in defined_names(text, title):  # an index without the field (built before it) ignores them
            doc.add_text("names", name)
    if acl:
        for group in acl:  # [None]: nobody's
            if group is not None:
                doc.add_text("acl", GROUP + group)
    else:
        doc.add_text("acl", PUBLIC)
    return doc


@dataclass(frozen=True)
class Matches:
    """Matching documents best first: their ``keys`` (uint64) and BM25 ``scores``."""

    keys: np.ndarray
    scores: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)


NO_MATCHES = Matches(np.zeros(0, np.uint64), np.zeros(0))


class KeywordIndex:
    """A tantivy index in a local directory, written by one writer at a time, searched by many."""

    def __init__(self, path: Path, create: bool = False) -> None:
        self.path = path
        if create:
            path.mkdir(parents=True, exist_ok=True)
        self.index = tantivy.Index(SCHEMA, path=str(path), reuse=False) if create else tantivy.Index.open(str(path))
        self._writer: Any = None
        self._lock = threading.Lock()
        searcher = self.index.searcher()
        public = searcher.search(tantivy.Query.term_query(SCHEMA, "acl", PUBLIC), 1, count=True).count  # type: ignore[attr-defined]
        #: a searcher, and whether every document it holds is public: then a search needs no ACL
        #: filter, which costs tantivy its block-max WAND (a question over the Python docs: 1.03 ms
        #: with it, 0.32 without). One attribute, swapped whole: a searcher that holds a restricted
        #: document is never paired with "every document is public"
        self._state: tuple[Any, bool] = (searcher, public == searcher.num_docs)
        #: whether the index has the ``names`` field (an index built before it does not)
        self.has_names = _has_field(self.index, "names")

    @property
    def searcher(self) -> Any:
        return self._state[0]

    @property
    def all_public(self) -> bool:
        """Whether every document of the current searcher is public (deleted ones may not be)."""
        return self._state[1]

    def add(self, docs: Iterable[tantivy.Document]) -> int:
        """Add documents and commit them (visible to searches once this returns)."""
        with self._lock:
            if self._writer is None:
                self._writer = self.index.writer(heap_size=WRITER_HEAP, num_threads=1)
            n = 0
            public = self.all_public
            for doc in docs:
                self._writer.add_document(doc)
                public = public and doc.get_all("acl") == [PUBLIC]
                n += 1
            if n:
                self._writer.commit()
                self.index.reload()
                self._state = (self.index.searcher(), public)
            return n

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.wait_merging_threads()  # also releases the writer's lock
                self._writer = None

    def search(
        self,
        query_terms: list[str],
        groups: frozenset[str],
        limit: int,
        names: Sequence[str] = (),
    ) -> Matches:
        """The best ``limit`` documents a caller in ``groups`` may see (by their ACL terms) for any
        of the terms or defined ``names`` (``query_names``)."""
        if limit <= 0:
            return NO_MATCHES
        searcher, all_public = self._state
        clauses = [
            (tantivy.Occur.Should, _boosted(tantivy.Query.term_query(SCHEMA, field, term, index_option="freq"), w))
            for term in query_terms
            for field, w in FIELDS
        ]
        for name in names if self.has_names else ():
            chunks = searcher.doc_freq("names", name)
            if chunks:
                idf = math.log(1 + (searcher.num_docs - chunks + 0.5) / (chunks + 0.5))
                term = tantivy.Query.term_query(SCHEMA, "names", name, index_option="basic")
                clauses.append((tantivy.Occur.Should, tantivy.Query.const_score_query(term, NAMES_WEIGHT * idf)))
        if not clauses:
            return NO_MATCHES
        if all_public:
            query = tantivy.Query.boolean_query(clauses)
        else:
            visible = tantivy.Query.term_set_query(SCHEMA, "acl", [PUBLIC, *sorted(GROUP + g for g in groups)])
            parts = [
                (tantivy.Occur.Must, tantivy.Query.boolean_query(clauses)),
                (tantivy.Occur.Must, tantivy.Query.const_score_query(visible, 0.0)),
            ]
            query = tantivy.Query.boolean_query(parts)
        hits = searcher.search(query, limit, count=False).hits
        if not hits:
            return NO_MATCHES
        scores, addresses = zip(*hits, strict=True)
        keys = searcher.fast_field_values("key", list(addresses))
        return Matches(np.array([key or 0 for key in keys], np.uint64), np.array(scores, np.float64))

    def keys_of(self, chunk_ids: Sequence[str]) -> list[int]:
        """The keys of the index rows of these chunks (tail rows carry no chunk id)."""
        if not chunk_ids:
            return []
        searcher = self.searcher
        query = tantivy.Query.term_set_query(SCHEMA, "chunk", list(chunk_ids))
        limit = 2 * len(chunk_ids) + 16  # a chunk has one row per build it is in (base and delta)
        while True:
            hits = searcher.search(query, limit, count=False).hits
            if len(hits) < limit:
                break
            limit *= 4
        keys = searcher.fast_field_values("key", [address for _, address in hits])
        return [int(key) for key in keys if key is not None]

    @property
    def docs(self) -> int:
        return int(self.searcher.num_docs)


def _has_field(index: tantivy.Index, field: str) -> bool:
    try:
        tantivy.Query.term_query(index.schema, field, "")
    except ValueError:
        return False
    return True


def _boosted(query: tantivy.Query, weight: float) -> tantivy.Query:
    return query if weight == 1.0 else tantivy.Query.boost_query(query, weight)


# -- building --------------------------------------------------------------------------


def shard_documents(shard: int, ids: pa.Table) -> Iterable[tantivy.Document]:
    columns = ids.select([c for c in COLUMNS if c in ids.column_names]).to_pydict()
    titles = columns.get("title") or [None] * ids.num_rows
    fids = ids.column("faiss_id").to_pylist()
    base = index_key(shard, 0)
    for fid, title, text, acl, chunk_id in zip(
        fids, titles, columns["text"], columns["acl"], columns["chunk_id"], strict=True
    ):
        yield document(base | fid, title, text, acl, chunk_id)


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off meanwhile (as it was before, afterwards).

    A document is a few objects freed by reference counting, never a cycle, but making a
    million of them set off collections that scanned every object of the process: 1.9 of a
    1M build's 47 CPU seconds (py-spy), paid on the thread that feeds tantivy."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_keyword_index(
    store: ObjectStore, prefix: str, shards: list[ShardRef], progress: bool = False
) -> tuple[list[FileRef], dict[str, Any]]:
    """Index every row of ``shards`` (read back from their id maps) and write the index's
    files under ``prefix/keyword/``; return their refs and the build's figures."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="streamrag-keyword-"))
    try:
        index = KeywordIndex(work, create=True)
        writer = index.index.writer(heap_size=WRITER_HEAP * 2, num_threads=2)
        docs = 0
        with collection_paused():
            for s, ref in enumerate(tqdm(shards, desc="keyword index", disable=not progress, leave=False)):
                table = ListTable.from_bytes(get_verified(store, ref.table)) if ref.id_blocks and ref.table else None
                ids = decode_id_map(get_verified(store, ref.ids), ref.id_blocks, [*COLUMNS, "faiss_id"], table)
                for doc in shard_documents(s, ids):
                    writer.add_document(doc)
                    docs += 1
        writer.commit()
        writer.wait_merging_threads()
        index_s = time.perf_counter() - t0
        refs = [
            put_file(store, f"{prefix}/keyword/{_stored_name(name)}", (work / name).read_bytes())
            for name in sorted(os.listdir(work))
            if name not in _LOCKS
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stats = {
        "docs": docs,
        "bytes": sum(r.bytes for r in refs),
        "files": len(refs),
        "index_s": round(index_s, 3),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return refs, stats


# -- a replica's copies ----------------------------------------------------------------


def pristine_name(refs: list[FileRef]) -> str:
    return "pristine-" + refs[0].key.rsplit("/keyword/", 1)[0].replace("/", "_")


def fetch_pristine(store: ObjectStore, refs: list[FileRef], root: Path, checked: set[Path] | None = None) -> Path:
    """The version's keyword files in a local directory, fetched and verified once. A
    directory found complete on disk (an earlier run's) is checked against the manifest's
    sha256 before its first use (then noted in ``checked``), and fetched again if it differs."""
    path = root / pristine_name(refs)
    done = path / ".complete"
    if done.exists():
        if checked is not None and path in checked:
            return path
        if all(_matches(path / _local_name(ref), ref) for ref in refs):
            if checked is not None:
                checked.add(path)
            return path
        log.warning("keyword index files under %s differ from the manifest: fetching them again", path)
        shutil.rmtree(path, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix="fetching-", dir=root))
    try:
        for ref in refs:
            (staging / _local_name(ref)).write_bytes(get_verified(store, ref))
        (staging / ".complete").write_text("")
        try:
            staging.rename(path)
        except OSError:  # another thread fetched it first
            if not done.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _matches(path: Path, ref: FileRef) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return len(data) == ref.bytes and sha256(data) == ref.sha256


def _stored_name(name: str) -> str:
    """Object stores and their listings may hide dot files (tantivy's ``.managed.json``):
    stored as ``_managed.json`` (tantivy's own names never start with ``_``)."""
    return "_" + name[1:] if name.startswith(".") else name


def _local_name(ref: FileRef) -> str:
    name = ref.key.rsplit("/", 1)[1]
    return "." + name[1:] if name.startswith("_") else name


def working_copy(pristine: Path, root: Path) -> KeywordIndex:
    """A private, writable copy of a pristine index (segment files hard-linked, metadata copied)."""
    path = Path(tempfile.mkdtemp(prefix="copy-", dir=root))
    for name in os.listdir(pristine):
        if name == ".complete":
            continue
        source = pristine / name
        if name.endswith(".json"):  # tantivy replaces these (write + rename); copy them anyway
            shutil.copyfile(source, path / name)
        else:
            try:
                os.link(source, path / name)
            except OSError:  # another file system: copy
                shutil.copyfile(source, path / name)
    return KeywordIndex(path)
