"""Lineage queries for audits, over the lake's ``chunks`` and ``answers`` tables.

- :meth:`Lineage.answer`: answer → its sources and citations → each chunk version →
  source table, key, position, Kafka coordinates, event time → lake version, index
  version, models; and whether that chunk version is still current.
- :meth:`Lineage.source`: source row → every chunk version derived from it (ops, times)
  → every answer that used it (impact analysis, right-to-be-forgotten requests).
- :meth:`Lineage.chunk`: one chunk's history and the answers that used it.

ACLs apply as in search: a caller sees a chunk version only if its ACL admits them, an
answer only if they asked it, and nothing at all reveals that hidden things exist (not
found, not forbidden). Members of the ``auditor`` group see everything.

Non-interference: every answer is computed from the chunk versions the caller may see,
*after* the hidden ones are dropped, so what a caller gets is exactly what they would get
from a lake in which the hidden versions never existed. A hidden newer version does not
turn a visible one into "updated", a hidden delete does not make a source "deleted", and a
source or chunk with no visible version is a 404 like one that never existed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.lake import CHUNKS, DEAD_LETTERS, Lake, LakeError, latest_rows
from retrieval.acl import Principal, acl_mask
from retrieval.audit import ANSWERS, AuditLog
from retrieval.errors import SearchError
from retrieval.filters import parse_metadata
from retrieval.results import SOURCE_COLUMNS, SourceRef, iso

AUDITOR = "auditor"

#: chunk columns lineage reports (never the embedding)
CHUNK_COLUMNS = [
    "chunk_id", "doc_id", "op", "chunk_index", "title", "text", "content_hash", "model", "acl", "metadata",
    *SOURCE_COLUMNS, "ingest_time", "writer", "writer_seq",
]  # fmt: skip


def _chunk_version(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "chunk_id": row["chunk_id"],
        "doc_id": row["doc_id"],
        "op": row["op"],
        "chunk_index": row["chunk_index"],
        "title": row["title"],
        "text": row["text"],
        "content_hash": row["content_hash"],
        "acl": row["acl"] or [],
        "metadata": parse_metadata(row.get("metadata")),
        "source": SourceRef.from_row(row).as_json(),
        "ingest_time": iso(row["ingest_time"]),
        "embedding_model": row["model"],
        "writer": {"id": row["writer"], "seq": row["writer_seq"]},
    }


class Lineage:
    def __init__(self, lake: Lake, audit: AuditLog | None = None) -> None:
        self.lake = lake
        self.audit = audit

    # -- reading -----------------------------------------------------------------------------

    def _chunks(self, filters: list[tuple[str, str, Any]], who: Principal) -> pa.Table:
        """The chunk versions matching ``filters`` that ``who`` may see, oldest first."""
        delta = self.lake.table(CHUNKS)
        present = set(delta.schema().to_arrow().names)  # a lake older than a column lacks it
        table = delta.to_pyarrow_table(columns=[c for c in CHUNK_COLUMNS if c in present], filters=filters)
        table = table.filter(pa.array(self._visible(table, who))) if table.num_rows else table
        order = pc.sort_indices(table, [("position", "ascending"), ("ingest_time", "ascending")])
        return table.take(order)

    def _answers(self, filters: list[tuple[str, str, Any]] | None = None) -> pa.Table:
        try:
            return self.lake.table(ANSWERS).to_pyarrow_table(filters=filters)
        except LakeError:
            return pa.table({})

    @staticmethod
    def _visible(table: pa.Table, who: Principal) -> np.ndarray:
        if AUDITOR in who.groups:
            return np.ones(table.num_rows, dtype=bool)
        return acl_mask(table.column("acl"), who.groups)

    # -- answer → sources ----------------------------------------------------------------------

    def answer(self, answer_id: str, who: Principal) -> dict[str, Any]:
        if self.audit is not None and self.audit.pending(answer_id):
            self.audit.flush()
        found = self._answers([("answer_id", "=", answer_id)])
        if found.num_rows == 0 or (AUDITOR not in who.groups and found.column("principal")[0].as_py() != who.name):
            raise SearchError(f"no answer {answer_id!r} visible to you.", status=404)
        row = found.slice(0, 1).to_pylist()[0]
        sources = row["sources"] or []
        wanted = sorted({s["chunk_id"] for s in sources})
        versions = self._chunks([("chunk_id", "in", wanted)], who) if sources else None
        resolved: dict[int, dict[str, Any]] = {}
        for s in sources:
            resolved[s["n"]] = self._resolve(s, versions)
        cited = {c["n"]: c for c in row["citations"] or []}
        return {
            "answer_id": row["answer_id"],
            "time": iso(row["time"]),
            "principal": row["principal"],
            "groups": row["groups"],
            "question": row["question"],
            "status": row["status"],
            "style": row.get("style") or "generate",  # rows from before extractive answers: generated
            "mode": row.get("mode") or "dense",  # rows from before search modes: dense
            "answer": row["answer"],
            "raw_answer": row["raw_answer"],
            "error": row["error"],
            "lake_version": row["lake_version"],
            "index_version": row["index_version"],
            "as_of": row["as_of"],
            "models": {
                "embedder": row["embedder"],
                "generator": row["generator"],
                "generator_url": row["generator_url"],
            },
            "prompt_hash": row["prompt_hash"],
            "timings_ms": {
                "retrieve": row["retrieve_ms"],
                "first_token": row["first_token_ms"],
                "total": row["total_ms"],
            },
            "citations": [{**resolved[n], "support": c["support"]} for n, c in cited.items() if n in resolved],
            "sources": [resolved[s["n"]] for s in sources],
            "sentences": json.loads(row["sentences"]) if row["sentences"] else [],
        }

    def _resolve(self, used: dict[str, Any], versions: pa.Table | None) -> dict[str, Any]:
        """One source of an answer → the chunk version it was, and what became of it."""
        out: dict[str, Any] = {"n": used["n"], "chunk_id": used["chunk_id"], "score": used["score"],
                               "origin": used["origin"], "lake_version": used["lake_version"]}  # fmt: skip
        # ``versions`` holds only what ``who`` may see: a version missing from it is hidden
        # (or gone), and is shown as neither, not even by its id.
        if versions is None:
            return {"n": used["n"], "visible": False}
        same = versions.filter(pc.equal(versions.column("chunk_id"), used["chunk_id"]))
        exact = same.filter(pc.equal(same.column("position"), used["position"]))
        if exact.num_rows == 0:
            return {"n": used["n"], "visible": False}
        version = exact.slice(exact.num_rows - 1, 1)
        newest = same.slice(same.num_rows - 1, 1).to_pylist()[0]  # the newest *visible* version
        now = "current"
        if newest["position"] != used["position"]:
            now = "deleted" if newest["op"] == "delete" else "updated"
        return {**out, "visible": True, **_chunk_version(version.to_pylist()[0]), "now": now}

    def dead_letters(self, limit: int) -> dict[str, Any]:
        """The newest ``limit`` dead letters: where each came from and why (not its bytes)."""
        try:
            rows = self.lake.read(DEAD_LETTERS, columns=["topic", "partition", "offset", "error", "ingest_time"])
        except LakeError:  # no dead letter yet: the table is made with the first
            return {"total": 0, "dead_letters": []}
        newest = rows.take(pc.sort_indices(rows, [("ingest_time", "descending"), ("offset", "descending")])[:limit])
        return {
            "total": rows.num_rows,
            "dead_letters": [{**r, "ingest_time": iso(r["ingest_time"])} for r in newest.to_pylist()],
        }

    # -- source row → chunk versions → answers -------------------------------------------------

    def source(self, table: str, pk: str, who: Principal) -> dict[str, Any]:
        rows = self._chunks([("source_table", "=", table), ("source_pk", "=", pk)], who)
        if rows.num_rows == 0:
            raise SearchError(f"no source row {table}/{pk} visible to you in the lake.", status=404)
        latest = latest_rows(rows)
        live = latest.filter(pc.equal(latest.column("op"), "upsert"))
        return {
            "table": table,
            "pk": pk,
            "status": "live" if live.num_rows else "deleted",
            "current_chunks": sorted(live.column("chunk_id").to_pylist()),
            "chunk_versions": [_chunk_version(r) for r in rows.to_pylist()],
            "answers": self._answers_using(who, source=(table, pk)),
        }

    def chunk(self, chunk_id: str, who: Principal) -> dict[str, Any]:
        rows = self._chunks([("chunk_id", "=", chunk_id)], who)
        if rows.num_rows == 0:
            raise SearchError(f"no chunk {chunk_id!r} visible to you in the lake.", status=404)
        newest = rows.slice(rows.num_rows - 1, 1).to_pylist()[0]
        return {
            "chunk_id": chunk_id,
            "status": "deleted" if newest["op"] == "delete" else "live",
            "versions": [_chunk_version(r) for r in rows.to_pylist()],
            "answers": self._answers_using(who, chunk_id=chunk_id),
        }

    def _answers_using(
        self, who: Principal, source: tuple[str, str] | None = None, chunk_id: str | None = None
    ) -> list[dict[str, Any]]:
        """Answers whose prompt held a chunk of ``source`` (or the chunk ``chunk_id``)."""
        if self.audit is not None:
            self.audit.flush()
        answers = self._answers()
        if answers.num_rows == 0:
            return []
        if AUDITOR not in who.groups:
            answers = answers.filter(pc.equal(answers.column("principal"), who.name))
            if answers.num_rows == 0:
                return []
        col = answers.column("sources").combine_chunks()
        flat = pc.list_flatten(col)
        parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
        if source is not None:
            hit = pc.and_(pc.equal(pc.struct_field(flat, "source_table"), source[0]),
                          pc.equal(pc.struct_field(flat, "source_pk"), source[1]))  # fmt: skip
        else:
            hit = pc.equal(pc.struct_field(flat, "chunk_id"), chunk_id)
        hit_np = pc.fill_null(hit, False).to_numpy(zero_copy_only=False)
        chunk_ids = pc.struct_field(flat, "chunk_id").to_pylist()
        numbers = pc.struct_field(flat, "n").to_pylist()
        positions = pc.struct_field(flat, "position").to_pylist()
        used: dict[int, list[tuple[int, str, str]]] = {}
        for i in np.flatnonzero(hit_np):
            used.setdefault(int(parents[i]), []).append((numbers[i], chunk_ids[i], positions[i]))
        out = []
        for row_index, refs in sorted(used.items()):
            row = answers.slice(row_index, 1).to_pylist()[0]
            cited = {c["n"] for c in row["citations"] or []}
            out.append({
                "answer_id": row["answer_id"], "time": iso(row["time"]), "principal": row["principal"],
                "question": row["question"], "status": row["status"],
                "chunk_ids": sorted({c for _, c, _ in refs}), "cited": any(n in cited for n, _, _ in refs),
                "versions": [{"chunk_id": c, "position": p} for c, p in sorted({(c, p) for _, c, p in refs})],
                "lake_version": row["lake_version"], "index_version": row["index_version"],
            })  # fmt: skip
        out.sort(key=lambda a: a["time"] or "")
        return out
