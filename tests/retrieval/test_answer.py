"""The answerer and the audit log with scripted generator replies (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from deltalake import DeltaTable
from fastapi.testclient import TestClient

from pipelines.lake import Lake
from retrieval.acl import Principal
from retrieval.answer import NO_ANSWER, NOTHING_SUPPORTED, NOTHING_TO_QUOTE, Answerer
from retrieval.api import create_app
from retrieval.audit import AuditLog
from retrieval.errors import SearchError
from retrieval.filters import MetadataFilter
from retrieval.query_embedding import QueryEmbedder
from retrieval.results import SearchResult, result_record
from serving.fake_embedder import FakeEmbedder
from serving.generator import Generator, GeneratorError, GeneratorSettings

TEXTS = [
    "Penguins are flightless seabirds that swim with their wings.",
    "A glacier is a persistent body of dense ice.",
    "Espresso is coffee brewed under pressure.",
]


def result_row(i: int, text: str) -> dict[str, Any]:
    row = {"chunk_id": f"c{i}", "doc_id": f"public.docs/{i}", "title": f"T{i}", "text": text, "chunk_index": 0,
           "source_table": "public.docs", "source_pk": str(i), "position": f"pg:{i:020d}", "event_time": None,
           "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": i}  # fmt: skip
    return result_record(row, 0.9 - i / 10, 7, 3, "index")


class StubEngine:
    """What the answerer needs of the engine: search, the query embedder, its identity."""

    def __init__(self, texts: list[str]) -> None:
        self.embedder = FakeEmbedder(dim=32)
        self.queries = QueryEmbedder(self.embedder)
        self.texts = texts
        self.searches: list[Principal] = []
        self.filters: list[MetadataFilter | None] = []
        self.modes: list[str | None] = []

    def search(
        self,
        query: str,
        k: int,
        who: Principal,
        as_of: int | None = None,
        with_vectors: bool = False,
        where: MetadataFilter | None = None,
        mode: str | None = None,
    ) -> SearchResult:
        self.modes.append(mode)
        self.searches.append(who)
        self.filters.append(where)
        rows = [result_row(i, t) for i, t in enumerate(self.texts[:k])]
        return SearchResult(rows, 3, 7, 4, 0, {})

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "problems": []}


def scripted(reply: str | None, calls: list[dict[str, Any]], status: int = 200) -> Generator:
    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content) if request.content else {})
        if reply is None:
            raise AssertionError("the generator must not be called")
        if status != 200:
            return httpx.Response(status, text="model crashed")
        return httpx.Response(200, json={"model": "m", "choices": [{"message": {"content": reply},
                                                                     "finish_reason": "stop"}]})  # fmt: skip

    settings = GeneratorSettings("http://gen/v1", model="m", retries=0)
    return Generator(settings, transport=httpx.MockTransport(handle))


def audit_rows(audit: AuditLog) -> list[dict[str, Any]]:
    audit.stop()
    rows: list[dict[str, Any]] = DeltaTable(audit.lake.table_uri("answers")).to_pyarrow_table().to_pylist()
    return sorted(rows, key=lambda row: row["time"])  # files come back in any order


def test_citations_are_validated_and_unsupported_sentences_flagged(audit: AuditLog) -> None:
    calls: list[dict[str, Any]] = []
    # Sentence 1 repeats source 1 but cites [2] and a source never sent [9]; sentence 2 is made up.
    reply = f"{TEXTS[0]} [2][9] The moon is made of cheese."
    answerer = Answerer(StubEngine(TEXTS), scripted(reply, calls), audit)  # type: ignore[arg-type]
    who = Principal("bob", frozenset({"eng"}))
    out = answerer.answer(answerer.prepare("How do penguins swim?", 3, who))
    assert [c["n"] for c in out["citations"]] == [1] and out["citations"][0]["chunk_id"] == "c0"
    first, second = out["sentences"]
    assert first["sources"] == [1] and first["invalid_markers"] == [9] and first["unsupported_markers"] == [2]
    assert second["flagged"] and out["flagged"] == ["The moon is made of cheese."]
    assert out["answer"] == f"{TEXTS[0][:-1]} [1]. The moon is made of cheese."
    sent = calls[0]["messages"][1]["content"]
    assert all(f"[{n}] T{n - 1}\n{t}" in sent for n, t in enumerate(TEXTS, 1))
    (row,) = audit_rows(audit)
    assert row["answer_id"] == out["answer_id"] and row["principal"] == "bob" and row["groups"] == ["eng"]
    assert row["status"] == "answered" and row["raw_answer"] == reply and row["flagged_sentences"] == 1
    assert [s["chunk_id"] for s in row["sources"]] == ["c0", "c1", "c2"]
    assert row["citations"] == [{"n": 1, "chunk_id": "c0", "support": pytest.approx(1.0, abs=1e-4)}]
    assert row["lake_version"] == 7 and row["index_version"] == 3 and row["generator"] == "m"
    assert row["embedder"] == str(FakeEmbedder(dim=32).identity) and len(row["prompt_hash"]) == 64


def test_no_visible_sources_means_no_answer_and_no_generation(audit: AuditLog) -> None:
    calls: list[dict[str, Any]] = []
    answerer = Answerer(StubEngine([]), scripted(None, calls), audit)  # type: ignore[arg-type]
    prepared = answerer.prepare("What is secret?", 5, Principal("eve"))
    out = answerer.answer(prepared)
    assert out["no_answer"] and out["answer"] == NO_ANSWER and out["citations"] == [] and out["model"] is None
    events = list(answerer.stream(answerer.prepare("What is secret?", 5, Principal("eve"))))
    assert [name for name, _ in events] == ["done"] and events[0][1]["no_answer"]
    assert calls == []
    assert [r["status"] for r in audit_rows(audit)] == ["no_answer", "no_answer"]


def test_generator_failure_is_a_502_and_still_audited(audit: AuditLog) -> None:
    calls: list[dict[str, Any]] = []
    engine = StubEngine(TEXTS)
    answerer = Answerer(engine, scripted("x", calls, status=500), audit)  # type: ignore[arg-type]
    client = TestClient(create_app(engine, None, answerer))  # type: ignore[arg-type]
    r = client.post("/v1/answer", json={"question": "How do penguins swim?"})
    assert r.status_code == 502 and "generator failed" in r.json()["error"]
    assert client.get("/healthz").json()["status"] == "degraded"
    with pytest.raises(GeneratorError):
        answerer.answer(answerer.prepare("again", 2, Principal("bob")))
    rows = audit_rows(audit)
    assert [r["status"] for r in rows] == ["failed", "failed"] and "HTTP 500" in rows[0]["error"]


def test_answer_request_validation(audit: AuditLog) -> None:
    engine = StubEngine(TEXTS)
    answerer = Answerer(engine, scripted("x", []), audit)  # type: ignore[arg-type]
    client = TestClient(create_app(engine, None, answerer))  # type: ignore[arg-type]
    bad = [({}, "question"), ({"question": "q", "k": 99}, "k"), ({"question": "q", "x": 1}, "x"),
           ({"question": "q" * 2001}, "question"), ({"question": "q", "stream": "maybe"}, "stream")]  # fmt: skip
    for body, where in bad:
        r = client.post("/v1/answer", json=body)
        assert r.status_code == 422 and where in r.json()["error"], (body, r.text)
    audit.stop()


def test_audit_writer_retries_and_never_writes_a_batch_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import retrieval.audit

    real = retrieval.audit.write_deltalake
    failures = ["refused", "landed"]  # a refused write, then a commit that lands but whose answer is lost

    def flaky(*args: Any, **kwargs: Any) -> None:
        if failures:
            kind = failures.pop(0)
            if kind == "landed":
                real(*args, **kwargs)
            raise OSError(f"connection reset ({kind})")
        real(*args, **kwargs)

    monkeypatch.setattr(retrieval.audit, "write_deltalake", flaky)
    audit = AuditLog(Lake.at(str(tmp_path / "lake")), flush_s=0.05, backoff_s=0.01)
    audit.start()
    engine = StubEngine(TEXTS)
    answerer = Answerer(engine, scripted(TEXTS[1], []), audit)  # type: ignore[arg-type]
    ids = [answerer.answer(answerer.prepare(f"q{i}", 2, Principal("bob")))["answer_id"] for i in range(5)]
    assert audit.flush(10)
    assert audit.healthy and not any(audit.pending(i) for i in ids) and not failures
    rows = audit_rows(audit)
    assert sorted(r["answer_id"] for r in rows) == sorted(ids)


def test_audit_commits_do_not_reread_the_log(tmp_path: Path, transaction_version_calls: dict[str, int]) -> None:
    """deltalake's transaction_version reads every log entry since the last checkpoint: the
    audit writer reads only the commits since its last one (other replicas' included)."""
    asked = transaction_version_calls
    lake = Lake.at(str(tmp_path / "lake"))
    replicas = [AuditLog(lake, flush_s=0.01) for _ in range(2)]
    for audit in replicas:
        audit.start()
    engine = StubEngine(TEXTS)
    ids = []
    for i in range(6):
        audit = replicas[i % 2]
        answerer = Answerer(engine, scripted(TEXTS[1], []), audit)  # type: ignore[arg-type]
        ids.append(answerer.answer(answerer.prepare(f"q{i}", 2, Principal("bob")))["answer_id"])
        assert audit.flush(10)
    assert asked["n"] == 0
    assert sorted(r["answer_id"] for r in audit_rows(replicas[0])) == sorted(ids)


def test_answer_keeps_paragraphs_and_code_blocks(audit: AuditLog) -> None:
    reply = f"{TEXTS[1]}\n\n```python\nprint('ice')\n```\n\nMade up closing words here."
    answerer = Answerer(StubEngine(TEXTS), scripted(reply, []), audit)  # type: ignore[arg-type]
    out = answerer.answer(answerer.prepare("What is a glacier?", 3, Principal("bob")))
    first, code, last = out["answer"].split("\n\n")
    assert first == f"{TEXTS[1][:-1]} [2]." and code.startswith("```python\nprint('ice')\n```")
    assert last == "Made up closing words here." and out["flagged"][-1] == last
    assert out["sentences"][1]["text"] == "```python\nprint('ice')\n```"
    audit.stop()


def test_records_that_can_never_be_written_are_set_aside_not_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record the table refuses (a bug, a schema changed under us) goes to the dead-letter
    file with its reason; every record behind it is still written."""
    import retrieval.audit
    from retrieval import metrics

    real = retrieval.audit.write_deltalake

    def refuses_one_batch(table: Any, rows: Any, **kwargs: Any) -> None:
        if "refused-for-good" in rows.column("answer_id").to_pylist():
            raise OSError("the store refuses this batch (permanently, as it turns out)")
        real(table, rows, **kwargs)

    monkeypatch.setattr(retrieval.audit, "write_deltalake", refuses_one_batch)
    dead = tmp_path / "dead.jsonl"
    before = metrics.AUDIT_QUARANTINED._value.get()
    audit = AuditLog(Lake.at(str(tmp_path / "lake")), flush_s=0.05, backoff_s=0.01, give_up_s=0.5,
                     dead_letter_path=dead)  # fmt: skip
    audit.start()
    engine = StubEngine(TEXTS)
    answerer = Answerer(engine, scripted(TEXTS[1], []), audit)  # type: ignore[arg-type]
    good = answerer.answer(answerer.prepare("q", 2, Principal("bob")))["answer_id"]
    assert audit.flush(10)
    misfit = {"answer_id": "misfit", "k": "five", "time": "not a time"}  # wrong types for the schema
    audit.record(misfit)
    assert audit.flush(10)
    audit.record({"answer_id": "refused-for-good", "status": "failed"})
    assert audit.flush(10), "a batch the table refuses for good blocked the writer"
    later = [answerer.answer(answerer.prepare(f"later {i}", 2, Principal("bob")))["answer_id"] for i in range(3)]
    assert audit.flush(10) and audit.healthy
    assert sorted(r["answer_id"] for r in audit_rows(audit)) == sorted([good, *later])
    set_aside = [json.loads(line) for line in dead.read_text().splitlines()]
    assert [d["record"]["answer_id"] for d in set_aside] == ["misfit", "refused-for-good"]
    assert "schema" in set_aside[0]["reason"] and "refuses this batch" in set_aside[1]["reason"]
    assert metrics.AUDIT_QUARANTINED._value.get() - before == 2


def test_a_sentence_of_nothing_but_markers_keeps_its_validated_citations() -> None:
    from retrieval.answer import _with_citations
    from serving.citations import Attribution, SentenceSupport

    attribution = Attribution([
        SentenceSupport("Penguins swim with their wings.", [1], {1: 0.9}, [1]),
        SentenceSupport("[1][2]", [1, 2], {1: 0.6, 2: 0.55}, [1, 2]),
        SentenceSupport("[7]", [], {}, [7], invalid=[7]),
    ])  # fmt: skip
    assert _with_citations(attribution) == "Penguins swim with their wings [1]. [1][2]"


def test_filters_reach_the_search_and_bad_ones_are_a_422(audit: AuditLog) -> None:
    engine = StubEngine(TEXTS)
    client = TestClient(create_app(engine, None, Answerer(engine, scripted(TEXTS[0], []), audit)))  # type: ignore[arg-type]
    r = client.post("/v1/answer", json={"question": "penguins?", "filter": {"team": ["eng", "ops"]}})
    assert r.status_code == 200 and engine.filters[-1] == MetadataFilter.parse({"team": ["ops", "eng"]})
    for body in ({"question": "q", "filter": {"team": {"a": 1}}}, {"question": "q", "filter": {"": 1}}):
        r = client.post("/v1/answer", json=body)
        assert r.status_code == 422 and "filter" in r.json()["error"], r.text
    audit.stop()


LONG = [
    "Penguins are flightless seabirds. They swim with their wings, which work as flippers. Most live in the south.",
    "A glacier is a persistent body of dense ice. It moves under its own weight.",
    "Espresso is coffee brewed under pressure. Penguins do not drink it.",
]


def test_an_extractive_answer_cites_verbatim_spans_and_calls_no_model(audit: AuditLog) -> None:
    engine = StubEngine(LONG)
    answerer = Answerer(engine, None, audit)  # type: ignore[arg-type]
    who = Principal("bob", frozenset({"eng"}))
    out = answerer.answer(answerer.prepare("How do penguins swim with their wings?", 3, who, style="extract"))
    assert out["style"] == "extract" and out["model"] is None and not out["no_answer"] and not out["flagged"]
    assert out["sentences"] and all(
        LONG[s["sources"][0] - 1][s["span"][0] : s["span"][1]] == s["text"] for s in out["sentences"]
    )  # every extract is exactly the span it cites
    assert "They swim with their wings, which work as flippers [1]." in out["answer"]
    assert out["citations"][0]["chunk_id"] == "c0"
    assert all(c["spans"] and c["sentences"] for c in out["citations"])
    events = list(answerer.stream(answerer.prepare("How do penguins swim?", 3, who, style="extract")))
    assert [name for name, _ in events][-1] == "done" and events[0][0] == "token"
    assert "".join(e["text"] for name, e in events if name == "token") == events[-1][1]["answer"]
    only_code = Answerer(StubEngine(["```\nfor line in f:\n    print(line)\n```"]), None, audit)  # type: ignore[arg-type]
    empty = only_code.answer(only_code.prepare("How do I loop over lines?", 1, who, style="extract"))
    assert empty["no_answer"] and empty["answer"] == NOTHING_TO_QUOTE and empty["citations"] == []
    with pytest.raises(SearchError, match="without a generator") as refused:
        answerer.prepare("How do penguins swim?", 3, who, style="generate")
    assert refused.value.status == 400
    rows = audit_rows(audit)
    assert [r["style"] for r in rows] == ["extract", "extract", "extract"] and rows[0]["answer"] == out["answer"]
    assert rows[2]["status"] == "no_answer"
    assert rows[0]["generator"] is None and rows[0]["prompt_hash"] is None and rows[0]["generator_url"] is None
    assert json.loads(rows[0]["sentences"])[0]["span"] == out["sentences"][0]["span"]


def test_the_style_is_chosen_per_request_over_http(audit: AuditLog) -> None:
    calls: list[dict[str, Any]] = []
    engine = StubEngine(LONG)
    answerer = Answerer(engine, scripted(LONG[0], calls), audit)  # type: ignore[arg-type]
    client = TestClient(create_app(engine, None, answerer))  # type: ignore[arg-type]
    extracted = client.post("/v1/answer", json={"question": "How do penguins swim?", "style": "extract"}).json()
    assert extracted["style"] == "extract" and extracted["sentences"][0]["span"] and calls == []
    generated = client.post("/v1/answer", json={"question": "How do penguins swim?"}).json()
    assert generated["style"] == "generate" and len(calls) == 1 and generated["model"] == "m"
    r = client.post("/v1/answer", json={"question": "q", "style": "poem"})
    assert r.status_code == 422 and "style" in r.json()["error"]
    assert [row["style"] for row in audit_rows(audit)] == ["extract", "generate"]


def test_unsupported_sentences_are_flagged_or_dropped_as_the_caller_asks(audit: AuditLog) -> None:
    reply = f"{TEXTS[0]} The moon is made of cheese."
    engine = StubEngine(TEXTS)
    answerer = Answerer(engine, scripted(reply, []), audit)  # type: ignore[arg-type]
    who = Principal("bob")
    flagged = answerer.answer(answerer.prepare("How do penguins swim?", 3, who))
    assert flagged["flagged"] == ["The moon is made of cheese."] and flagged["dropped"] == []
    assert "cheese" in flagged["answer"]
    dropped = answerer.answer(answerer.prepare("How do penguins swim?", 3, who, unsupported="drop"))
    assert dropped["flagged"] == [] and dropped["dropped"] == ["The moon is made of cheese."]
    assert "cheese" not in dropped["answer"] and dropped["answer"] == f"{TEXTS[0][:-1]} [1]."
    assert dropped["raw_answer"] == reply and [s["dropped"] for s in dropped["sentences"]] == [False, True]
    nothing = Answerer(engine, scripted("The moon is made of cheese.", []), audit)  # type: ignore[arg-type]
    out = nothing.answer(nothing.prepare("How do penguins swim?", 3, who, unsupported="drop"))
    assert out["answer"] == NOTHING_SUPPORTED and out["citations"] == [] and out["dropped"]
    client = TestClient(create_app(engine, None, answerer))  # type: ignore[arg-type]
    body = client.post("/v1/answer", json={"question": "How do penguins swim?", "unsupported": "drop"}).json()
    assert body["dropped"] == ["The moon is made of cheese."]
    r = client.post("/v1/answer", json={"question": "q", "unsupported": "hide"})
    assert r.status_code == 422 and "unsupported" in r.json()["error"]
    rows = audit_rows(audit)
    assert [r["answer"] for r in rows][:2] == [flagged["answer"], dropped["answer"]]
    assert json.loads(rows[1]["sentences"])[1]["dropped"] and rows[1]["flagged_sentences"] == 1
