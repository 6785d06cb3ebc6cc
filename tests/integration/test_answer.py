"""Grounded answers, the audit log and lineage, end to end with the real embedded generator.

Real ingest into a local lake, a real index build, `streamrag serve` pointed at the real
llama.cpp server through a recording proxy (so the prompts actually sent can be checked).
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from deltalake import DeltaTable

from tests.conftest import free_port
from tests.corpus import Corpus
from tests.integration.helpers import cli, ingest_args, kill_group, produce, start
from tests.integration.test_serve import SECRET, TOPICS, doc_events, wait_ready
from tests.recording_proxy import RecordingProxy

pytestmark = pytest.mark.integration

TOPIC = "cdc.app.public.docs_answer"
TOKENS = {
    "token-of-hana-the-hr-lead": ("hana", ["hr"]),
    "token-of-bob-the-engineer": ("bob", ["eng"]),
    "token-of-ada-the-auditor!": ("ada", ["auditor"]),
}
HANA, BOB, ADA = (f"Bearer {t}" for t in TOKENS)
PAYROLL = SECRET + 1  # primary key of the HR-only document


@dataclass
class Service:
    url: str
    lake: str
    broker: str
    tmp: Path
    proxy: RecordingProxy
    proc: Any = None
    answered: int = 0

    def answer(self, question: str, auth: str = BOB, **body: object) -> httpx.Response:
        r = httpx.post(f"{self.url}/v1/answer", json={"question": question, **body}, headers={"Authorization": auth},
                       timeout=300)  # fmt: skip
        if r.status_code == 200:
            self.answered += 1
        return r

    def get(self, path: str, auth: str = BOB) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={"Authorization": auth}, timeout=60)

    def ingest(self, corpus: Corpus, name: str) -> None:
        produce(self.broker, TOPIC, corpus, self.tmp / f"{name}.jsonl")
        out = cli(*ingest_args(self.broker, TOPIC, self.lake, self.tmp / "recovery", idle=3))
        assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def service(broker: str, generator_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("answer")
    lake, index = str(tmp / "lake"), str(tmp / "index")
    rows = [(i + 1, t.title(), body, "hr" if i == SECRET else "") for i, (t, body) in enumerate(TOPICS)]
    proxy = RecordingProxy(generator_url)
    svc = Service("", lake, broker, tmp, proxy)
    svc.ingest(doc_events(100, rows), "initial")
    out = cli("index", "build", "--lake", lake, "--index", index, "--nlist", "2", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (tmp / "tokens.yaml").write_text(
        json.dumps({"tokens": {t: {"principal": p, "groups": g} for t, (p, g) in TOKENS.items()}})
    )
    port = free_port()
    args = ["serve", "--lake", lake, "--index", index, "--port", str(port), "--tokens", str(tmp / "tokens.yaml"),
            "--tail-poll", "0.2", "--cache-dir", str(tmp / "cache"), "--generator-url", proxy.url,
            "--max-tokens", "48"]  # fmt: skip
    svc.proc = start(args, None, tmp / "serve.log")
    svc.url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(svc.url, svc.proc)
        yield svc
    finally:
        if svc.proc.poll() is None:
            kill_group(svc.proc)
        proxy.close()
    log = (tmp / "serve.log").read_text()
    assert "Traceback" not in log, log[-5000:]
    assert "token-of-" not in log, "tokens must never be logged"


def sources_in(prompt: str) -> dict[int, str]:
    """The numbered sources of a prompt as the generator received it."""
    listed = prompt.split("Sources:\n\n", 1)[1].rsplit("\n\nQuestion:", 1)[0]
    parts = re.split(r"(?m)^\[(\d+)\] ", listed)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def test_answer_cites_sources_that_were_in_the_prompt(service: Service) -> None:
    before = len(service.proxy.requests)
    r = service.answer("How do penguins swim?", k=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["answer_id"] and not body["no_answer"] and body["answer"].strip()
    assert body["model"].endswith(".gguf")  # the model llama.cpp reports, through the same client as vLLM
    sent = service.proxy.requests[before:]
    assert len(sent) == 1 and sent[0]["max_tokens"] == 48 and sent[0]["temperature"] == 0
    prompt = sources_in(service.proxy.prompts()[-1])
    assert sorted(prompt) == [s["n"] for s in body["sources"]] == [1, 2, 3]
    assert body["citations"], f"no sentence attributed to a source: {body['sentences']}"
    for c in body["citations"]:
        assert c["n"] in prompt and c["chunk_id"] == body["sources"][c["n"] - 1]["chunk_id"]
        assert c["source"]["table"] == "public.docs" and c["source"]["kafka"]["topic"] == TOPIC
        assert c["support"] >= 0.3
    assert any("penguin" in prompt[c["n"]].lower() for c in body["citations"])
    for s in body["sentences"]:
        assert s["flagged"] == (not s["sources"])
        assert set(s["sources"]) <= set(prompt)
    assert body["timings"]["retrieve_ms"] > 0 and body["timings"]["total_ms"] >= body["timings"]["retrieve_ms"]


def read_sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def test_streamed_answer_ends_with_citations_and_answer_id(service: Service) -> None:
    with httpx.stream("POST", f"{service.url}/v1/answer", json={"question": "What is a glacier?", "stream": True},
                      headers={"Authorization": BOB}, timeout=300) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        r.read()
    service.answered += 1
    events = read_sse(r)
    tokens = [d["text"] for name, d in events if name == "token"]
    assert len(tokens) > 1, "tokens arrive one by one"
    name, done = events[-1]
    assert name == "done" and done["answer_id"] == r.headers["x-answer-id"]
    assert done["raw_answer"] == "".join(tokens)
    prompt = sources_in(service.proxy.prompts()[-1])
    assert all(c["n"] in prompt for c in done["citations"])
    assert done["timings"]["first_token_ms"] <= done["timings"]["total_ms"]


def test_audit_row_resolves_to_the_produced_source_rows(service: Service) -> None:
    body = service.answer("Tell me about espresso coffee.", k=2).json()
    chain = service.get(f"/v1/lineage/answers/{body['answer_id']}").json()
    assert chain["question"] == "Tell me about espresso coffee." and chain["principal"] == "bob"
    assert chain["status"] == "answered" and chain["answer"] == body["answer"]
    assert chain["models"]["embedder"].startswith("all-MiniLM-L6-v2@")
    assert chain["models"]["generator"] == body["model"]
    assert chain["lake_version"] == body["lake_version"] and chain["index_version"] == body["index_version"]
    assert [s["chunk_id"] for s in chain["sources"]] == [s["chunk_id"] for s in body["sources"]]
    espresso = next(s for s in chain["sources"] if s["doc_id"].endswith("4"))
    # Produced as row id=4 at LSN 100 + 3*10 (doc_events numbers them in order).
    assert espresso["source"]["table"] == "public.docs" and espresso["source"]["pk"] == "4"
    assert espresso["source"]["kafka"]["topic"] == TOPIC and espresso["source"]["position"]
    assert "Espresso is coffee" in espresso["text"] and espresso["now"] == "current"
    # the chunk's vector: the query embedder's, mixed with its neighbours' at the lake's weight
    assert espresso["embedding_model"] == chain["models"]["embedder"] + "+context=1"
    assert {c["chunk_id"] for c in chain["citations"]} <= {s["chunk_id"] for s in chain["sources"]}
    # The CLI reads the same chain straight from the lake.
    out = cli("lineage", "answer", body["answer_id"], "--lake", service.lake, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["sources"] == chain["sources"]
    text = cli("lineage", "answer", body["answer_id"], "--lake", service.lake)
    assert "public.docs pk=4" in text.stdout and body["answer_id"] in text.stdout


def test_source_delete_impact_lists_the_answer(service: Service) -> None:
    body = service.answer("What guides ships away from dangerous coasts?", k=2).json()
    assert any(s["doc_id"].endswith("8") for s in body["sources"])  # the lighthouse, pk 8
    lighthouse = TOPICS[7]
    service.ingest(doc_events(900, [(8, lighthouse[0].title(), lighthouse[1], "")], op="d"), "delete")
    out = cli("lineage", "source", "public.docs", "8", "--lake", service.lake, "--json")
    assert out.returncode == 0, out.stderr
    impact = json.loads(out.stdout)
    assert impact["status"] == "deleted" and impact["current_chunks"] == []
    assert [v["op"] for v in impact["chunk_versions"]] == ["upsert", "delete"]
    assert body["answer_id"] in [a["answer_id"] for a in impact["answers"]]
    chain = service.get(f"/v1/lineage/answers/{body['answer_id']}").json()
    assert next(s for s in chain["sources"] if s["doc_id"].endswith("8"))["now"] == "deleted"
    http = service.get("/v1/lineage/sources/public.docs/8").json()
    assert http["answers"] == [a for a in impact["answers"] if a["principal"] == "bob"]


def test_acl_outsiders_cannot_retrieve_answer_from_or_trace_a_restricted_document(service: Service) -> None:
    secret = "confidential and reviewed every March"
    asked = len(service.proxy.requests)
    bob = service.answer("When are executive payroll salaries reviewed?", k=5)
    assert bob.status_code == 200
    assert all(secret not in p for p in service.proxy.prompts()[asked:]), "HR text was sent to the generator"
    assert secret not in bob.text and all(not s["doc_id"].endswith(str(PAYROLL)) for s in bob.json()["sources"])
    hana = service.answer("When are executive payroll salaries reviewed?", auth=HANA, k=5).json()
    assert any(s["doc_id"].endswith(str(PAYROLL)) for s in hana["sources"])
    assert secret in service.proxy.prompts()[-1]
    # An extractive answer quotes only what its caller may see, and quotes it exactly.
    extracted = service.answer("When are executive payroll salaries reviewed?", k=5, style="extract")
    assert extracted.status_code == 200 and secret not in extracted.text
    assert all(not s["doc_id"].endswith(str(PAYROLL)) for s in extracted.json()["sources"])
    quoted = service.answer("When are executive payroll salaries reviewed?", auth=HANA, k=5, style="extract").json()
    assert quoted["style"] == "extract" and quoted["model"] is None and quoted["sentences"]
    # Lineage: bob can trace neither hana's answer nor the HR row; the auditor sees both.
    assert service.get(f"/v1/lineage/answers/{hana['answer_id']}").status_code == 404
    r = service.get(f"/v1/lineage/sources/public.docs/{PAYROLL}")
    assert r.status_code == 404 and secret not in r.text
    assert service.get(f"/v1/lineage/answers/{hana['answer_id']}", auth=HANA).status_code == 200
    audit = service.get(f"/v1/lineage/sources/public.docs/{PAYROLL}", auth=ADA).json()
    assert hana["answer_id"] in [a["answer_id"] for a in audit["answers"]]
    assert secret in audit["chunk_versions"][0]["text"]
    # bob's own answer trace hides nothing he could not see (no HR chunk in it at all).
    own = service.get(f"/v1/lineage/answers/{bob.json()['answer_id']}")
    assert own.status_code == 200 and secret not in own.text


def test_answer_request_errors_are_json(service: Service) -> None:
    assert service.answer("", k=3).status_code == 422
    r = service.answer("fine question", k=0)
    assert r.status_code == 422 and "k" in r.json()["error"]
    r = httpx.post(f"{service.url}/v1/answer", json={"question": "q"}, timeout=30)
    assert r.status_code == 401
    assert service.get("/v1/lineage/answers/does-not-exist").status_code == 404


def test_graceful_stop_writes_every_audit_record(service: Service) -> None:
    """Last in this module: SIGTERM the service (as Kubernetes does), then count the audit rows."""
    service.answer("Which instrument has four strings?", k=2)
    service.proc.send_signal(signal.SIGTERM)
    service.proc.wait(60)
    rows = DeltaTable(f"{service.lake}/answers").to_pyarrow_table(columns=["answer_id", "status"])
    assert rows.num_rows == service.answered, "an audit record was lost"
    assert len(set(rows.column("answer_id").to_pylist())) == rows.num_rows
