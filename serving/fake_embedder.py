"""A deterministic stand-in for a model: the test seam of everything that embeds.

Tests use it so that assertions are exact and nothing loads a model; ``--model fake``
selects it for runs of the real commands that need no semantics (tests of the job's
mechanics, benchmarks of everything around the model).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from serving.embedder import Embedder, ModelIdentity, Vectors

_WORD = re.compile(r"\w+", re.UNICODE)


class FakeEmbedder(Embedder):
    """Deterministic bag-of-words hashing embedder for tests: exact, fast, no model.

    Texts sharing words have positive cosine similarity; identical texts identical vectors.
    """

    def __init__(self, dim: int = 32, token_budget: int = 8192, max_tokens: int = 256) -> None:
        super().__init__(token_budget)
        self.max_tokens = max_tokens
        self._identity = ModelIdentity("fake-hashing", dim, hashlib.sha256(b"fake").hexdigest())
        self.batches: list[int] = []  # sizes of the batches embedded, for tests

    @property
    def identity(self) -> ModelIdentity:
        return self._identity

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(_WORD.findall(t)) + 2 for t in texts]

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        self.batches.append(len(texts))
        dim = self._identity.dim
        out = np.zeros((len(texts), dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in _WORD.findall(text.lower()):
                h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
                out[row, h % dim] += 1.0 if (h >> 32) & 1 else -1.0
            norm = float(np.linalg.norm(out[row]))
            if norm == 0.0:
                out[row, 0] = 1.0
            else:
                out[row] /= norm
        return out
