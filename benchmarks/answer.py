"""Answer benchmarks: one JSON line per figure, each against a baseline measured in the same run.

    .venv/bin/python benchmarks/answer.py                  # all sections
    .venv/bin/python benchmarks/answer.py --only overhead --requests 400

The corpus is the Python docs (real embeddings, cached by benchmarks/pydocs.py) served by
``streamrag serve`` as users run it.

Sections
- latency: /v1/answer with the embedded generator (SmolLM2-135M on llama.cpp), one client,
  questions from the Python FAQ: retrieval, time to first token (streamed) and total,
  p50/p95, next to the generator alone on the same prompts (what grounding adds).
- citations: for the same answers, the share of attributed sentences whose source really
  contains the supporting text (lexical check: >= 60% of the sentence's content words
  occur in the source), against two baselines: the markers the model wrote itself and a
  random source from the same prompt. Also the share of sentences attributed at all.
- usefulness: every question of the Python FAQ (its gold answer: the chunks under its
  heading, as benchmarks/quality.py finds them), asked in each style (``extract``,
  ``generate``) at k = 5: answer hit rate (the answer cites a chunk of the gold answer)
  beside the retrieval's own hit rate (a gold chunk among the k sources), citation
  precision by the lexical check above (extract: also that every cited span is verbatim),
  the share of sentences flagged, latency (``--styles`` to run one); ten answers of each style printed as
  ``answer_sample`` lines for a person to read. ``--corpus faq`` indexes only the FAQ
  pages (minutes instead of the ~25 of embedding the whole docs the first time).
- rejudge (``--rejudge DUMP``): the generated answers a usefulness run wrote with
  ``--dump``, attributed again by the current ``serving.citations`` (no generation: the same
  answers), at the service's defaults and over a grid of similarity and overlap thresholds;
  the grid is chosen on even-numbered questions (most sentences attributed where the 90%
  lower bound of citation precision is >= 0.8) and reported on the odd-numbered ones. This
  is how AnswerOptions' thresholds were calibrated:

      .venv/bin/python benchmarks/answer.py --only usefulness --styles generate --corpus faq --dump answers.jsonl
      .venv/bin/python benchmarks/answer.py --corpus faq --rejudge answers.jsonl
- overhead: the audit log's cost on /v1/answer p50 (target <= 5%): two services, audit
  on and off, on the same index, both answered by a fixed-reply generator (so the
  generator's own variance does not drown the difference), requests interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np

from benchmarks.index import emit
from benchmarks.pydocs import embedded_pydocs
from benchmarks.retrieval import pydocs_lake, serve
from indexing.distributed import start_ray
from retrieval.corpus import load_pydocs, section_titles

STOP = set(
    "the and for are but not you your with this that from have has was were will can its it's into than then "
    "there their they them what when where which while who why how use used using also such may might must "
    "should would could does did done been being any all each other more most some only same very just one "
    "two about above below over under out off our ours".split()
)


def faq_questions(n: int) -> list[str]:
    """Question headings of the Python FAQ pages (fixed order, first ``n`` after a seeded shuffle)."""
    found = sorted({t for d in load_pydocs() if d.id.startswith("faq/") for t in section_titles(d.body)
                    if t.endswith("?")})  # fmt: skip
    random.Random(5).shuffle(found)
    return found[:n]


def words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z_][a-z0-9_]{2,}", text.lower()) if w not in STOP}


def supported(sentence: str, source: str) -> bool | None:
    """Does ``source`` contain the sentence's content? None: too short to judge."""
    mine = words(sentence)
    if len(mine) < 3:
        return None
    return len(mine & words(source)) / len(mine) >= 0.6


def pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 1), "p95": round(ordered[int(0.95 * (len(ordered) - 1))], 1),
            "n": len(ordered)}  # fmt: skip


def sse_first_token_ms(url: str, question: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    first = None
    done: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}/v1/answer", json={"question": question, "stream": True}, timeout=300) as r:
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if event == "token" and first is None:
                    first = (time.perf_counter() - t0) * 1000
                elif event == "done":
                    done = json.loads(line[6:])
    return first or 0.0, done


def bench_latency_and_citations(url: str, generator: str, questions: list[str]) -> None:
    """Three passes over the questions (so consecutive prompts share only the fixed prefix,
    as in production): answers, streamed answers, the generator alone on the same prompts."""
    http = httpx.Client(timeout=300)
    retrieve, total, bodies, chains = [], [], [], []
    for q in questions:
        t0 = time.perf_counter()
        body = http.post(f"{url}/v1/answer", json={"question": q}).json()
        total.append((time.perf_counter() - t0) * 1000)
        retrieve.append(body["timings"]["retrieve_ms"])
        bodies.append(body)
        chains.append(http.get(f"{url}/v1/lineage/answers/{body['answer_id']}").json())
    ttft = [sse_first_token_ms(url, q)[0] for q in questions]
    raw_ttft, raw_total = [], []
    for q, chain in zip(questions, chains, strict=True):
        t1 = time.perf_counter()
        first_raw = None
        request = {"messages": chain_prompt(chain, q), "max_tokens": 256, "temperature": 0, "stream": True}
        with http.stream("POST", f"{generator}/chat/completions", json=request) as g:
            for line in g.iter_lines():
                if line.startswith("data: ") and first_raw is None and '"content"' in line:
                    first_raw = (time.perf_counter() - t1) * 1000
        raw_total.append((time.perf_counter() - t1) * 1000)
        raw_ttft.append(first_raw or 0.0)
    alone = {"first_token_ms": pct(raw_ttft), "total_ms": pct(raw_total)}
    emit(bench="answer_latency", questions=len(questions), retrieve_ms=pct(retrieve), first_token_ms=pct(ttft),
         total_ms=pct(total), generator_alone=alone)  # fmt: skip

    judged: dict[str, list[bool | None]] = {"attributed": [], "model_markers": [], "random": []}
    sentences = attributed = 0
    rng = random.Random(0)
    for body, chain in zip(bodies, chains, strict=True):
        texts = {s["n"]: s.get("text", "") for s in chain["sources"]}
        for s in body["sentences"]:
            sentences += 1
            attributed += bool(s["sources"])
            for n in s["sources"][:1]:
                judged["attributed"].append(supported(s["text"], texts[n]))
            for n in re.findall(r"\[(\d+)\]", raw_sentence(body, s))[:1]:
                if int(n) in texts:
                    judged["model_markers"].append(supported(s["text"], texts[int(n)]))
            if texts:
                judged["random"].append(supported(s["text"], texts[rng.choice(list(texts))]))
    verdicts = {k: [v for v in vs if v is not None] for k, vs in judged.items()}
    threshold_sweep(bodies, chains)
    emit(bench="citation_precision", questions=len(questions), sentences=sentences,
         attributed_share=round(attributed / max(1, sentences), 3),
         **{f"{k}_precision": round(sum(v) / len(v), 3) if v else None for k, v in verdicts.items()},
         **{f"{k}_judged": len(v) for k, v in verdicts.items()})  # fmt: skip


def threshold_sweep(bodies: list[dict[str, Any]], chains: list[dict[str, Any]]) -> None:
    """Coverage and precision of attribution at other similarity thresholds, same answers."""
    from serving.st_embedder import SentenceTransformerEmbedder

    embedder = SentenceTransformerEmbedder(device="cpu")
    best: list[tuple[float, bool | None]] = []
    for body, chain in zip(bodies, chains, strict=True):
        sources = [s.get("text", "") for s in chain["sources"]]
        sentences = [s["text"] for s in body["sentences"]]
        if not sources or not sentences:
            continue
        sims = embedder.embed(sentences) @ embedder.embed(sources).T
        for i, sentence in enumerate(sentences):
            j = int(sims[i].argmax())
            best.append((float(sims[i, j]), supported(sentence, sources[j])))
    for threshold in (0.3, 0.4, 0.5, 0.6, 0.7):
        kept = [v for sim, v in best if sim >= threshold]
        judged = [v for v in kept if v is not None]
        emit(bench="citation_threshold", threshold=threshold, sentences=len(best),
             attributed_share=round(len(kept) / max(1, len(best)), 3),
             precision=round(sum(judged) / len(judged), 3) if judged else None, judged=len(judged))  # fmt: skip


def raw_sentence(body: dict[str, Any], s: dict[str, Any]) -> str:
    """The model's own text of a sentence (markers included), found in the raw answer."""
    raw = body.get("raw_answer") or ""
    head = s["text"][:30]
    at = raw.find(head)
    return raw[at : at + len(s["text"]) + 40] if at >= 0 else ""


def chain_prompt(chain: dict[str, Any], question: str) -> list[dict[str, str]]:
    from retrieval.answer import AnswerOptions, clip
    from serving.prompt import Source, build_messages

    limit = AnswerOptions().max_source_chars
    sources = [Source(s["n"], s.get("title") or "", clip(s.get("text", ""), limit)) for s in chain["sources"]]
    return build_messages(question, sources)


class FixedReply:
    """An OpenAI-compatible server that answers every chat completion with one fixed reply."""

    def __init__(self, reply: str) -> None:
        body = json.dumps({"model": "fixed", "choices": [{"message": {"role": "assistant", "content": reply},
                                                           "finish_reason": "stop"}]}).encode()  # fmt: skip
        models = json.dumps({"data": [{"id": "fixed"}]}).encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, payload: bytes) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                self._send(models)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self._send(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def bench_usefulness(
    url: str,
    corpus_texts: list[str],
    qs: list[Any],
    styles: list[str],
    k: int = 5,
    show: int = 10,
    dump: Path | None = None,
) -> None:
    """Each style on every FAQ question: do answers cite the gold answer, are the citations right
    (``dump``: every answer, with its sources' texts, one JSON line each, for calibrating attribution)."""
    http = httpx.Client(timeout=300)
    dumped = dump.open("w", buffering=1) if dump else None  # line-buffered: a killed run keeps what it wrote
    rng = random.Random(3)
    shown = set(rng.sample(range(len(qs)), min(show, len(qs))))
    for style in styles:
        hits, found, first, verdicts, exact, latency = [], [], [], [], [], []
        #: retrieval's hit at as many sources as the answer cites (at least 1), and that many
        found_at_cited, cited = [], []
        sentences = flagged = 0
        for i, q in enumerate(qs):
            body = http.post(f"{url}/v1/answer", json={"question": q.text, "k": k, "style": style}).json()
            latency.append(body["timings"]["total_ms"])
            sources = {s["n"]: int(s["chunk_id"][1:]) for s in body["sources"]}  # chunk c0001234 = corpus row 1234
            found.append(any(r in q.relevant for r in sources.values()))
            first.append(sources.get(1) in q.relevant)
            hits.append(any(int(c["chunk_id"][1:]) in q.relevant for c in body["citations"]))
            cited.append(len({c["chunk_id"] for c in body["citations"]}))
            found_at_cited.append(any(sources.get(n) in q.relevant for n in range(1, max(1, cited[-1]) + 1)))
            if dumped:
                texts = {n: corpus_texts[row] for n, row in sources.items()}
                dumped.write(json.dumps({"style": style, "question": q.text, "body": body, "texts": texts}) + "\n")
            for sentence in body["sentences"]:
                sentences += 1
                flagged += sentence["flagged"]
                for n in sentence["sources"][:1]:
                    text = corpus_texts[sources[n]]
                    verdicts.append(supported(sentence["text"], text))
                    if sentence.get("span"):
                        a, b = sentence["span"]
                        exact.append(text[a:b] == sentence["text"])
            if i in shown:
                emit(bench="answer_sample", style=style, question=q.text, answer=body["answer"],
                     gold_cited=hits[-1], flagged=body["flagged"])  # fmt: skip
        judged = [v for v in verdicts if v is not None]
        emit(bench="answer_usefulness", style=style, questions=len(qs), k=k,
             hit_rate=round(sum(hits) / len(qs), 3), retrieval_hit_rate=round(sum(found) / len(qs), 3),
             retrieval_hit_rate_at_1=round(sum(first) / len(qs), 3),
             retrieval_hit_rate_at_cited=round(sum(found_at_cited) / len(qs), 3),
             cited_chunks_mean=round(sum(cited) / len(qs), 2),
             citation_precision=round(sum(judged) / len(judged), 3) if judged else None, judged=len(judged),
             spans_verbatim=round(sum(exact) / len(exact), 3) if exact else None,
             sentences=sentences, flagged_share=round(flagged / max(1, sentences), 3),
             total_ms=pct(latency))  # fmt: skip


def bench_overhead(lake: str, index: str, work: Path, questions: list[str], requests: int) -> None:
    fixed = FixedReply("The standard library documents this in detail. You can read the relevant section for examples.")
    on, url_on = serve(lake, index, work, "--generator-url", fixed.url, answers=True)
    off, url_off = serve(lake, index, work, "--generator-url", fixed.url, "--no-audit", answers=True)
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        with httpx.Client(timeout=60) as http:
            for i in range(requests + 20):
                q = questions[i % len(questions)] + f" ({i})"  # distinct: no query-cache hits
                for name, url in (("on", url_on), ("off", url_off)) if i % 2 else (("off", url_off), ("on", url_on)):
                    t0 = time.perf_counter()
                    r = http.post(f"{url}/v1/answer", json={"question": q})
                    assert r.status_code == 200, r.text
                    if i >= 20:  # warm-up
                        times[name].append((time.perf_counter() - t0) * 1000)
        p50_on, p50_off = statistics.median(times["on"]), statistics.median(times["off"])
        emit(bench="audit_overhead", requests=requests, p50_ms_audit_on=round(p50_on, 2),
             p50_ms_audit_off=round(p50_off, 2), overhead=round(p50_on / p50_off - 1, 4),
             p99_ms_audit_on=round(sorted(times["on"])[int(0.99 * (requests - 1))], 2),
             p99_ms_audit_off=round(sorted(times["off"])[int(0.99 * (requests - 1))], 2),
             target="overhead <= 0.05")  # fmt: skip
    finally:
        for proc in (on, off):
            os.killpg(proc.pid, 15)
            proc.wait(60)
        fixed.server.shutdown()


def precision_floor(found: dict[str, Any], z: float = 1.645) -> float:
    """The lower end of the 90% Wilson interval of a citation precision (a hundred judged
    sentences leave ±0.06: a point that just reaches 0.8 on the dev half need not on the other)."""
    n, p = found["judged"], found["citation_precision"]
    if not n or p is None:
        return 0.0
    centre = p + z * z / (2 * n)
    spread = z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5
    return (centre - spread) / (1 + z * z / n)


#: the rejudge grid: (similarity threshold, overlap threshold); (0.5, 0.0) is similarity alone,
#: the rule before overlap was required
REJUDGE = [(0.5, 0.0)] + [(t, o) for t in (0.3, 0.4, 0.5) for o in (0.5, 0.6, 0.65, 0.7, 0.8)]


def bench_rejudge(dump: Path, corpus_texts: list[str], gold: dict[str, set[int]]) -> None:
    """Attribute the dumped generated answers again, as the service would now, over a grid."""
    from retrieval.answer import AnswerOptions, clip
    from serving.citations import attribute, strip_markers
    from serving.prompt import Source
    from serving.st_embedder import SentenceTransformerEmbedder

    class Memo:  # the grid re-attributes the same sentences: embed each once
        def __init__(self) -> None:
            self.embedder = SentenceTransformerEmbedder(device="cpu")
            self.vectors: dict[str, Any] = {}

        def embed(self, texts: list[str]) -> Any:
            missing = [t for t in dict.fromkeys(texts) if t not in self.vectors]
            if missing:
                self.vectors.update(zip(missing, self.embedder.embed(missing), strict=True))
            return np.stack([self.vectors[t] for t in texts])

    cached = Memo()

    options = AnswerOptions()
    answers = [json.loads(line) for line in dump.open()]
    answers = [a for a in answers if a["style"] == "generate" and a["body"].get("raw_answer")]
    prepared = []
    for a in answers:
        body = a["body"]
        rows = {s["n"]: int(s["chunk_id"][1:]) for s in body["sources"]}
        sources = [Source(n, s.get("title") or "", clip(corpus_texts[rows[n]], options.max_source_chars))
                   for n, s in zip(rows, body["sources"], strict=True)]  # fmt: skip
        vectors = cached.embed([corpus_texts[rows[n]] for n in rows])
        prepared.append((a["question"], body["raw_answer"], sources, vectors, rows))

    def run(threshold: float, min_overlap: float, part: int | None) -> dict[str, Any]:
        sentences = attributed = 0
        hits: list[bool] = []
        verdicts: list[bool] = []
        for i, (question, raw, sources, vectors, rows) in enumerate(prepared):
            if part is not None and i % 2 != part:
                continue
            found = attribute(raw, sources, cached, threshold, options.marker_threshold, vectors, min_overlap)
            for s in found.sentences:
                sentences += 1
                attributed += bool(s.sources)
                for n in s.sources[:1]:
                    verdict = supported(strip_markers(s.text), corpus_texts[rows[n]])
                    if verdict is not None:
                        verdicts.append(verdict)
            hits.append(any(rows[n] in gold.get(question, set()) for n in found.cited))
        return {"answers": len(hits), "sentences": sentences,
                "attributed_share": round(attributed / max(1, sentences), 3),
                "flagged_share": round(1 - attributed / max(1, sentences), 3),
                "citation_precision": round(sum(verdicts) / len(verdicts), 3) if verdicts else None,
                "judged": len(verdicts), "hit_rate": round(sum(hits) / max(1, len(hits)), 3)}  # fmt: skip

    grid = {(t, o): (run(t, o, 0), run(t, o, 1)) for t, o in REJUDGE}
    for (t, o), (dev, held) in grid.items():
        emit(bench="attribution_grid", threshold=t, min_overlap=o, dev=dev, held_out=held)
    eligible = [key for key, (dev, _) in grid.items() if precision_floor(dev) >= 0.8]
    if eligible:
        chosen = max(eligible, key=lambda key: grid[key][0]["attributed_share"])
        emit(bench="attribution_choice", threshold=chosen[0], min_overlap=chosen[1], dev=grid[chosen][0],
             held_out=grid[chosen][1], dev_precision_floor=round(precision_floor(grid[chosen][0]), 3),
             note="most dev sentences attributed where precision's 90% lower bound >= 0.8")  # fmt: skip
    emit(bench="attribution_defaults", threshold=options.threshold, min_overlap=options.min_overlap,
         all=run(options.threshold, options.min_overlap, None), similarity_alone=run(0.5, 0.0, None))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["latency", "citations", "usefulness", "overhead"], action="append")
    parser.add_argument("--questions", type=int, default=30)
    parser.add_argument("--styles", nargs="+", choices=["extract", "generate"], default=["extract", "generate"])
    parser.add_argument("--corpus", choices=["all", "faq"], default="all", help="docs indexed (faq: its pages)")
    parser.add_argument("--requests", type=int, default=300, help="requests per service in the overhead section")
    parser.add_argument("--dump", type=Path, help="usefulness: write every answer and its sources' texts here (JSONL)")
    parser.add_argument("--rejudge", type=Path, help="attribute the answers of a --dump file again (see Sections)")
    args = parser.parse_args()
    if args.rejudge:
        from benchmarks.quality import questions as gold_questions

        corpus = embedded_pydocs(prefix="faq/" if args.corpus == "faq" else "")
        gold = {q.text: q.relevant for q in gold_questions(corpus.doc_ids, corpus.texts)}
        bench_rejudge(args.rejudge, corpus.texts, gold)
        return
    sections = set(args.only or ["latency", "citations", "usefulness", "overhead"])
    work = Path(tempfile.mkdtemp(prefix="srbench-", dir="/tmp"))
    try:
        start_ray(work_dir=work / "ray")
        prefix = "faq/" if args.corpus == "faq" else ""
        lake, index, _ = pydocs_lake(work, prefix)
        import ray

        ray.shutdown()
        questions = faq_questions(args.questions)
        if sections & {"latency", "citations", "usefulness"}:
            from serving.local_generator import EmbeddedGenerator

            with EmbeddedGenerator() as gen:
                proc, url = serve(lake.uri, str(index), work, "--generator-url", gen.base_url, answers=True)
                try:
                    http = httpx.Client(timeout=300)
                    http.post(f"{url}/v1/answer", json={"question": "warm up"})
                    if sections & {"latency", "citations"}:
                        bench_latency_and_citations(url, gen.base_url, questions)
                    if "usefulness" in sections:
                        from benchmarks.quality import questions as gold_questions

                        corpus = embedded_pydocs(prefix=prefix)
                        gold = gold_questions(corpus.doc_ids, corpus.texts)
                        bench_usefulness(url, corpus.texts, gold, args.styles, dump=args.dump)
                finally:
                    os.killpg(proc.pid, 15)
                    proc.wait(60)
        if "overhead" in sections:
            bench_overhead(lake.uri, str(index), work, faq_questions(200), args.requests)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
