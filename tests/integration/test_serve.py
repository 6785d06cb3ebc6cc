"""`streamrag serve` as users run it: real ingest, real index build, real uvicorn, httpx on loopback."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.corpus import Corpus, _event
from tests.integration.helpers import cli, ingest_args, kill_group, produce, start

pytestmark = pytest.mark.integration

TOPIC = "cdc.app.public.docs_serve"
TOPICS = [
    ("penguin", "Penguins are flightless seabirds of the southern hemisphere that swim with their wings."),
    ("volcano", "A volcano is a rupture in the crust where lava, ash and gases escape from below."),
    ("violin", "The violin is a bowed string instrument with four strings tuned in perfect fifths."),
    ("espresso", "Espresso is coffee brewed by forcing hot water through finely ground beans."),
    ("glacier", "A glacier is a persistent body of dense ice that moves slowly under its own weight."),
    ("chess", "Chess is a board game for two players; each controls sixteen pieces on an eight by eight board."),
    ("tomato", "The tomato is the edible berry of a plant in the nightshade family, eaten raw or cooked."),
    ("lighthouse", "A lighthouse is a tower with a bright lamp that guides ships away from dangerous coasts."),
    ("payroll", "Payroll salaries for the executive team are confidential and reviewed every March."),
    ("bicycle", "A bicycle is a pedal-driven vehicle with two wheels attached to a frame, one behind the other."),
]
SECRET = 8  # index of "payroll": HR only
TOKENS = {"token-of-hana-the-hr-lead": ("hana", ["hr"]), "token-of-bob-the-engineer": ("bob", ["eng"])}
HANA, BOB = (f"Bearer {t}" for t in TOKENS)


def doc_events(lsn: int, rows: list[tuple[int, str, str, str]], op: str = "c") -> Corpus:
    corpus = Corpus()
    for pk, title, body, acl in rows:
        row = {"id": pk, "title": title, "body": body, "acl": acl, "shelf": "food" if pk in (4, 7) else "other"}
        corpus.lines.append(_event(op, pk, None if op == "d" else row, row if op == "d" else None, lsn))
        lsn += 10
    return corpus


@dataclass
class Service:
    url: str
    lake: str
    index: str
    broker: str
    tmp: Path

    def search(self, query: str, auth: str | None = BOB, **body: object) -> httpx.Response:
        headers = {"Authorization": auth} if auth else {}
        return httpx.post(f"{self.url}/v1/search", json={"query": query, **body}, headers=headers, timeout=30)

    def ingest(self, corpus: Corpus, name: str) -> None:
        produce(self.broker, TOPIC, corpus, self.tmp / f"{name}.jsonl")
        mapping = self.tmp / "mapping.yaml"
        mapping.write_text("default: {metadata: [shelf]}\n")
        out = cli(*ingest_args(self.broker, TOPIC, self.lake, self.tmp / "recovery", idle=3), "--mapping", str(mapping))
        assert out.returncode == 0, out.stderr[-3000:]


def wait_ready(url: str, proc, timeout: float = 180) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            r = httpx.get(f"{url}/healthz", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError("the server did not become ready")


@pytest.fixture(scope="module")
def service(broker: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("serve")
    lake, index = str(tmp / "lake"), str(tmp / "index")
    rows = [(i + 1, t.title(), body, "hr" if i == SECRET else "") for i, (t, body) in enumerate(TOPICS)]
    svc = Service("", lake, index, broker, tmp)
    svc.ingest(doc_events(100, rows), "initial")
    out = cli("index", "build", "--lake", lake, "--index", index, "--nlist", "2", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (tmp / "tokens.yaml").write_text(
        json.dumps({"tokens": {t: {"principal": p, "groups": g} for t, (p, g) in TOKENS.items()}})
    )
    port = free_port()
    # The lake is polled only every 30 s: every change these tests wait for must arrive by the
    # ingest job's commit notices (pipelines/notices.py), within the tests' 10 s deadlines.
    proc = start(["serve", "--lake", lake, "--index", index, "--port", str(port), "--tokens", str(tmp / "tokens.yaml"),
                  "--bootstrap", broker, "--tail-poll", "30", "--index-poll", "0.5", "--cache-dir", str(tmp / "cache"),
                  "--no-answers"], None, tmp / "serve.log")  # fmt: skip
    svc.url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(svc.url, proc)
        yield svc
    finally:
        kill_group(proc)
    log = (tmp / "serve.log").read_text()
    assert "Traceback" not in log, log[-5000:]
    assert "token-of-" not in log, "tokens must never be logged"


def test_search_returns_the_matching_document_with_lineage(service: Service) -> None:
    r = service.search("birds that cannot fly but swim", k=3)
    assert r.status_code == 200, r.text
    body = r.json()
    top = body["results"][0]
    assert top["doc_id"].endswith("/1") and "Penguins" in top["text"]
    assert top["source"]["table"] == "public.docs" and top["source"]["pk"] == "1"
    assert top["source"]["position"] and top["source"]["kafka"]["topic"] == TOPIC
    assert isinstance(top["source"]["kafka"]["offset"], int)
    assert top["index_version"] == body["index_version"] == 1 and top["lake_version"] >= 1


def test_acls_fail_closed(service: Service) -> None:
    r = service.search("executive salaries", k=10, auth=BOB)
    assert r.json()["results"] and all("Payroll" not in x["text"] for x in r.json()["results"])
    r = service.search("executive salaries", k=1, auth=HANA)
    assert "Payroll" in r.json()["results"][0]["text"]


def test_auth_errors_are_401_json(service: Service) -> None:
    for auth in (None, "Bearer wrong-token-wrong-token", "Basic abc", "Bearer"):
        r = service.search("chess", auth=auth)
        assert r.status_code == 401 and "error" in r.json() and "Traceback" not in r.text, (auth, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "body, problem",
    [
        ({"k": 3}, "query"),
        ({"query": "", "k": 3}, "query"),
        ({"query": "x", "k": 0}, "k"),
        ({"query": "x", "k": 1000}, "k"),
        ({"query": "x", "k": "ten"}, "k"),
        ({"query": "x", "as_of": -1}, "as_of"),
        ({"query": "x", "unknown": 1}, "unknown"),
        ({"query": "x" * 5000}, "query"),
    ],
)
def test_bad_bodies_are_422_saying_what_is_wrong(service: Service, body: dict, problem: str) -> None:
    r = httpx.post(f"{service.url}/v1/search", json=body, headers={"Authorization": BOB}, timeout=10)
    assert r.status_code == 422 and problem in r.json()["error"], r.text


def test_not_json_oversized_and_unknown_routes(service: Service) -> None:
    h = {"Authorization": BOB, "Content-Type": "application/json"}
    r = httpx.post(f"{service.url}/v1/search", content=b"{not json", headers=h, timeout=10)
    assert r.status_code == 422 and "error" in r.json()
    form = {"Authorization": BOB, "Content-Type": "application/x-www-form-urlencoded"}  # what curl -d sends
    r = httpx.post(f"{service.url}/v1/search", content=b'{"query": "chess", "k": 1}', headers=form, timeout=10)
    assert r.status_code == 200 and "Chess" in r.json()["results"][0]["text"], r.text
    r = httpx.post(f"{service.url}/v1/search", content=b"x" * 100_000, headers=h, timeout=10)
    assert r.status_code == 413 and "error" in r.json()
    r = httpx.get(f"{service.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = service.search("chess", as_of=10**9)
    assert r.status_code == 404 and "newer than" in r.json()["error"]


def test_updates_and_deletes_are_visible_within_seconds(service: Service) -> None:
    before = service.search("flightless seabirds", k=1).json()["results"][0]
    assert before["doc_id"].endswith("/1")
    changed = "Penguins now live in the desert and eat cactus fruit, according to this revised entry."
    corpus = doc_events(1000, [(1, "Penguin", changed, "")], op="u")
    corpus.lines += doc_events(1010, [(5, "Glacier", TOPICS[4][1], "")], op="d").lines
    t0 = time.monotonic()
    service.ingest(corpus, "changes")
    ingested = time.monotonic()
    deadline = ingested + 10
    while time.monotonic() < deadline:
        top = service.search("penguins in the desert eating cactus", k=1).json()["results"][0]
        glacier = [r for r in service.search("slowly moving ice", k=10).json()["results"] if r["doc_id"].endswith("/5")]
        if "cactus" in top["text"] and not glacier:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the update and the delete were not reflected within 10 s of their commit")
    assert top["origin"] == "tail" and top["index_version"] == 1
    print(f"visible {time.monotonic() - ingested:.2f} s after ingest returned ({ingested - t0:.1f} s ingest)")
    results = service.search("flightless seabirds swim with wings", k=10).json()["results"]
    assert not [r for r in results if "wings" in r["text"]], "the old version must be gone"


def test_hot_swap_to_a_new_index_under_concurrent_queries(service: Service) -> None:
    failures: list[str] = []
    versions: set[int] = set()
    stop = threading.Event()

    def hammer() -> int:
        n = 0
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                r = client.post(f"{service.url}/v1/search", json={"query": "string instrument", "k": 3},
                                headers={"Authorization": BOB})  # fmt: skip
                n += 1
                if r.status_code != 200 or not r.json()["results"]:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                else:
                    versions.add(r.json()["index_version"])
        return n

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(hammer) for _ in range(4)]
        out = cli("index", "build", "--lake", service.lake, "--index", service.index, "--nlist", "2", timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and max(versions, default=0) < 2:
            time.sleep(0.2)
        stop.set()
        requests = sum(f.result() for f in futures)
    assert not failures, failures[:5]
    assert 2 in versions and requests > 10
    health = httpx.get(f"{service.url}/healthz", timeout=5).json()
    assert health["index_version"] == 2 and health["status"] == "ok"


def test_metrics(service: Service) -> None:
    text = httpx.get(f"{service.url}/metrics", timeout=5).text
    for name in ("streamrag_http_request_seconds_bucket", "streamrag_shard_cache_requests_total",
                 "streamrag_tail_rows", "streamrag_tail_lag_seconds", "streamrag_index_version"):  # fmt: skip
        assert name in text, name
    assert 'route="/v1/search"' in text
    received = [line for line in text.splitlines() if line.startswith("streamrag_commit_notices_total{")]
    assert any('outcome="received"' in line and float(line.split()[-1]) > 0 for line in received), received


def test_search_cli_uses_the_same_engine(service: Service) -> None:
    args = ["search", "--lake", service.lake, "--index", service.index, "--cache-dir", str(service.tmp / "cli-cache")]
    out = cli(*args, "executive salaries", "-k", "3", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout)["results"]
    assert results and all("Payroll" not in r["text"] for r in results)
    out = cli(*args, "executive salaries", "-k", "1", "--groups", "hr")
    assert out.returncode == 0 and "Payroll" in out.stdout and "public.docs/9" in out.stdout, out.stdout


def test_serve_refuses_unsafe_or_impossible_setups(service: Service, tmp_path: Path) -> None:
    out = cli("serve", "--lake", service.lake, "--index", service.index, "--host", "0.0.0.0")
    assert out.returncode == 1 and "without --tokens" in out.stderr and "Traceback" not in out.stderr
    port = int(service.url.rsplit(":", 1)[1])
    out = cli("serve", "--lake", service.lake, "--index", service.index, "--port", str(port))
    assert out.returncode == 1 and "cannot listen" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "bad.yaml").write_text("short: {principal: x}")
    out = cli("serve", "--lake", service.lake, "--index", service.index, "--tokens", str(tmp_path / "bad.yaml"),
              "--port", "0")  # fmt: skip
    assert out.returncode == 1 and "at least 16 characters" in out.stderr


def test_metadata_columns_come_back_and_filter_the_search(service: Service) -> None:
    """A mapping's metadata columns travel through the real job and index into results."""
    r = service.search("something to eat or drink", k=5, filter={"shelf": "food"})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert {x["source"]["pk"] for x in results} == {"4", "7"}  # espresso, tomato: the only food
    assert all(x["metadata"] == {"shelf": "food"} for x in results)
    bad = service.search("anything", filter={"shelf": {"nested": True}})
    assert bad.status_code == 422 and "filter" in bad.json()["error"]
