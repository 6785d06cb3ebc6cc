"""Real embeddings for the benchmarks: the Python docs chunked and embedded as ingest would.

The chunks and their vectors are cached under ``benchmarks/.cache`` (keyed by model
identity, chunker settings and corpus size), so only the first run pays for embedding
(about 10 minutes on 2 CPU cores for the whole corpus).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from tqdm import tqdm

from pipelines.chunking import Chunker
from retrieval.corpus import PYDOCS, load_pydocs
from serving.embedder import Embedder
from serving.st_embedder import SentenceTransformerEmbedder

CACHE = Path(__file__).resolve().parent / ".cache"
log = logging.getLogger(__name__)


@dataclass
class EmbeddedCorpus:
    doc_ids: list[str]
    texts: list[str]
    vectors: np.ndarray
    model: str
    embedder: Embedder


def embedded_pydocs(
    limit: int | None = None,
    max_tokens: int = 200,
    overlap: int = 32,
    embedder: Embedder | None = None,
    prefix: str = "",
) -> EmbeddedCorpus:
    """The docs (those whose id starts with ``prefix``) chunked and embedded (by ``embedder``,
    default fp32), cached per model identity."""
    embedder = embedder or SentenceTransformerEmbedder()
    docs = [d for d in load_pydocs(PYDOCS, limit) if d.id.startswith(prefix)]
    key = hashlib.sha256(
        json.dumps([str(embedder.identity), max_tokens, overlap, [(d.id, len(d.body)) for d in docs]]).encode()
    ).hexdigest()[:16]
    path = CACHE / f"pydocs-{key}.npz"
    if path.exists():
        cached = np.load(path, allow_pickle=False)
        return EmbeddedCorpus(
            [str(s) for s in cached["doc_ids"]], [str(s) for s in cached["texts"]], cached["vectors"],
            str(embedder.identity), embedder,
        )  # fmt: skip
    chunker = Chunker(embedder.count_tokens, max_tokens, overlap)
    doc_ids: list[str] = []
    texts: list[str] = []
    for doc in tqdm(docs, desc="chunk", file=sys.stderr):
        for chunk in chunker.chunk(f"{doc.title}\n\n{doc.body}"):
            doc_ids.append(doc.id)
            texts.append(chunk.text)
    t0 = time.perf_counter()
    vectors = np.empty((len(texts), embedder.identity.dim), np.float32)
    step = 512
    for lo in tqdm(range(0, len(texts), step), desc="embed", unit_scale=step, file=sys.stderr):
        vectors[lo : lo + step] = embedder.embed(texts[lo : lo + step])
    log.info("embedded %d chunks in %.0f s", len(texts), time.perf_counter() - t0)
    CACHE.mkdir(exist_ok=True)
    np.savez(path, doc_ids=np.array(doc_ids), texts=np.array(texts), vectors=vectors)
    return EmbeddedCorpus(doc_ids, texts, vectors, str(embedder.identity), embedder)
