"""``streamrag demo``: the whole system on embedded defaults, on the Python 3.11 documentation.

Every step runs the real command a user would run (``cdc postgres``, ``ingest``, ``index
build``, ``serve``) as a child process against the embedded broker, a local Postgres and a
local lake:

1. load the docs into a ``docs`` table of a local Postgres (a few documents restricted to
   the ``staff`` group); the Postgres source snapshots it and streams its changes to Kafka
   as Debezium events; ingest them, build the index, serve;
2. ask questions and print, for each, the extractive answer (the sources' own sentences, no
   model) and the generated one, both with their citations; search an exact API name in
   each mode (dense, keyword, hybrid);
3. apply live changes in SQL (an update, a delete, a new document) and time how long each
   takes from its COMMIT to show in search, without a rebuild;
4. print the lineage chain of one answer, and show that a caller outside ``staff`` never
   sees a restricted document's text (search, answer, lineage);
5. print a summary and exit 0, or keep serving with ``--keep-running``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from pipelines.pgcluster import LocalPostgres, docs_table
from retrieval.corpus import PYDOCS, Doc, load_pydocs

TOPIC = "cdc.demo.public.docs"
#: the default subset: small enough to ingest in a few minutes on 2 CPU cores
SUBSET = ("faq/", "tutorial/", "glossary", "library/functions", "library/json", "library/pathlib")
RESTRICTED = {"faq/windows", "faq/gui"}  # staff only
TOKENS = {
    "demo-token-alice-public-only": ("alice", []),
    "demo-token-sam-staff-member": ("sam", ["staff"]),
    "demo-token-ada-the-auditor!!": ("ada", ["auditor"]),
}
ALICE, SAM, ADA = (f"Bearer {t}" for t in TOKENS)
QUESTIONS = [
    "How do I read a file line by line?",
    "What is a lambda expression?",
    "Why are default values shared between objects?",
]
MARKER = "The streamrag demo added this sentence: live updates need no index rebuild."
NEW_DOC = Doc(
    "demo/streaming",
    "Streaming updates in the demo",
    "Streaming RAG keeps answers fresh. The new demo document explains that a change in the source "
    "database reaches search results within seconds, through Kafka, Bytewax and the Delta lake.",
)


def add_command(sub: Any) -> None:
    p = sub.add_parser("demo", help="the whole system on embedded defaults, on the Python docs")
    p.add_argument("--full", action="store_true", help="all 497 documents (about 40k chunks; slow on a laptop)")
    p.add_argument("--work", type=Path, default=Path("demo-data"), help="working directory, wiped first (demo-data)")
    p.add_argument("--port", type=int, default=8000, help="API port (8000)")
    p.add_argument("--keep-running", action="store_true", help="keep the broker, ingest job and API running")
    p.add_argument("--corpus", type=Path, default=PYDOCS, help=argparse.SUPPRESS)
    p.add_argument("--limit", type=int, help=argparse.SUPPRESS)  # tests: the first N documents of the subset
    p.add_argument("--max-tokens", type=int, default=256, help=argparse.SUPPRESS)  # tests: shorter answers
    p.add_argument(
        "--dtype",
        default="int8",
        help="embedding precision of the ingest job and the API: int8 (default: 2.1x fp32's throughput, the "
        "same nDCG@10 on the Python FAQ) or fp32",
    )
    p.set_defaults(func=cmd_demo)


def say(text: str = "") -> None:
    print(text, flush=True)


def heading(text: str) -> None:
    say(f"\n== {text} " + "=" * max(0, 70 - len(text)))


@dataclass
class Demo:
    work: Path
    port: int
    cli: list[str] = field(default_factory=lambda: [sys.executable, "-m", "retrieval.cli"])
    bootstrap: str = ""
    url: str = ""
    db: Any = None  # a psycopg2 connection to the demo database (autocommit)
    timings: dict[str, float] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def lake(self) -> str:
        return str(self.work / "lake")

    @property
    def index(self) -> str:
        return str(self.work / "index")

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.work / f"{name}.log").open("ab")
        proc = subprocess.Popen([*self.cli, *args], stdout=log, stderr=log, start_new_session=True)
        self.procs[name] = proc
        return proc

    def run(self, name: str, *args: str, timeout: float = 3600) -> str:
        out = subprocess.run([*self.cli, *args], capture_output=True, text=True, timeout=timeout)
        (self.work / f"{name}.log").write_text(out.stderr)
        if out.returncode != 0:
            raise RuntimeError(f"`streamrag {' '.join(args[:2])}` failed:\n{out.stderr[-2000:]}")
        return out.stdout

    def sql(self, statement: str, args: Any = None) -> float:
        """Run one statement in its own transaction; return when its COMMIT returned (monotonic)."""
        with self.db.cursor() as cur:
            cur.execute(statement, args)
        return time.monotonic()

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = self.work / f"{name}.log"
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                raise RuntimeError(f"`streamrag {name}` exited with {proc.returncode}; the end of {log}:\n{tail}")

    def post(self, path: str, body: dict[str, Any], auth: str = SAM) -> dict[str, Any]:
        r = httpx.post(f"{self.url}{path}", json=body, headers={"Authorization": auth}, timeout=600)
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    def get(self, path: str, auth: str = ADA) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={"Authorization": auth}, timeout=60)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def lake_docs(lake: str) -> set[str]:
    """Documents with at least one chunk version in the lake so far."""
    from deltalake import DeltaTable

    try:
        table = DeltaTable(f"{lake}/chunks").to_pyarrow_table(columns=["doc_id"])
    except Exception:  # noqa: BLE001 - not created yet
        return set()
    return set(table.column("doc_id").unique().to_pylist())


def wait_for(what: str, check: Any, timeout: float, demo: Demo, every: float = 0.1) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        demo.check_alive()
        if check():
            return time.monotonic() - t0
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def pick_docs(corpus: Path, full: bool, limit: int | None) -> list[Doc]:
    docs = load_pydocs(corpus)
    if not full:
        docs = [d for d in docs if d.id.startswith(SUBSET)]
    return docs[:limit] if limit else docs


def show_answer(answer: dict[str, Any], label: str = "answer") -> None:
    text = answer["answer"].replace("\n", "\n" + " " * (len(label) + 4))  # continuation lines under the first
    say(f"  {label}: {text}")
    if answer["no_answer"]:
        return
    for c in answer["citations"]:
        src = c["source"]
        say(
            f"    [{c['n']}] {c['doc_id']} — {c['title']} (table {src['table']}, pk {src['pk']}, position "
            f"{src['position']}, kafka {src['kafka']['topic']}@{src['kafka']['offset']}, support {c['support']:.2f})"
        )
    if answer["flagged"]:
        say(f"    flagged (no source supports it): {len(answer['flagged'])} sentence(s)")
    t = answer["timings"]
    took = f"{t['retrieve_ms']:.0f} ms retrieval, {t['total_ms'] / 1000:.1f} s total"
    say(f"    ({took}; answer id {answer['answer_id']})")


def search_top(demo: Demo, query: str, auth: str = SAM, k: int = 5) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = demo.post("/v1/search", {"query": query, "k": k}, auth)["results"]
    return results


@contextmanager
def running(demo: Demo, keep: bool) -> Iterator[None]:
    try:
        yield
    finally:
        if not keep:
            demo.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    from pipelines.broker import free_port, start_broker

    t_start = time.monotonic()
    docs = pick_docs(args.corpus, args.full, args.limit)
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    demo = Demo(args.work.resolve(), args.port)
    (demo.work / "tokens.yaml").write_text(
        json.dumps({"tokens": {t: {"principal": p, "groups": g} for t, (p, g) in TOKENS.items()}})
    )
    with ExitStack() as stack:
        heading("1. Start the dev broker, a local Postgres with the docs table, and the Postgres source")
        import psycopg2
        from psycopg2.extras import execute_values

        broker_port = free_port()
        broker = start_broker(broker_port)
        stack.callback(broker.wait, 10)
        stack.callback(broker.terminate)
        demo.bootstrap = f"127.0.0.1:{broker_port}"
        postgres = LocalPostgres(durable=False).start()
        stack.callback(postgres.stop)
        demo.db = psycopg2.connect(postgres.create_database("demo"))
        demo.db.autocommit = True
        stack.callback(demo.db.close)
        restricted = [d for d in docs if d.id in RESTRICTED]
        with demo.db.cursor() as cur:
            cur.execute(docs_table("text") + " CREATE PUBLICATION streamrag FOR TABLE docs")
            rows = [(d.id, d.title, d.body, ["staff"] if d.id in RESTRICTED else []) for d in docs]
            execute_values(cur, "INSERT INTO docs (id, title, body, acl) VALUES %s", rows, page_size=500)
        say(
            f"  {len(docs)} documents of {args.corpus} → table docs of Postgres on 127.0.0.1:{postgres.port} "
            f"({len(restricted)} restricted to group 'staff': {', '.join(sorted(d.id for d in restricted)) or '-'})"
        )
        stack.enter_context(running(demo, args.keep_running))
        demo.start("cdc", "cdc", "postgres", "--dsn", postgres.dsn("demo"), "--publication", "streamrag",
                   "--slot", "demo", "--bootstrap", demo.bootstrap, "--state-dir", str(demo.work / "cdc"))  # fmt: skip
        say(f"  streamrag cdc postgres: snapshot, then the slot's changes → {TOPIC} on {demo.bootstrap}")

        heading("2. Ingest: Kafka → Bytewax (decode, chunk, embed) → Delta lake")
        t0 = time.monotonic()
        ingest = ["ingest", "--bootstrap", demo.bootstrap, "--topic", TOPIC, "--lake", demo.lake,
                  "--recovery-dir", str(demo.work / "recovery"),
                  "--fetch-wait-ms", "10", "--dtype", args.dtype]  # fmt: skip  # Tansu holds a fetch for its whole wait
        demo.start("ingest", *ingest)
        expected = {f"public.docs/{d.id}" for d in docs}
        with tqdm(total=len(docs), desc="  documents in the lake", unit="doc", file=sys.stdout, mininterval=1) as bar:

            def loaded() -> bool:
                done = len(lake_docs(demo.lake) & expected)
                if done > bar.n:
                    bar.update(done - bar.n)
                return done >= len(docs)

            wait_for("the initial load", loaded, 3 * 3600, demo, every=1.0)
        demo.timings["ingest_s"] = time.monotonic() - t0
        from pipelines.lake import Lake, current_chunks

        chunks = current_chunks(Lake.at(demo.lake), columns=["chunk_id"]).num_rows
        say(f"  {chunks} chunks embedded and committed in {demo.timings['ingest_s']:.0f} s")

        heading("3. Build the IVF index (k-means on local Ray) and start the API with the embedded generator")
        t0 = time.monotonic()
        built = json.loads(demo.run("index", "index", "build", "--lake", demo.lake, "--index", demo.index, "--json"))
        demo.timings["index_s"] = time.monotonic() - t0
        say(
            f"  index version {built['version']}: {built['count']} vectors, nlist {built['nlist']}, "
            f"{built['shards']} shard(s), lake version {built['lake_version']} ({demo.timings['index_s']:.0f} s)"
        )
        t0 = time.monotonic()
        serve = ["serve", "--lake", demo.lake, "--index", demo.index, "--port", str(args.port),
                 "--tokens", str(demo.work / "tokens.yaml"), "--cache-dir", str(demo.work / "cache"),
                 "--tail-poll", "0.2", "--max-tokens", str(args.max_tokens), "--dtype", args.dtype]  # fmt: skip
        demo.start("serve", *serve)
        demo.url = f"http://127.0.0.1:{args.port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{demo.url}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        demo.timings["serve_ready_s"] = wait_for("the API", ready, 600, demo)
        say(f"  API on {demo.url} ready in {demo.timings['serve_ready_s']:.1f} s (tokens: {demo.work / 'tokens.yaml'})")
        say(f"  lineage explorer: {demo.url}/ui (sign in with a token: {SAM.split()[1]} sees the staff pages)")

        heading("4. Ask questions (as 'sam', group staff)")
        answers = []
        for q in QUESTIONS:
            say(f"\n  Q: {q}")
            # First the sources' own sentences (no model: every citation an exact span), then the model's answer.
            show_answer(demo.post("/v1/answer", {"question": q, "k": 4, "style": "extract"}), "extracted")
            answer = demo.post("/v1/answer", {"question": q, "k": 4, "style": "generate"})
            answers.append(answer)
            show_answer(answer, "generated")
        demo.timings["answer_p50_s"] = sorted(a["timings"]["total_ms"] for a in answers)[len(answers) // 2] / 1000

        heading("5. Search modes: an exact API name by vectors, by keywords (BM25), and both fused")
        modes_report(demo, docs)

        heading("6. Live changes, no rebuild: update, delete, insert")
        freshness = live_changes(demo, docs)

        heading("7. Lineage of the first answer (as the auditor)")
        from retrieval.commands import render_lineage

        chain = demo.get(f"/v1/lineage/answers/{answers[0]['answer_id']}").json()
        say(render_lineage("answer", chain))
        say(f"  in the browser: {demo.url}/ui/answers/{answers[0]['answer_id']}")

        heading("8. ACLs: 'alice' (no groups) vs 'sam' (staff) on a restricted document")
        acl_report(demo, restricted)

        heading("Summary")
        say(f"  documents {len(docs)}, chunks {chunks}, index version {built['version']} (nlist {built['nlist']})")
        say(
            f"  ingest {demo.timings['ingest_s']:.0f} s, index build {demo.timings['index_s']:.0f} s, "
            f"API ready {demo.timings['serve_ready_s']:.1f} s, answer p50 {demo.timings['answer_p50_s']:.1f} s"
        )
        say(
            "  freshness (SQL COMMIT → visible in /v1/search): "
            + ", ".join(f"{k} {v:.2f} s" for k, v in freshness.items())
        )
        say(f"  total {time.monotonic() - t_start:.0f} s; logs and data under {demo.work}")
        if args.keep_running:
            say(
                f"\nServing on {demo.url} (Ctrl-C stops everything). Try:\n"
                f"  curl -s {demo.url}/v1/answer -H 'Authorization: {SAM}' -d '{{\"question\": \"What is a tuple?\"}}'"
            )
            try:
                while True:
                    demo.check_alive()
                    time.sleep(1)
            except KeyboardInterrupt:
                demo.stop()
    return 0


def live_changes(demo: Demo, docs: list[Doc]) -> dict[str, float]:
    """An UPDATE, a DELETE and an INSERT in Postgres; time each from its COMMIT until /v1/search
    reflects it (through the source, Kafka, the ingest job, the lake and the service's tail)."""
    out: dict[str, float] = {}
    target = next(d for d in docs if d.id not in RESTRICTED)
    t0 = demo.sql("UPDATE docs SET body = body || %s WHERE id = %s", (f"\n\n{MARKER}\n", target.id))
    wait_for("the update", lambda: any(MARKER in r["text"] for r in search_top(demo, MARKER, k=3)), 120, demo)
    out["update"] = time.monotonic() - t0
    say(f"  UPDATE docs … WHERE id = '{target.id}': the new sentence is found by search after {out['update']:.2f} s")

    victim = next(d for d in reversed(docs) if d.id not in RESTRICTED and d.id != target.id)
    query = " ".join(victim.body.split()[:60])  # its opening: its first chunk is the top hit
    probe = search_top(demo, query, k=10)
    t0 = demo.sql("DELETE FROM docs WHERE id = %s", (victim.id,))
    doc_id = f"public.docs/{victim.id}"
    wait_for("the delete", lambda: all(r["doc_id"] != doc_id for r in search_top(demo, query, k=10)), 120, demo)
    out["delete"] = time.monotonic() - t0
    hits_before = sum(r["doc_id"] == doc_id for r in probe)
    say(
        f"  DELETE FROM docs WHERE id = '{victim.id}': {hits_before} of its chunks were in the top 10, "
        f"none after {out['delete']:.2f} s"
    )

    t0 = demo.sql("INSERT INTO docs (id, title, body) VALUES (%s, %s, %s)", (NEW_DOC.id, NEW_DOC.title, NEW_DOC.body))
    wait_for(
        "the insert",
        lambda: (
            search_top(demo, "how fresh are streaming RAG answers", k=3)[0]["doc_id"] == f"public.docs/{NEW_DOC.id}"
        ),
        120,
        demo,
    )
    out["insert"] = time.monotonic() - t0
    say(f"  INSERT INTO docs ('{NEW_DOC.id}', …): top search result after {out['insert']:.2f} s")
    answer = demo.post("/v1/answer", {"question": "How quickly do source changes reach search results?", "k": 3})
    show_answer(answer)
    return out


def identifier(docs: list[Doc]) -> tuple[str, str] | None:
    """An API name (``module.function``) that only one document of the subset mentions, the
    one mentioned most, and that document's id: what a user pastes into a search box."""
    counts: dict[str, dict[str, int]] = {}
    for doc in docs:
        for name in re.findall(r"\b([a-z_]{2,}\.[a-z_]{3,})\(", doc.body):
            counts.setdefault(name, {}).setdefault(doc.id, 0)
            counts[name][doc.id] += 1
    single = sorted((n, name, doc_id) for name, by in counts.items() if len(by) == 1 for doc_id, n in by.items())
    return (single[-1][1], single[-1][2]) if single else None


def modes_report(demo: Demo, docs: list[Doc]) -> None:
    found = identifier(docs)
    if found is None:
        say("  (no API name in this subset)")
        return
    name, doc_id = found
    say(f"  query {name!r} (mentioned only in {doc_id}): the top 3 of each mode")
    for mode in ("dense", "keyword", "hybrid"):
        results = demo.post("/v1/search", {"query": name, "k": 3, "mode": mode}, SAM)["results"]
        shown = []
        for r in results:
            ranks = ", ".join(f"{by} #{hit['rank']}" for by, hit in r["retrievers"].items())
            shown.append(r["doc_id"].removeprefix("public.docs/") + (f" ({ranks})" if mode == "hybrid" else ""))
        say(f"    {mode:>7}: {'; '.join(shown) or '(nothing)'}")


def acl_report(demo: Demo, restricted: list[Doc]) -> None:
    if not restricted:
        say("  (no restricted document in this subset)")
        return
    doc = restricted[0]
    question = doc.title if doc.title.endswith("?") else f"What does '{doc.title}' say?"
    doc_id = f"public.docs/{doc.id}"
    sam = search_top(demo, doc.title, SAM, k=5)
    alice = search_top(demo, doc.title, ALICE, k=5)
    say(
        f"  search '{doc.title}': sam sees {sum(r['doc_id'] == doc_id for r in sam)} of its chunks in the top 5, "
        f"alice {sum(r['doc_id'] == doc_id for r in alice)}"
    )
    texts = {r["text"] for r in sam if r["doc_id"] == doc_id}
    answer = demo.post("/v1/answer", {"question": question, "k": 5}, ALICE)
    leaked = any(t in json.dumps(answer) for t in texts) or any(s["doc_id"] == doc_id for s in answer["sources"])
    say(f"  alice asks '{question}': {len(answer['sources'])} sources, none from {doc.id}: {not leaked}")
    r = demo.get(f"/v1/lineage/sources/public.docs/{doc.id}", ALICE)
    say(f"  alice asks the lineage of {doc.id}: HTTP {r.status_code} ({r.json().get('error', '')})")
    if leaked or r.status_code != 404 or any(row["doc_id"] == doc_id for row in alice):
        raise RuntimeError("ACL violation: alice saw a restricted document")
