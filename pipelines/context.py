"""Contextual chunk vectors: a chunk's embedding mixed with its neighbours' in its document.

A chunk is embedded on its own, but an answer often spans several chunks, and the second
and third rarely repeat the question's words. With ``context_weight`` w > 0 the vector a
chunk is searched by is ``normalise(own + w * mean(neighbours))``, its neighbours being the
chunks just before and after it in the same document version. Queries are embedded as
before: the mix only moves each chunk towards its surroundings.

On the Python FAQ set (``benchmarks/quality.py``, the real index and engine) w = 1 raised
dense nDCG@10 from 0.499 to 0.629 and recall@10 from 0.509 to 0.700, and left API-name
queries, whose answer is one defining chunk, where they were (0.268 → 0.265). Larger
weights blur chunks into each other (w = 1.5: 0.615); w = 0.5: 0.580. With w = 1 the two
chunks of a two-chunk document share one vector.

The ingest job writes the mixed vector in ``embedding`` and marks the rows' ``model`` with
the weight (``model_with_context``), so a lake never mixes weights and the index knows
which queries it answers (``query_model``). Without ``--context-weight`` the job keeps the
lake's weight, and a new lake gets ``DEFAULT_WEIGHT``. A chunk whose neighbour changed gets
a new row (``pipelines.docstate``): its vector changed though its text did not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

_MARK = "+context="

#: the weight of a new lake's vectors when ``--context-weight`` is not given (measured above)
DEFAULT_WEIGHT = 1.0


def model_with_context(model: str, weight: float) -> str:
    """The ``model`` a lake row records: the embedder's identity, and the context weight if any."""
    return f"{model}{_MARK}{weight:g}" if weight else model


def query_model(model: str) -> str:
    """The embedder that queries an index of ``model``'s vectors (the context weight removed)."""
    return model.split(_MARK, 1)[0]


def context_weight(model: str) -> float:
    """The context weight a lake row's ``model`` records (0: none)."""
    _, _, weight = model.partition(_MARK)
    return float(weight) if weight else 0.0


def lake_weight(models: Iterable[str]) -> float | None:
    """The one context weight a lake's models record; None for an empty lake, or one whose
    rows disagree or cannot be read (the job's model check refuses those with a sentence)."""
    try:
        weights = {context_weight(m) for m in models}
    except ValueError:
        return None
    return weights.pop() if len(weights) == 1 else None


def contextual(own: np.ndarray, neighbours: Sequence[np.ndarray], weight: float) -> np.ndarray:
    """One chunk's vector mixed with its neighbours' (unit length; ``own`` when it has none)."""
    if not weight or not neighbours:
        return own
    mixed = own + weight * np.mean(np.stack(neighbours), axis=0)
    norm = float(np.linalg.norm(mixed))
    return (mixed / norm).astype(own.dtype) if norm > 0 else own


def contextual_documents(vectors: np.ndarray, doc_ids: Sequence[str], weight: float) -> np.ndarray:
    """Every chunk's contextual vector for chunks listed document by document, each document's
    in chunk order (what the ingest job writes for a corpus ingested whole)."""
    if not weight or len(vectors) == 0:
        return vectors
    docs = np.asarray(doc_ids)
    before = np.r_[False, docs[1:] == docs[:-1]]  # row i-1 is in row i's document
    after = np.r_[docs[:-1] == docs[1:], False]
    total = np.zeros(vectors.shape, np.float64)
    count = np.zeros(len(vectors))
    total[before] += vectors[np.flatnonzero(before) - 1]
    count[before] += 1
    total[after] += vectors[np.flatnonzero(after) + 1]
    count[after] += 1
    mixed = vectors + weight * (total / np.maximum(count, 1)[:, None])
    mixed /= np.linalg.norm(mixed, axis=1, keepdims=True)
    return mixed.astype(vectors.dtype)
