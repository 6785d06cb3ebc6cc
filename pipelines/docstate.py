"""Per-document state: apply one change event, emit the chunk versions it implies.

Pure functions over a small state, used by the keyed stateful step of the flow:

- a change at or before the last applied position is stale (late or duplicated) and
  ignored;
- an upsert is chunked and diffed against the previous version: new chunks, chunks whose
  document metadata (title, ACL, metadata columns) changed and chunks that moved (their ``chunk_index``
  changed because text was added or removed above them) get upsert rows; chunks that
  disappeared get delete rows, carrying the document's *new* ACL (the change happened
  under it: a caller the new ACL excludes must not learn of it); untouched chunks get
  nothing. Only new content is embedded: moved and re-permissioned chunks keep their
  content hash, and the embedder reuses their vectors (see ``pipelines.embedding``);
- a delete emits delete rows for every live chunk; a Kafka tombstone deletes a document
  only if it is still live (normally its delete event came first: a tombstone alone means
  log compaction removed the delete) and the event before it was not a replayed delete. A
  source that restarts re-sends its unacknowledged tail (delete, tombstone, re-create, then
  delete and tombstone again): the replayed delete is stale, and its tombstone must not
  delete the row re-created after it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Literal

from pipelines.chunking import Chunker
from pipelines.records import ChangeEvent, ChunkVersion, DocUpdate

Outcome = Literal["applied", "stale", "unchanged", "tombstone"]

#: Appended to the last position for a tombstone delete: sorts after it.
_TOMBSTONE_SUFFIX = "~tombstone"


@dataclass
class DocState:
    position: str
    live: bool
    title: str = ""
    acl: tuple[str, ...] = ()
    #: chunk id → (chunk index, content hash) of the live version
    chunks: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: the metadata JSON of the live version (a class default: states pickled before it existed load)
    metadata: str | None = None
    #: when a deleted document's state was made (wall clock, ms): it expires a retention later
    #: (``pipelines.flow._DocLogic``)
    deleted_at_ms: int | None = None
    #: the last event was a stale (replayed) delete: the tombstone after it is its own, not news
    replayed_delete: bool = False


def metadata_json(event: ChangeEvent) -> str | None:
    """A document's mapped metadata columns as one JSON object, or None when none are mapped."""
    if not event.metadata:
        return None
    return json.dumps({col: json.loads(value) for col, value in event.metadata}, sort_keys=True)


def chunk_id(doc_id: str, content_hash: str, occurrence: int) -> str:
    """Deterministic: the same text at the same occurrence in a document keeps its id."""
    raw = f"{doc_id}\x00{content_hash}\x00{occurrence}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def apply_change(
    state: DocState | None, event: ChangeEvent, chunker: Chunker, context: bool = False
) -> tuple[DocState | None, DocUpdate | None, Outcome]:
    """Apply one event to a document's state; return (state, update or None, outcome).

    With ``context`` (contextual vectors, ``pipelines.context``) each upsert carries its
    neighbours' text, and a chunk whose neighbours changed is written again."""
    if event.tombstone:
        if state is not None and state.replayed_delete:
            return replace(state, replayed_delete=False), None, "tombstone"
        if state is None or not state.live:
            return state, None, "tombstone"
        position = state.position + _TOMBSTONE_SUFFIX
    else:
        assert event.position is not None
        if state is not None and event.position <= state.position:
            replayed = event.op == "delete"
            return (
                (state if state.replayed_delete == replayed else replace(state, replayed_delete=replayed)),
                None,
                "stale",
            )
        position = event.position

    if event.op == "delete":
        versions = _deletes(state, event, position)
        new_state = DocState(position, live=False)
    else:
        new_state, versions = _upsert(state, event, position, chunker, context)
    if not versions:
        return new_state, None, "unchanged"
    return new_state, DocUpdate(event.doc_id, event.kafka, event.event_time_ms, tuple(versions)), "applied"


def _version(
    event: ChangeEvent,
    position: str,
    cid: str,
    op: str,
    index: int,
    text: str,
    chash: str,
    acl: tuple[str, ...],
    tokens: int = 0,
    neighbours: tuple[tuple[str, str], ...] = (),
) -> ChunkVersion:
    return ChunkVersion(
        chunk_id=cid,
        doc_id=event.doc_id,
        source_table=event.source_table,
        source_pk=event.source_pk,
        position=position,
        op="upsert" if op == "upsert" else "delete",
        chunk_index=index,
        text=text,
        content_hash=chash,
        acl=acl,
        kafka=event.kafka,
        event_time_ms=event.event_time_ms,
        token_count=tokens,
        title=event.title,
        metadata=metadata_json(event),
        neighbours=neighbours,
    )


def _deletes(state: DocState | None, event: ChangeEvent, position: str) -> list[ChunkVersion]:
    if state is None or not state.live:
        return []
    return [
        _version(event, position, cid, "delete", index, "", chash, state.acl)
        for cid, (index, chash) in state.chunks.items()
    ]


def _upsert(
    state: DocState | None, event: ChangeEvent, position: str, chunker: Chunker, context: bool = False
) -> tuple[DocState, list[ChunkVersion]]:
    old = state.chunks if state is not None and state.live else {}
    metadata = metadata_json(event)
    meta_changed = (
        state is None
        or not state.live
        or (state.title, state.acl, state.metadata) != (event.title, event.acl, metadata)
    )
    chunks = chunker.chunk(event.text)
    old_hashes = {index: chash for index, chash in old.values()} if context else {}
    seen: dict[str, int] = {}
    new_chunks: dict[str, tuple[int, str]] = {}
    versions: list[ChunkVersion] = []
    for at, chunk in enumerate(chunks):
        occurrence = seen.get(chunk.content_hash, 0)
        seen[chunk.content_hash] = occurrence + 1
        cid = chunk_id(event.doc_id, chunk.content_hash, occurrence)
        new_chunks[cid] = (chunk.index, chunk.content_hash)
        near = [chunks[j] for j in (at - 1, at + 1) if 0 <= j < len(chunks)] if context else []
        # a chunk at the same index keeps its neighbours' index: compare their content
        context_changed = context and any(
            old_hashes.get(j) != (chunks[j].content_hash if 0 <= j < len(chunks) else None) for j in (at - 1, at + 1)
        )
        if cid not in old or meta_changed or old[cid][0] != chunk.index or context_changed:
            versions.append(
                _version(
                    event,
                    position,
                    cid,
                    "upsert",
                    chunk.index,
                    chunk.text,
                    chunk.content_hash,
                    event.acl,
                    chunk.token_count,
                    tuple((n.content_hash, n.text) for n in near),
                )
            )
    for cid, (index, chash) in old.items():
        if cid not in new_chunks:
            versions.append(_version(event, position, cid, "delete", index, "", chash, event.acl))
    return DocState(position, True, event.title, event.acl, new_chunks, metadata), versions
