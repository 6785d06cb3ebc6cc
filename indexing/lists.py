"""IVF lists stored for byte-range reads: a replica fetches only the lists a query probes.

A shard built with a compressed codec (``--codec sq8`` or ``sq4``: faiss's scalar
quantizer, 8 or 4 bits per dimension; ``pqM``: faiss's product quantizer, M bytes per
vector) is four files::

    shard-S-E.lists        per list, contiguous: its rows' codes (count × code_size bytes),
                           each row's 8-byte digest of its float32 vector, then what filters
                           read of each row: its ACL's number in the shard's table of distinct
                           ACLs (uint32) and a hash of its chunk id (int64)
    shard-S-E.vectors      the float32 vectors, row after row, in the same order
    shard-S-E.rows         the id map (row → chunk version and lineage): an Arrow IPC stream
                           of blocks of ``ROW_BLOCK`` rows, so a result's lineage is one block
                           fetched by range, not the whole map
    shard-S-E.table.npz    per list: byte offset of its block in .lists, first row, row count,
                           sha256 of the block; per row block: offset in .rows and sha256;
                           the id map's schema and the shard's distinct ACLs

A query on such a shard fetches the table once, then only the probed lists' blocks (codes
and filter columns together), the candidates' float vectors and the results' row blocks.
Shards of indexes built before the row blocks (format 2 and 3) keep a parquet id map
(``shard-S-E.ids.parquet``) fetched whole, and filter columns come from it.

Rows are sorted by list, so list ``l`` holds rows ``first[l] .. first[l] + count[l]`` and
needs no stored ids. A list block is checked against its sha256 when it arrives; a float
vector fetched by range for re-ranking is checked against its digest, which came inside
a checked block. Codes encode the vectors themselves (not residuals), so a list can be
searched without its centroid, and the codec's parameters (per-dimension minimum and
range; for PQ, each sub-space's 256 centroids) are one small file per build.

The resident lists stay plain numpy arrays that a byte budget can drop at any time
(faiss's own inverted lists cannot give memory back through Python); a query scans them
in place with faiss's IVF list scanner (``scan_runs``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol

import faiss
import numpy as np
import pyarrow as pa

from indexing.npy import load_arrays

#: scalar codec name → faiss scalar quantizer type ("flat": the float IVF of format 1)
CODECS: dict[str, int] = {
    "sq8": faiss.ScalarQuantizer.QT_8bit,
    "sq4": faiss.ScalarQuantizer.QT_4bit,
}
#: product-quantizer codecs: "pq" + bytes per vector (sub-quantizers of 8 bits each)
PQ_CODEC = re.compile(r"pq([1-9][0-9]*)")
PQ_BITS = 8
#: rows a product quantizer is trained on (faiss warns below 39 per centroid: 10k)
PQ_TRAIN_ROWS = 65_536
#: bytes of the digest kept per row (blake2b of its float32 vector)
DIGEST_BYTES = 8
#: bytes per row of a list block after the codes and digest: ACL number (uint32), chunk-id hash (int64)
COLUMN_BYTES = 12
#: rows of the id map per block read by range: a result's lineage costs one block (at the
#: Python docs' 292 bytes of text per chunk, about 10 KB compressed); the table keeps 40
#: bytes per block (offset and sha256), 0.6 bytes per row
ROW_BLOCK = 64


class ListIntegrityError(Exception):
    """A fetched list block or vector does not match what the index recorded."""


def pq_size(codec: str) -> int | None:
    """Sub-quantizers (bytes per vector) of a ``pqM`` codec, else None."""
    found = PQ_CODEC.fullmatch(codec)
    return int(found.group(1)) if found else None


def check_codec(codec: str, dim: int | None = None) -> None:
    """Refuse a codec this reader cannot build or search, or a PQ size that does not divide ``dim``."""
    m = pq_size(codec)
    if codec not in CODECS and m is None:
        raise ValueError(f"unknown codec {codec!r}; one of flat, {', '.join(CODECS)}, pqM (M bytes per vector).")
    if m is not None and dim is not None and dim % m:
        fits = [d for d in range(4, dim // 2 + 1) if dim % d == 0]
        raise ValueError(f"codec {codec!r}: {m} does not divide the dimension {dim}; pqM takes M in {fits}.")


def codec_dim(codec: str, trained: np.ndarray) -> int:
    """The vectors' dimension, from a codec's parameters (a PQ: 256 centroids of every
    sub-space, end to end; a scalar codec: a minimum and a range per dimension)."""
    return len(trained) // ((1 << PQ_BITS) if pq_size(codec) is not None else 2)


def quantizer(codec: str, trained: np.ndarray) -> Any:
    """faiss's quantizer for a codec with its trained parameters (``compute_codes``, ``code_size``)."""
    dim, m = codec_dim(codec, trained), pq_size(codec)
    params = np.ascontiguousarray(trained, np.float32)
    if m is not None:
        pq = faiss.ProductQuantizer(dim, m, PQ_BITS)
        faiss.copy_array_to_vector(params, pq.centroids)
        return pq
    sq = faiss.ScalarQuantizer(dim, CODECS[codec])
    faiss.copy_array_to_vector(params, sq.trained)
    return sq


class CodeRun(NamedTuple):
    """Codes of consecutive rows ``first ..`` of one list, or (``rows`` given) of the rows
    it names; row numbers may carry a shard in their high bits."""

    codes: np.ndarray
    first: int
    rows: np.ndarray | None = None


def scan_runs(
    codec: str, trained: np.ndarray, query: np.ndarray, runs: list[CodeRun], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k codes of ``runs`` nearest to one query: (distances, rows), best first, -1 rows
    (infinite distances) padding. faiss's own IVF list scanner reads each run's codes in
    place, into one heap: the distances faiss's IVF gives for the same codes, with no index
    built and nothing copied (a throwaway IVF of the probed lists cost a copy of every
    list and ~6 µs a list)."""
    index = _scan_index(codec, trained)
    scanner = index.get_InvertedListScanner(True, None, None)  # store_pairs: (run, offset) labels
    query = np.ascontiguousarray(query, np.float32)
    scanner.set_query(faiss.swig_ptr(query))
    dist = np.empty(k, np.float32)
    at = np.empty(k, np.int64)
    heap = faiss.float_maxheap_array_t()
    heap.nh, heap.k, heap.ids, heap.val = 1, k, faiss.swig_ptr(at), faiss.swig_ptr(dist)
    heap.heapify()
    for j, run in enumerate(runs):
        if len(run.codes):
            scanner.set_list(j, 0.0)  # codes are not residuals: no centroid, no coarse distance
            codes = np.ascontiguousarray(run.codes)
            scanner.scan_codes(len(codes), faiss.swig_ptr(codes), None, heap.val, heap.ids, k)
    heap.reorder()
    rows = np.full(k, -1, np.int64)
    found = np.flatnonzero(at >= 0)
    run_of, offset = at[found] >> 32, at[found] & 0xFFFFFFFF
    rows[found] = np.fromiter((r.first for r in runs), np.int64, len(runs))[run_of] + offset
    for j, run, off in zip(found.tolist(), run_of.tolist(), offset.tolist(), strict=True):
        named = runs[run].rows
        if named is not None:
            rows[j] = named[off]
    dist[rows < 0] = np.inf
    return dist, rows


_SCAN_INDEXES: OrderedDict[int, tuple[np.ndarray, Any]] = OrderedDict()
_SCAN_LOCK = threading.Lock()


def _scan_index(codec: str, trained: np.ndarray) -> Any:
    """An empty faiss IVF of the codec's codes of the vectors themselves (not residuals),
    the source of its list scanners; kept for the last few codecs' parameter arrays (the
    codec memo gives every shard of a build the same array; a PQ's copy is 384 KB)."""
    with _SCAN_LOCK:
        held = _SCAN_INDEXES.get(id(trained))
        if held is not None and held[0] is trained:
            return held[1]
    dim, m = codec_dim(codec, trained), pq_size(codec)
    quant = faiss.IndexFlatL2(dim)
    index: Any
    if m is not None:
        index = faiss.IndexIVFPQ(quant, dim, 1, m, PQ_BITS, faiss.METRIC_L2)
        index.by_residual = False
        index.pq = quantizer(codec, trained)  # SWIG copies the quantizer, its parameters included
    else:
        index = faiss.IndexIVFScalarQuantizer(quant, dim, 1, CODECS[codec], faiss.METRIC_L2, False)
        index.sq = quantizer(codec, trained)
    index.is_trained = True
    with _SCAN_LOCK:
        _SCAN_INDEXES[id(trained)] = (trained, index)
        while len(_SCAN_INDEXES) > LOADED_CODECS:
            _SCAN_INDEXES.popitem(last=False)
    return index


def train_codec(codec: str, minimum: np.ndarray, maximum: np.ndarray) -> np.ndarray:
    """A scalar codec's parameters from per-dimension bounds (what faiss's min-max training computes)."""
    check_codec(codec, len(minimum))
    sq = faiss.ScalarQuantizer(len(minimum), CODECS[codec])
    sq.train(np.stack([minimum, maximum]).astype(np.float32))
    return faiss.vector_to_array(sq.trained).astype(np.float32)


def train_pq(codec: str, sample: np.ndarray) -> np.ndarray:
    """A product quantizer's centroids (flat float32), trained on a sample of the vectors."""
    m = pq_size(codec)
    assert m is not None
    check_codec(codec, sample.shape[1])
    if len(sample) < 1 << PQ_BITS:
        raise ValueError(f"codec {codec!r} needs at least {1 << PQ_BITS} vectors to train; the lake has {len(sample)}.")
    pq = faiss.ProductQuantizer(sample.shape[1], m, PQ_BITS)
    pq.train(np.ascontiguousarray(sample, np.float32))
    return faiss.vector_to_array(pq.centroids).astype(np.float32)


def save_codec(codec: str, trained: np.ndarray) -> bytes:
    sink = io.BytesIO()
    np.savez(sink, codec=np.array(codec), trained=trained.astype(np.float32))
    return sink.getvalue()


#: builds' codecs kept parsed (and their PQ quantizers)
LOADED_CODECS = 8
_LOADED_CODECS: OrderedDict[str, tuple[str, np.ndarray]] = OrderedDict()
_LOADED_LOCK = threading.Lock()


def load_codec(raw: bytes, sha256: str | None = None) -> tuple[str, np.ndarray]:
    """(codec name, parameters) from a build's codec file (``sha256``: its digest, when the
    caller has verified the bytes against it). Every shard of a build names the same file:
    it is parsed once and its parameters shared (a PQ's are 256 × dim floats)."""
    digest = sha256 or hashlib.sha256(raw).hexdigest()
    with _LOADED_LOCK:
        if digest in _LOADED_CODECS:
            _LOADED_CODECS.move_to_end(digest)
            return _LOADED_CODECS[digest]
    z = load_arrays(raw)
    name = str(z["codec"])
    try:
        check_codec(name)
    except ValueError:
        raise ValueError(f"this reader does not know the codec {name!r}; upgrade streamrag.") from None
    trained = z["trained"]
    trained.setflags(write=False)
    with _LOADED_LOCK:
        # Shards opened side by side parse the file at once: all get the first one's
        # parameters, so that a reader sees one codec (it scans shards together by identity).
        found = _LOADED_CODECS.setdefault(digest, (name, trained))
        while len(_LOADED_CODECS) > LOADED_CODECS:
            _LOADED_CODECS.popitem(last=False)
    return found


def vector_digest(raw: bytes) -> bytes:
    """The digest a list block keeps of one row's float32 vector (its bytes)."""
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


def row_digests(vectors: np.ndarray) -> np.ndarray:
    """(n, DIGEST_BYTES) uint8: ``vector_digest`` of each float32 row."""
    rows = np.ascontiguousarray(vectors, dtype=np.float32)
    out = np.empty((len(rows), DIGEST_BYTES), np.uint8)
    for i, row in enumerate(rows):
        out[i] = np.frombuffer(vector_digest(row.tobytes()), np.uint8)
    return out


def key_hashes(chunk_ids: Iterable[str | None]) -> np.ndarray:
    """int64 hashes of chunk ids (blake2b, 8 bytes): what a list block keeps for the
    superseded-row filter. A collision can only hide a row, never show one."""
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b((c or "").encode(), digest_size=8).digest(), "little", signed=True)
         for c in chunk_ids), np.int64)  # fmt: skip


def row_columns(rows: pa.Table) -> tuple[np.ndarray, np.ndarray, bytes]:
    """(ACL numbers uint32, chunk-id hashes int64, the distinct ACLs as JSON) of an id map's rows."""
    numbers: dict[Any, int] = {}
    distinct: list[Any] = []
    codes = np.empty(rows.num_rows, np.uint32)
    acl = rows.column("acl").to_pylist() if "acl" in rows.column_names else [None] * rows.num_rows
    for i, value in enumerate(acl):
        key = None if value is None else tuple(value)
        if key not in numbers:
            numbers[key] = len(distinct)
            distinct.append(value)
        codes[i] = numbers[key]
    return codes, key_hashes(rows.column("chunk_id").to_pylist()), json.dumps(distinct).encode()


#: how a ``.rows`` file stores its row blocks: "zstd" (written since format 5), each block an
#: uncompressed Arrow IPC message compressed whole (``<u32 message bytes>`` + zstd); "" (format
#: 4), each a message whose buffers Arrow compressed one by one. Whole blocks take half the
#: bytes and a tenth of the CPU to read (41 against 394 µs a 64-row block here: Arrow makes a
#: zstd context for each of a block's ~50 buffers).
ROW_CODEC = "zstd"
_ZSTD = pa.Codec("zstd")
_BLOCK_HEADER = struct.Struct("<I")


def encode_rows(rows: pa.Table, row_codec: str = ROW_CODEC) -> tuple[bytes, np.ndarray, np.ndarray, bytes]:
    """(``.rows`` bytes, block offsets (blocks + 1), block sha256s, schema) of an id map: the
    schema as an Arrow IPC stream's start, then each block of ``ROW_BLOCK`` rows as one
    message, stored as ``row_codec`` says (see ``ROW_CODEC``)."""
    rows = rows.combine_chunks()
    for f in rows.schema:
        if pa.types.is_dictionary(f.type):
            rows = rows.set_column(rows.schema.get_field_index(f.name), f.name, rows.column(f.name).dictionary_decode())
    sink = pa.BufferOutputStream()
    per_buffer = pa.ipc.IpcWriteOptions(compression="zstd" if row_codec == "" else None)
    writer = pa.ipc.new_stream(sink, rows.schema, options=per_buffer)
    writer.write_batch(pa.RecordBatch.from_pylist([], schema=rows.schema))  # the schema goes out with it
    offsets = [sink.tell()]
    for lo in range(0, rows.num_rows, ROW_BLOCK):
        (batch,) = rows.slice(lo, ROW_BLOCK).to_batches() or [pa.RecordBatch.from_pylist([], schema=rows.schema)]
        writer.write_batch(batch)
        offsets.append(sink.tell())
    writer.close()
    raw = sink.getvalue()
    if row_codec == "":  # format 4: the file is the IPC stream itself
        blob, bounds = raw.to_pybytes(), offsets
    else:
        parts = [raw[: offsets[0]].to_pybytes()]
        bounds = [offsets[0]]
        for a, b in itertools.pairwise(offsets):
            parts.append(_BLOCK_HEADER.pack(b - a) + _ZSTD.compress(raw[a:b], asbytes=True))
            bounds.append(bounds[-1] + len(parts[-1]))
        parts.append(raw[offsets[-1] :].to_pybytes())  # the stream's end marker
        blob = b"".join(parts)
    sha = [np.frombuffer(hashlib.sha256(blob[a:b]).digest(), np.uint8) for a, b in itertools.pairwise(bounds)]
    schema = rows.schema.serialize().to_pybytes()
    return blob, np.asarray(bounds, np.int64), np.stack(sha) if sha else np.zeros((0, 32), np.uint8), schema


def read_block(blob: bytes, schema: pa.Schema, row_codec: str) -> pa.RecordBatch:
    """One row block of a ``.rows`` file, stored as ``row_codec`` says."""
    if row_codec == "zstd":
        (size,) = _BLOCK_HEADER.unpack_from(blob)
        message = _ZSTD.decompress(memoryview(blob)[_BLOCK_HEADER.size :], size, asbytes=False)
    elif row_codec == "":
        message = pa.py_buffer(blob)
    else:
        raise ListIntegrityError(f"row blocks stored as {row_codec!r}, which this reader does not know")
    return pa.ipc.read_record_batch(pa.ipc.read_message(message), schema)


def decode_id_map(
    raw: bytes, blocked: bool, columns: list[str] | None = None, table: ListTable | None = None
) -> pa.Table:
    """A whole id map: a ``.rows`` file of row blocks (``blocked``; ``table`` locates them) or
    a parquet file."""
    if blocked:
        assert table is not None
        if table.row_codec:
            schema = pa.ipc.read_schema(pa.py_buffer(table.schema))
            bounds = table.row_offsets.tolist()
            batches = [read_block(raw[a:b], schema, table.row_codec) for a, b in itertools.pairwise(bounds)]
            found = pa.Table.from_batches(batches, schema=schema)
        else:  # format 4: the file is one IPC stream
            found = pa.ipc.open_stream(pa.py_buffer(raw)).read_all()
        return found.select([c for c in columns if c in found.column_names]) if columns else found
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(raw), columns=columns)


@dataclass(frozen=True)
class ListTable:
    """Where each list of a shard lies: block offset in ``.lists``, first row, rows, sha256;
    with ``columns``, each list block carries its rows' filter columns, and ``row_offsets``,
    ``row_sha256`` and ``schema`` locate and check the id map's row blocks in ``.rows``."""

    list_start: int
    offsets: np.ndarray  # int64, one per list of the shard
    firsts: np.ndarray  # int64
    counts: np.ndarray  # int64
    sha256: np.ndarray  # (lists, 32) uint8
    code_size: int
    columns: bool = False
    row_offsets: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    row_sha256: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 32), np.uint8))
    schema: bytes = b""
    acls: bytes = b"[]"  # the shard's distinct ACLs (JSON), which the filter columns number
    row_codec: str = ""  # how ``.rows`` stores its blocks (ROW_CODEC)

    def to_bytes(self) -> bytes:
        sink = io.BytesIO()
        extra: dict[str, Any] = {}
        if self.columns:
            extra = dict(columns=True, row_offsets=self.row_offsets, row_sha256=self.row_sha256,
                         schema=np.frombuffer(self.schema, np.uint8),
                         acls=np.frombuffer(self.acls, np.uint8))  # fmt: skip
            if self.row_codec:
                extra["row_codec"] = np.frombuffer(self.row_codec.encode(), np.uint8)
        np.savez(sink, list_start=self.list_start, offsets=self.offsets, firsts=self.firsts, counts=self.counts,
                 sha256=self.sha256, code_size=self.code_size, **extra)  # fmt: skip
        return sink.getvalue()

    @classmethod
    def from_bytes(cls, raw: bytes) -> ListTable:
        z = load_arrays(raw)
        base = (int(z["list_start"]), z["offsets"], z["firsts"], z["counts"], z["sha256"], int(z["code_size"]))
        if "columns" not in z:
            return cls(*base)
        row_codec = z["row_codec"].tobytes().decode() if "row_codec" in z else ""
        return cls(*base, True, z["row_offsets"], z["row_sha256"], z["schema"].tobytes(), z["acls"].tobytes(),
                   row_codec)  # fmt: skip

    @property
    def row_bytes(self) -> int:
        """Bytes per row of a list block."""
        return self.code_size + DIGEST_BYTES + (COLUMN_BYTES if self.columns else 0)

    def span(self, list_no: int) -> tuple[int, int]:
        """(offset, bytes) of a list's block in ``.lists``."""
        i = list_no - self.list_start
        return int(self.offsets[i]), int(self.counts[i]) * self.row_bytes

    def list_of(self, rows: np.ndarray) -> np.ndarray:
        """The list number holding each row."""
        return np.searchsorted(self.firsts, rows, side="right") - 1 + self.list_start

    @property
    def nbytes(self) -> int:
        return int(self.offsets.nbytes + self.firsts.nbytes + self.counts.nbytes + self.sha256.nbytes
                   + self.row_offsets.nbytes + self.row_sha256.nbytes + len(self.schema) + len(self.acls))  # fmt: skip


def encode_lists(
    vectors: np.ndarray,
    labels: np.ndarray,
    start: int,
    end: int,
    codec: str,
    trained: np.ndarray,
    rows: pa.Table | None = None,
) -> tuple[bytes, bytes, ListTable, bytes | None]:
    """(``.lists`` bytes, ``.vectors`` bytes, table, ``.rows`` bytes) for rows already sorted
    by list; without the id map ``rows``, the list blocks carry no filter columns and there
    is no ``.rows`` file (the layout of format 2)."""
    sq = quantizer(codec, trained)
    codes = sq.compute_codes(np.ascontiguousarray(vectors, np.float32)).reshape(len(vectors), -1)
    digests = row_digests(vectors)
    columns = row_columns(rows) if rows is not None else None
    bounds = np.searchsorted(labels, np.arange(start, end + 1))
    blocks, offsets, sha = [], [], []
    offset = 0
    for lo, hi in itertools.pairwise(bounds):
        block = codes[lo:hi].tobytes() + digests[lo:hi].tobytes()
        if columns is not None:
            block += columns[0][lo:hi].tobytes() + columns[1][lo:hi].tobytes()
        blocks.append(block)
        offsets.append(offset)
        sha.append(np.frombuffer(hashlib.sha256(block).digest(), np.uint8))
        offset += len(block)
    table = ListTable(
        start,
        np.asarray(offsets, np.int64),
        bounds[:-1].astype(np.int64),
        np.diff(bounds).astype(np.int64),
        np.stack(sha) if sha else np.zeros((0, 32), np.uint8),
        int(sq.code_size),
    )
    floats = np.ascontiguousarray(vectors, np.float32).tobytes()
    if rows is None or columns is None:
        return b"".join(blocks), floats, table, None
    blob, row_offsets, row_sha, schema = encode_rows(rows, ROW_CODEC)
    table = dataclasses.replace(table, columns=True, row_offsets=row_offsets, row_sha256=row_sha, schema=schema,
                                acls=columns[2], row_codec=ROW_CODEC)  # fmt: skip
    return b"".join(blocks), floats, table, blob


# -- the reader's side ---------------------------------------------------------------


class ByteBudget:
    """An LRU of entries with sizes; past ``max_bytes`` the least recently used are dropped
    (each through its own callback). The newest entry stays even if it alone is larger."""

    def __init__(
        self,
        max_bytes: int,
        on_change: Callable[[int], None] | None = None,
        on_evict: Callable[[Hashable], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self.held = 0
        self._entries: OrderedDict[Hashable, tuple[int, Callable[[], None]]] = OrderedDict()
        self._lock = threading.Lock()
        self._on_change = on_change
        self.evictions = 0

    def admit(self, key: Hashable, nbytes: int, evict: Callable[[], None]) -> None:
        dropped: list[tuple[Hashable, Callable[[], None]]] = []
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = (nbytes, evict)
            self.held += nbytes
            while self.held > self.max_bytes and len(self._entries) > 1:
                key_out, (size, drop) = self._entries.popitem(last=False)
                self.held -= size
                self.evictions += 1
                dropped.append((key_out, drop))
            held = self.held
        for key_out, drop in dropped:  # outside the lock: a callback may forget other entries
            drop()
            if self._on_evict is not None:
                self._on_evict(key_out)
        if self._on_change is not None:
            self._on_change(held)

    def touch(self, *keys: Hashable) -> None:
        """The entries were used: they leave the eviction order's end (one lock for all)."""
        with self._lock:
            entries = self._entries
            for key in keys:
                if key in entries:
                    entries.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        with self._lock:
            found = self._entries.pop(key, None)
            if found is not None:
                self.held -= found[0]
            held = self.held
        if found is not None and self._on_change is not None:
            self._on_change(held)


@dataclass
class Fetched:
    """What one call moved from the store: requests and bytes (list blocks and vectors)."""

    requests: int = 0
    bytes: int = 0

    def add(self, requests: int, nbytes: int) -> None:
        self.requests += requests
        self.bytes += nbytes


class RangeRead(Protocol):
    """(start, length) ranges of one file → their bytes in order, requests made, bytes moved.

    ``fresh=True`` bypasses any local copy (a range that failed its check is read again)."""

    def __call__(self, ranges: list[tuple[int, int]], fresh: bool = False) -> tuple[list[bytes], int, int]: ...


class ListData(NamedTuple):
    """A resident list: its rows' codes and vector digests; with filter columns, their ACL
    numbers and chunk-id hashes (empty for a list of the older layout)."""

    codes: np.ndarray
    digests: np.ndarray
    acl: np.ndarray
    keys: np.ndarray


_NO_ACL = np.zeros(0, np.uint32)
_NO_KEYS = np.zeros(0, np.int64)


class ResidentLists:
    """The lists of one shard that are in memory, fetched by range on demand.

    ``fetch_blocks(ranges)`` and ``fetch_vectors(ranges)`` read byte ranges of the shard's
    ``.lists`` and ``.vectors`` files, ``fetch_rows`` of its ``.rows`` id map (the reader
    binds them to its store and pool).
    """

    def __init__(
        self,
        table: ListTable,
        codec: str,
        trained: np.ndarray,
        fetch_blocks: RangeRead,
        fetch_vectors: RangeRead,
        budget: ByteBudget | None = None,
        key: Hashable = None,
        fetch_rows: RangeRead | None = None,
    ) -> None:
        self.table = table
        self.codec = codec
        self.trained = trained
        self.dim = codec_dim(codec, trained)
        self._fetch_blocks = fetch_blocks
        self._fetch_vectors = fetch_vectors
        self._fetch_rows = fetch_rows
        self._budget = budget
        self._key = key
        self._lists: dict[int, ListData] = {}
        self._inflight: dict[int, Future[ListData]] = {}  # lists being fetched
        self._blocks: dict[int, pa.RecordBatch] = {}  # id-map row blocks in memory
        self._schema: pa.Schema | None = None
        self._acls: pa.Array | None = None
        self._lock = threading.Lock()
        self.fetched = Fetched()  # since the shard was opened

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(sum(part.nbytes for part in data) for data in self._lists.values())

    def resident(self, list_no: int) -> bool:
        with self._lock:
            return list_no in self._lists

    def holds(self, wanted: list[int]) -> bool:
        """Whether every non-empty list of ``wanted`` is in memory (a peek: no fetch, no LRU touch)."""
        start, counts = self.table.list_start, self.table.counts
        with self._lock:
            return all(n in self._lists or counts[n - start] == 0 for n in wanted)

    def lists(self, wanted: list[int], moved: Fetched | None = None) -> dict[int, ListData]:
        """(codes, digests) of each wanted list: resident ones at once, the others fetched
        (one ranged read per run of neighbouring lists) and checked against the table. A list
        another query is already fetching is waited for, not fetched twice."""
        found: dict[int, ListData] = {}
        claimed: dict[int, Future[ListData]] = {}
        awaited: dict[int, Future[ListData]] = {}
        with self._lock:
            for list_no in dict.fromkeys(wanted):
                if list_no in self._lists:
                    found[list_no] = self._lists[list_no]
                elif list_no in self._inflight:
                    awaited[list_no] = self._inflight[list_no]
                elif self.table.counts[list_no - self.table.list_start] > 0:
                    claimed[list_no] = self._inflight[list_no] = Future()
        if found and self._budget is not None:
            self._budget.touch(*((self._key, list_no) for list_no in found))
        if claimed:
            try:
                found.update(self._fetch_lists(list(claimed), moved))
            except BaseException as exc:
                for future in claimed.values():
                    future.set_exception(exc)
                raise
            finally:
                with self._lock:
                    for list_no in claimed:
                        self._inflight.pop(list_no, None)
            for list_no, future in claimed.items():
                future.set_result(found[list_no])
        for list_no, future in awaited.items():
            found[list_no] = future.result()
        return found

    def _fetch_lists(self, missing: list[int], moved: Fetched | None) -> dict[int, ListData]:
        spans = [self.table.span(n) for n in missing]
        blobs = self._read(self._fetch_blocks, spans, lambda at, blob: self._list_ok(missing[at], blob), moved)
        cs = self.table.code_size
        found = {}
        for list_no, blob in zip(missing, blobs, strict=True):
            if blob is None:
                raise ListIntegrityError(f"list {list_no} does not match its sha256 in the index; refusing to use it.")
            n = int(self.table.counts[list_no - self.table.list_start])
            raw = np.frombuffer(blob, np.uint8)
            end = n * (cs + DIGEST_BYTES)
            codes, digests = raw[: n * cs].reshape(n, cs), raw[n * cs : end].reshape(n, DIGEST_BYTES)
            data = ListData(codes, digests, _NO_ACL, _NO_KEYS)
            if self.table.columns:
                data = data._replace(acl=raw[end : end + 4 * n].view(np.uint32), keys=raw[end + 4 * n :].view(np.int64))
            found[list_no] = data
            with self._lock:
                self._lists.setdefault(list_no, data)
            if self._budget is not None:
                self._budget.admit((self._key, list_no), len(blob), partial(self.drop, list_no))
        return found

    def _list_ok(self, list_no: int, blob: bytes) -> bool:
        i = list_no - self.table.list_start
        if len(blob) != self.table.span(list_no)[1]:
            return False
        return bool(hashlib.sha256(blob).digest() == self.table.sha256[i].tobytes())

    def _read(
        self,
        fetch: RangeRead,
        ranges: list[tuple[int, int]],
        ok: Callable[[int, bytes], bool],
        moved: Fetched | None,
    ) -> list[bytes | None]:
        """Each range's bytes once checked by ``ok``, else None. A range that fails its check
        is read once more with ``fresh=True`` (past a local disk tier, from the store itself)."""
        got, requests, nbytes = fetch(ranges)
        blobs = [b if ok(i, b) else None for i, b in enumerate(got)]
        bad = [i for i, b in enumerate(blobs) if b is None]
        if bad:
            again, r2, n2 = fetch([ranges[i] for i in bad], fresh=True)
            requests, nbytes = requests + r2, nbytes + n2
            for i, blob in zip(bad, again, strict=True):
                blobs[i] = blob if ok(i, blob) else None
        self.fetched.add(requests, nbytes)
        if moved is not None:
            moved.add(requests, nbytes)
        return blobs

    def drop(self, list_no: int) -> None:
        with self._lock:
            self._lists.pop(list_no, None)

    def drop_all(self) -> None:
        """Forget every resident list and row block (the shard itself left the cache)."""
        with self._lock:
            numbers = list(self._lists)
            blocks = list(self._blocks)
            self._lists.clear()
            self._blocks.clear()
        if self._budget is not None:
            for list_no in numbers:
                self._budget.forget((self._key, list_no))
            for block in blocks:
                self._budget.forget((self._key, "rows", block))
            self._budget.forget((self._key, "ids"))  # a whole id map, if one was fetched

    # -- the filter columns and the id map (a table with ``columns``) --------------------

    def columns_of(self, lists: Mapping[int, ListData]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, ACL numbers, chunk-id hashes) of the given lists: those a query fetched,
        which stay in its hands if the budget drops them meanwhile."""
        if not lists:
            return np.zeros(0, np.int64), np.zeros(0, np.uint32), np.zeros(0, np.int64)
        firsts = self.table.firsts[np.fromiter(lists, np.int64, len(lists)) - self.table.list_start].tolist()
        rows = [np.arange(f, f + len(d.acl), dtype=np.int64) for f, d in zip(firsts, lists.values(), strict=True)]
        acl = np.concatenate([d.acl for d in lists.values()])
        return np.concatenate(rows), acl, np.concatenate([d.keys for d in lists.values()])

    def acls(self) -> pa.Array:
        """The shard's distinct ACLs (list<string>), in the order the ACL numbers count."""
        if self._acls is None:
            self._acls = pa.array(json.loads(self.table.acls), pa.list_(pa.string()))
        return self._acls

    def records(self, rows: np.ndarray, moved: Fetched | None = None, columns: list[str] | None = None) -> pa.Table:
        """The id map's rows ``rows``, in that order (``columns`` of them, those the layout
        has): each one's row block fetched by range (blocks already in memory are not),
        checked against its sha256 in the table."""
        assert self._fetch_rows is not None and self.table.columns
        if self._schema is None:
            self._schema = pa.ipc.read_schema(pa.py_buffer(self.table.schema))
        wanted = sorted({int(r) // ROW_BLOCK for r in rows})
        with self._lock:
            have = {b: self._blocks[b] for b in wanted if b in self._blocks}
        if have and self._budget is not None:
            self._budget.touch(*((self._key, "rows", b) for b in have))
        missing = [b for b in wanted if b not in have]
        if missing:
            offsets = self.table.row_offsets
            spans = [(int(offsets[b]), int(offsets[b + 1] - offsets[b])) for b in missing]

            def ok(at: int, blob: bytes) -> bool:
                digest = self.table.row_sha256[missing[at]].tobytes()
                return len(blob) == spans[at][1] and hashlib.sha256(blob).digest() == digest

            for b, blob in zip(missing, self._read(self._fetch_rows, spans, ok, moved), strict=True):
                if blob is None:
                    raise ListIntegrityError(f"row block {b} does not match its sha256 in the index; refusing it.")
                batch = read_block(blob, self._schema, self.table.row_codec)
                have[b] = batch
                with self._lock:
                    self._blocks.setdefault(b, batch)
                if self._budget is not None:
                    self._budget.admit((self._key, "rows", b), len(blob), partial(self._drop_block, b))
        at = {b: i for i, b in enumerate(wanted)}
        table = pa.Table.from_batches([have[b] for b in wanted], schema=self._schema)
        if columns is not None:
            table = table.select([c for c in columns if c in self._schema.names])
        firsts = np.cumsum([0] + [have[b].num_rows for b in wanted])
        picked = [int(firsts[at[int(r) // ROW_BLOCK]]) + int(r) % ROW_BLOCK for r in rows]
        return table.take(pa.array(picked, pa.int64()))

    def _drop_block(self, block: int) -> None:
        with self._lock:
            self._blocks.pop(block, None)

    def id_map(self, size: int, sha256: str, moved: Fetched | None = None) -> pa.Table:
        """The whole id map (a filter that needs every row's metadata), in one read checked
        against the file's sha256 in the manifest."""
        assert self._fetch_rows is not None

        def ok(_: int, blob: bytes) -> bool:
            return len(blob) == size and hashlib.sha256(blob).hexdigest() == sha256

        (blob,) = self._read(self._fetch_rows, [(0, size)], ok, moved)
        if blob is None:
            raise ListIntegrityError("the id map does not match its sha256 in the manifest; refusing to use it.")
        return decode_id_map(blob, True, table=self.table)

    def local_vectors(self, rows: np.ndarray, digests: np.ndarray) -> np.ndarray | None:
        """The float32 vectors of rows if a local copy (a disk tier) holds all of them and
        each matches its digest, else None: read here, with no request and no thread hop."""
        read_local = getattr(self._fetch_vectors, "read_local", None)
        width = self.dim * 4
        blobs = read_local([(int(r) * width, width) for r in rows]) if read_local is not None else None
        if blobs is None:
            return None
        for blob, digest in zip(blobs, digests, strict=True):
            if vector_digest(blob) != digest.tobytes():
                return None  # the caller's ``vectors`` reads it again, from the store
        return np.frombuffer(b"".join(blobs), np.float32).reshape(len(rows), self.dim)

    def vectors(self, rows: np.ndarray, digests: np.ndarray, moved: Fetched | None = None) -> np.ndarray:
        """The float32 vectors of rows, fetched by range, each checked against its digest."""
        width = self.dim * 4

        def ok(at: int, blob: bytes) -> bool:
            return len(blob) == width and vector_digest(blob) == digests[at].tobytes()

        checked = []
        for i, blob in enumerate(self._read(self._fetch_vectors, [(int(r) * width, width) for r in rows], ok, moved)):
            if blob is None:
                raise ListIntegrityError(f"vector of row {int(rows[i])} does not match its digest; refusing to use it.")
            checked.append(blob)
        return np.frombuffer(b"".join(checked), np.float32).reshape(len(rows), self.dim)

    def digests_of(self, rows: np.ndarray, lists: Mapping[int, ListData]) -> np.ndarray:
        """The digests of rows whose lists are in ``lists`` (fetched meanwhile if not)."""
        list_nos = self.table.list_of(rows)
        numbers = np.unique(list_nos).tolist()
        need = [n for n in numbers if n not in lists]
        if need:
            lists = {**lists, **self.lists(need)}
        offsets = rows - self.table.firsts[list_nos - self.table.list_start]
        out = np.empty((len(rows), DIGEST_BYTES), np.uint8)
        for n in numbers:  # a list's rows at once
            mine = list_nos == n
            out[mine] = lists[n].digests[offsets[mine]]
        return out
