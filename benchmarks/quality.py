"""Retrieval quality on the Python docs: FAQ questions whose answers are known.

    .venv/bin/python benchmarks/quality.py            # one JSON line per system, then a table

The Python FAQ pages (``faq/*.rst``) hold question → answer pairs: each question heading
ending in "?" is a query, and the chunks of its answer (the text under that heading, as
the pipeline's chunker cut the page) are the relevant items. Every chunk of the whole
documentation (about 40k, embedded as the ingest job would: benchmarks/pydocs.py) is a
candidate. Reported per system: nDCG@10, recall@10 and MRR (first relevant chunk), for

- ``exact``: flat inner-product search over every chunk vector (faiss IndexFlatIP);
- ``ivf``: the real index (built by the real builder) searched by the real engine at the
  default nprobe, the way ``/v1/search`` does (and ``ivf@256``, ``ivf@512``: more lists);
- ``exact-int8`` (with ``--int8``): as ``exact``, every chunk and question embedded by the
  int8 CPU embedder (``--dtype int8``);
- ``bm25``: Okapi BM25 (k1 1.2, b 0.75) over the same chunks, the lexical baseline.

Targets: IVF within 1% of exact (nDCG@10); dense retrieval above BM25; int8 within 1% of
fp32 for the demo to use it.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faiss
import numpy as np
from scipy import sparse

from benchmarks.index import emit
from benchmarks.pydocs import embedded_pydocs
from benchmarks.retrieval import pydocs_lake
from indexing.distributed import start_ray
from indexing.store import LocalStore
from retrieval.acl import ANONYMOUS
from retrieval.cache import ShardCache
from retrieval.corpus import load_pydocs
from retrieval.engine import SearchEngine
from retrieval.views import EngineOptions
from serving.embedder import load_embedder

K = 10
_HEADING = re.compile(r"^([=\-*^~#+\"'`.:_])\1{2,}\s*$")
_WORD = re.compile(r"[a-z0-9_]+")


@dataclass
class Question:
    text: str
    doc_id: str
    answer: str  # the section under the question heading
    relevant: set[int]  # corpus indices of the chunks of that answer


def _squash(text: str) -> str:
    return " ".join(text.split())


def faq_pairs() -> list[tuple[str, str, str]]:
    """(doc id, question, answer text) for every question heading of the FAQ pages."""
    pairs = []
    for doc in load_pydocs():
        if not doc.id.startswith("faq/"):
            continue
        lines = doc.body.splitlines()
        heads = [i - 1 for i in range(1, len(lines)) if _HEADING.match(lines[i]) and lines[i - 1].strip()
                 and not _HEADING.match(lines[i - 1])]  # fmt: skip
        for j, h in enumerate(heads):
            title = lines[h].strip()
            if not title.endswith("?"):
                continue
            end = heads[j + 1] if j + 1 < len(heads) else len(lines)
            answer = "\n".join(lines[h + 2 : end]).strip()
            if answer:
                pairs.append((doc.id, title, answer))
    return pairs


def questions(doc_ids: list[str], texts: list[str]) -> list[Question]:
    """Each FAQ question with the chunks whose text lies in its answer."""
    by_doc: dict[str, list[int]] = {}
    for i, d in enumerate(doc_ids):
        by_doc.setdefault(d, []).append(i)
    out = []
    for doc_id, question, answer in faq_pairs():
        body = _squash(answer)
        relevant = set()
        for i in by_doc.get(doc_id, []):
            chunk = _squash(texts[i])
            # A chunk is relevant when a good part of it comes from the answer (chunks
            # overlap their neighbours by a few tokens; headings are cut with them).
            probes = [chunk[p : p + 60] for p in range(0, max(1, len(chunk) - 60), 120)]
            if (probes and sum(p in body for p in probes) / len(probes) >= 0.5) or body[:200] in chunk:
                relevant.add(i)  # mostly answer text, or holding the start of a short answer
        if relevant:
            out.append(Question(question, doc_id, answer, relevant))
    return out


def ndcg(ranked: list[int], relevant: set[int], k: int = K) -> float:
    dcg = sum(1 / math.log2(r + 2) for r, i in enumerate(ranked[:k]) if i in relevant)
    ideal = sum(1 / math.log2(r + 2) for r in range(min(k, len(relevant))))
    return dcg / ideal


def recall(ranked: list[int], relevant: set[int], k: int = K) -> float:
    return len(set(ranked[:k]) & relevant) / len(relevant)


def mrr(ranked: list[int], relevant: set[int]) -> float:
    return next((1 / (r + 1) for r, i in enumerate(ranked) if i in relevant), 0.0)


class BM25:
    def __init__(self, texts: list[str], k1: float = 1.2, b: float = 0.75) -> None:
        vocab: dict[str, int] = {}
        rows, cols, vals = [], [], []
        lengths = np.zeros(len(texts), np.float32)
        for d, text in enumerate(texts):
            counts: dict[int, int] = {}
            words = _WORD.findall(text.lower())
            lengths[d] = len(words)
            for w in words:
                t = vocab.setdefault(w, len(vocab))
                counts[t] = counts.get(t, 0) + 1
            rows += [d] * len(counts)
            cols += list(counts)
            vals += list(counts.values())
        tf = sparse.csr_matrix((np.array(vals, np.float32), (rows, cols)), shape=(len(texts), len(vocab)))
        df = np.bincount(cols, minlength=len(vocab)).astype(np.float32)
        self.idf = np.log(1 + (len(texts) - df + 0.5) / (df + 0.5))
        norm = k1 * (1 - b + b * lengths / lengths.mean())
        tf = tf.tocoo()
        weighted = tf.data * (k1 + 1) / (tf.data + norm[tf.row])
        self.weights = sparse.csc_matrix((weighted, (tf.row, tf.col)), shape=tf.shape)
        self.vocab = vocab

    def search(self, query: str, k: int) -> list[int]:
        terms = [self.vocab[w] for w in set(_WORD.findall(query.lower())) if w in self.vocab]
        if not terms:
            return []
        scores = np.asarray(self.weights[:, terms] @ self.idf[terms]).ravel()
        top = np.argpartition(-scores, k)[:k]
        return [int(i) for i in top[np.argsort(-scores[top])]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--int8", action="store_true",
        help="also rank with the int8 embedder (corpus and questions embedded by it; the first run embeds 40k chunks)",
    )  # fmt: skip
    args = parser.parse_args()
    corpus = embedded_pydocs()
    qs = questions(corpus.doc_ids, corpus.texts)
    texts = [q.text for q in qs]
    emit(bench="quality_setup", faq_pairs=len(faq_pairs()), questions=len(qs), chunks=len(corpus.texts),
         relevant_per_question=round(float(np.mean([len(q.relevant) for q in qs])), 2))  # fmt: skip
    query_vectors = corpus.embedder.embed(texts)
    ranked: dict[str, list[list[int]]] = {}
    probes: dict[str, int] = {}
    nlist = 0

    flat = faiss.IndexFlatIP(corpus.vectors.shape[1])
    flat.add(corpus.vectors)
    _, found = flat.search(query_vectors, K * 10)
    ranked["exact"] = [[int(i) for i in row] for row in found]
    if args.int8:
        int8 = embedded_pydocs(embedder=load_embedder(dtype="int8"))
        assert int8.texts == corpus.texts, "the int8 tokenizer chunked differently"
        flat8 = faiss.IndexFlatIP(int8.vectors.shape[1])
        flat8.add(int8.vectors)
        _, found = flat8.search(int8.embedder.embed(texts), K * 10)
        ranked["exact-int8"] = [[int(i) for i in row] for row in found]

    work = Path(tempfile.mkdtemp(prefix="srquality-", dir="/tmp"))
    try:
        start_ray(work_dir=work / "ray")
        lake, index, _ = pydocs_lake(work)
        cache = ShardCache(work / "cache")
        for nprobe in (None, 256, 512):  # None: the service's default
            engine = SearchEngine(lake, LocalStore(str(index)), corpus.embedder, cache, EngineOptions(nprobe=nprobe))
            engine.start(background=False)
            view = engine.current_view()
            lists = []
            for v in query_vectors:
                result = engine.search_vector(view, v, K * 10, ANONYMOUS)
                lists.append([int(r["chunk_id"][1:]) for r in result.results])
            nlist = view.reader.manifest.nlist
            ranked["ivf" if nprobe is None else f"ivf@{nprobe}"] = lists
            probes["ivf" if nprobe is None else f"ivf@{nprobe}"] = result.nprobe
            engine.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    bm25 = BM25(corpus.texts)
    ranked["bm25"] = [bm25.search(q, K * 10) for q in texts]

    table = {}
    for system, lists in ranked.items():
        scores = {
            "ndcg@10": float(np.mean([ndcg(r, q.relevant) for r, q in zip(lists, qs, strict=True)])),
            "recall@10": float(np.mean([recall(r, q.relevant) for r, q in zip(lists, qs, strict=True)])),
            "mrr": float(np.mean([mrr(r, q.relevant) for r, q in zip(lists, qs, strict=True)])),
        }
        table[system] = scores
        extra = {"nprobe": probes[system], "nlist": nlist} if system in probes else {}
        emit(bench="quality", system=system, questions=len(qs), **{k: round(v, 4) for k, v in scores.items()}, **extra)
    ivf_gap = 1 - table["ivf"]["ndcg@10"] / table["exact"]["ndcg@10"]
    emit(bench="quality_targets", ivf_ndcg_gap_vs_exact=round(ivf_gap, 4), ivf_within_1pct=ivf_gap <= 0.01,
         dense_above_bm25=table["exact"]["ndcg@10"] > table["bm25"]["ndcg@10"])  # fmt: skip
    print("\n| system | nDCG@10 | recall@10 | MRR |\n|---|---|---|---|", file=sys.stderr)
    for system, scores in table.items():
        print(f"| {system} | {scores['ndcg@10']:.3f} | {scores['recall@10']:.3f} | {scores['mrr']:.3f} |",
              file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
