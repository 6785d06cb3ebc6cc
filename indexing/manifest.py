"""Index versions in object storage, published atomically.

Layout under the index URI::

    builds/<build-id>/centroids.npy           written first
    builds/<build-id>/shard-00000.faiss       IVF lists [a, b) of the coarse quantizer
    builds/<build-id>/shard-00000.ids.parquet faiss id → chunk version and lineage
                                              (a compressed shard: ``.lists``, ``.vectors``,
                                              ``.rows``, ``.table.npz``; see ``indexing.lists``)
    versions/00000007.json                    the manifest: written last, if absent
    LATEST                                    "7": a hint, advanced after the manifest

An incremental build (``indexing.incremental``) writes only a delta: its manifest names
the unchanged shards of earlier builds (no copy), each with the ids of its rows that are
dead in this version, plus delta shards of the chunk versions added since. A file
belongs to every version that names it, whichever build wrote it.

A version exists once its manifest exists, and a manifest is only written after every
file it names; claiming a number uses put-if-absent, so two builders can't both publish
version 7. Readers take the greatest manifest number (``LATEST`` only saves a listing),
so a builder killed anywhere leaves readers on the previous complete version.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from indexing.store import AlreadyExists, NotFound, ObjectStore

log = logging.getLogger(__name__)


def default_nprobe(nlist: int) -> int:
    """The lists a reader probes per query unless told otherwise (``serve --nprobe``), and
    what a build chooses its list assignment for: 16% of the lists, at least 32, at most 128.

    Measured on real embeddings (the Python docs, 40k chunks, nlist 802, section titles as
    queries): recall@10 vs exact is 0.89 at nprobe 32 and 0.954 at 128 (16%); short queries
    sit far from the documents they match, so a fixed small nprobe is not enough.
    """
    return max(1, min(nlist, max(32, min(128, -(-nlist * 16 // 100)))))


FORMAT_VERSION = 1  # float IVF shards: what every reader since the first understands
#: compressed, list-granular shards (``indexing.lists``): older readers refuse them cleanly
RANGED_FORMAT_VERSION = 2
#: shards shared with earlier builds, with per-version dead rows and delta shards: a reader
#: that ignored the dead rows would serve deleted and superseded chunks, so older ones refuse it
INCREMENTAL_FORMAT_VERSION = 3
#: compressed shards whose id map is row blocks read by range (``.rows``) and whose list
#: blocks carry the filter columns: an older reader would parse the id map as parquet
ROW_BLOCKS_FORMAT_VERSION = 4
#: row blocks compressed whole (``ShardRef.row_codec``): a reader of format 4 would take
#: them for Arrow IPC messages
ROW_CODEC_FORMAT_VERSION = 5
KNOWN_FORMATS = (
    FORMAT_VERSION, RANGED_FORMAT_VERSION, INCREMENTAL_FORMAT_VERSION, ROW_BLOCKS_FORMAT_VERSION,
    ROW_CODEC_FORMAT_VERSION,
)  # fmt: skip
_VERSION_KEY = re.compile(r"^versions/(\d{8})\.json$")


class ManifestError(Exception):
    """No usable index version, or a manifest that does not match its files."""


@dataclass(frozen=True)
class FileRef:
    key: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardRef:
    """One shard's files. A float shard (codec "flat") is one faiss IVF file (``index``); a
    compressed one (``indexing.lists``) is ``index`` = its ``.lists`` file, read by range
    through ``table``, with ``vectors`` for exact re-ranking and ``codec`` its parameters."""

    index: FileRef
    ids: FileRef
    list_start: int  # first IVF list in the shard
    list_end: int  # one past the last
    count: int
    table: FileRef | None = None
    vectors: FileRef | None = None
    codec: FileRef | None = None
    #: the rows' chunk ids in faiss-id order (parquet): what an incremental build matches changes against
    keys: FileRef | None = None
    #: faiss ids of rows dead in this version (int64 .npy, sorted): chunks deleted or changed since the
    #: build that wrote the shard. Per version: versions that share a shard name their own.
    dead: FileRef | None = None
    dead_count: int = 0
    #: written by an incremental build: rows of chunks changed since the base build, any lists
    delta: bool = False
    #: ``ids`` is a ``.rows`` file of row blocks read by range (``indexing.lists``), not a
    #: parquet id map fetched whole
    id_blocks: bool = False
    #: how the ``.rows`` file stores its blocks ("": format 4; else ``indexing.lists.ROW_CODEC``)
    row_codec: str = ""

    @property
    def live(self) -> int:
        return self.count - self.dead_count

    @property
    def ranged(self) -> bool:
        """Lists fetched by byte range (a compressed shard), not the whole file."""
        return self.table is not None

    def files(self) -> list[FileRef]:
        return [
            f
            for f in (self.index, self.ids, self.table, self.vectors, self.codec, self.keys, self.dead)
            if f is not None
        ]

    def opened(self) -> list[FileRef]:
        """The files that opening the shard fetches whole: a ranged shard's list table, codec
        and (unless it is row blocks, read by range) id map, else the index and the id map.
        Its lists come later, by range."""
        if self.ranged:
            assert self.table is not None and self.codec is not None
            return [self.table, self.codec] if self.id_blocks else [self.table, self.ids, self.codec]
        return [self.index, self.ids]


@dataclass
class Manifest:
    version: int
    build_id: str
    created_at: str
    lake_uri: str
    lake_version: int
    model: str
    dim: int
    metric: str
    nlist: int
    count: int
    centroids: FileRef
    shards: list[ShardRef]
    stats: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: each lake writer's last commit number at ``lake_version`` (empty in older manifests)
    writer_seqs: dict[str, int] = field(default_factory=dict)
    #: how vectors are stored in the shards: "flat" (float32 IVF) or a ``indexing.lists`` codec
    codec: str = "flat"
    #: the full build whose (non-delta) shards this version uses: its index version once published
    #: (None: this version is a full build), and its writers' last commit numbers
    base_version: int | None = None
    base_writer_seqs: dict[str, int] = field(default_factory=dict)
    #: chunk rows without a writer tag in the snapshot (older lakes): a change among them is
    #: invisible to ``writer_seqs``, so an incremental build requires the same number
    untagged_rows: int = 0
    #: the keyword (BM25) index's files (``indexing.keyword``; an incremental version names its
    #: base's); empty for versions built before keyword indexes existed
    keyword: list[FileRef] = field(default_factory=list)

    @classmethod
    def of_snapshot(cls, snap: Any, build_id: str, **build: Any) -> Manifest:
        """A new manifest (version 0 until published) of a lake snapshot
        (``indexing.snapshot.Snapshot``): what the snapshot says, and the build's own ``build`` fields."""
        return cls(version=0, build_id=build_id, created_at=datetime.now(UTC).isoformat(), lake_uri=snap.lake.uri,
                   lake_version=snap.version, model=snap.model, dim=snap.dim, count=snap.count,
                   writer_seqs=snap.writer_seqs, untagged_rows=snap.untagged_rows, **build)  # fmt: skip

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        obj = json.loads(raw)
        if obj.get("format_version") not in KNOWN_FORMATS:
            raise ManifestError(
                f"manifest format {obj.get('format_version')} is not one this reader knows "
                f"({', '.join(map(str, KNOWN_FORMATS))}): upgrade streamrag."
            )
        obj["centroids"] = FileRef(**obj["centroids"])

        def ref(raw: dict[str, Any] | None) -> FileRef | None:
            return FileRef(**raw) if raw is not None else None

        obj["shards"] = [
            ShardRef(
                FileRef(**s["index"]),
                FileRef(**s["ids"]),
                s["list_start"],
                s["list_end"],
                s["count"],
                ref(s.get("table")),
                ref(s.get("vectors")),
                ref(s.get("codec")),
                ref(s.get("keys")),
                ref(s.get("dead")),
                s.get("dead_count", 0),
                s.get("delta", False),
                s.get("id_blocks", False),
                s.get("row_codec", ""),
            )
            for s in obj["shards"]
        ]
        obj["keyword"] = [FileRef(**f) for f in obj.get("keyword", [])]
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})  # newer writers' extra keys are ignored

    def files(self) -> list[FileRef]:
        """Every file this version names (its own build's and earlier builds' it shares)."""
        return [self.centroids, *(f for s in self.shards for f in s.files()), *self.keyword]


def sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def put_file(store: ObjectStore, key: str, data: bytes | bytearray | memoryview) -> FileRef:
    store.put(key, data)
    return FileRef(key, len(data), sha256(data))


def get_verified(store: ObjectStore, ref: FileRef) -> bytes:
    data = store.get(ref.key)
    if len(data) != ref.bytes or sha256(data) != ref.sha256:
        raise ManifestError(f"{store.uri(ref.key)} does not match its manifest checksum; refusing to use it.")
    return data


def versions(store: ObjectStore) -> list[int]:
    found = []
    for key in store.list("versions/"):
        match = _VERSION_KEY.match(key)
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def latest_version(store: ObjectStore) -> int | None:
    found = versions(store)
    return found[-1] if found else None


def load_manifest(store: ObjectStore, version: int | None = None) -> Manifest:
    """The manifest of ``version``, or of the newest complete version."""
    if version is None:
        version = latest_version(store)
        if version is None:
            raise ManifestError(f"no index version under {store.root}; run `streamrag index build` first.")
    try:
        return Manifest.from_json(store.get(f"versions/{version:08d}.json"))
    except NotFound as exc:
        raise ManifestError(f"index version {version} does not exist under {store.root}.") from exc


def publish(store: ObjectStore, manifest: Manifest) -> int:
    """Claim the next version number for a manifest whose files are all written.

    A number found taken is either another builder's (take the next one) or our own put
    that landed although its answer was lost (a timeout, a dropped connection): then the
    version is already published, and publishing it again would make a duplicate.
    """
    _check_shared(store, manifest)
    number = (latest_version(store) or 0) + 1
    while True:
        manifest.version = number
        try:
            store.put(f"versions/{number:08d}.json", manifest.to_json(), if_absent=True)
            break
        except AlreadyExists:
            if load_manifest(store, number).build_id == manifest.build_id:
                log.info("version %d is already this build's manifest (a retried put had landed)", number)
                break
            number += 1  # another builder published meanwhile: take the next number
    store.put("LATEST", str(number).encode())
    log.info("published index version %d (%d vectors, %d shards)", number, manifest.count, len(manifest.shards))
    return number


def _check_shared(store: ObjectStore, manifest: Manifest) -> None:
    """Every file the manifest shares with earlier builds is still there (one listing per
    build): garbage collection may have deleted an old base while this build ran."""
    by_build: dict[str, set[str]] = {}
    for ref in manifest.files():
        parts = ref.key.split("/")
        if len(parts) >= 3 and parts[0] == "builds" and parts[1] != manifest.build_id:
            by_build.setdefault(parts[1], set()).add(ref.key)
    for build, keys in by_build.items():
        missing = keys - set(store.list(f"builds/{build}/"))
        if missing:
            raise ManifestError(
                f"{len(missing)} files of build {build} that this version shares are gone "
                f"(e.g. {store.uri(sorted(missing)[0])}); not publishing it: build again."
            )


#: how long a version replaced by a newer one is kept before garbage collection may delete it
DEFAULT_GC_GRACE_S = 900.0


def collect_garbage(
    store: ObjectStore, keep: int, grace_s: float = DEFAULT_GC_GRACE_S, now: datetime | None = None
) -> list[int]:
    """Delete all but the newest ``keep`` versions and their files; return deleted versions.

    A file goes only when no kept version names it: incremental versions share the shards
    of earlier builds.

    A version is deleted only once ``grace_s`` seconds have passed since the version that
    replaced it (the next newer one) was built: replicas switch to a new version within
    their index poll (5 s) plus the time to prefetch it, and go on serving the old one
    meanwhile, and ``as_of`` requests that already chose it finish on it. Deleting it under
    them would turn their searches into errors. Its manifest goes first, then its files.
    """
    if keep < 1:
        raise ManifestError("--keep must be at least 1.")
    if grace_s < 0:
        raise ManifestError("the garbage-collection grace period must be >= 0 seconds.")
    now = now or datetime.now(UTC)
    numbers = versions(store)
    manifests = {n: load_manifest(store, n) for n in numbers}
    doomed = []
    for older, newer in itertools.pairwise(numbers[: max(0, len(numbers) - keep + 1)]):
        replaced_at = datetime.fromisoformat(manifests[newer].created_at)
        if (now - replaced_at).total_seconds() >= grace_s:
            doomed.append(older)
        else:
            break  # versions are replaced in order: every later one is younger still
    named = {f.key for n, m in manifests.items() if n not in doomed for f in m.files()}
    for number in doomed:
        store.delete(f"versions/{number:08d}.json")
        # Its own build's files and the earlier builds' files it shared, unless a kept version names them.
        mine = {*store.list(f"builds/{manifests[number].build_id}/"), *(f.key for f in manifests[number].files())}
        for key in sorted(mine - named):
            store.delete(key)
    # Files of builds that never published are left alone: one may be in progress.
    if len(numbers) - len(doomed) > keep:
        log.info("keeping %d versions beyond --keep %d for the %.0f s grace period",
                 len(numbers) - len(doomed) - keep, keep, grace_s)  # fmt: skip
    return doomed
