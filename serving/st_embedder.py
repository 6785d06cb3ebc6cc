"""The sentence-transformers backend: a local model directory, loaded offline."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from serving.devices import pick_device, torch_dtype
from serving.embedder import Embedder, EmbedderError, ModelIdentity, Vectors, hf_token_counts
from serving.memory import release_freed_memory
from serving.models import resolve_model, weights_hash

log = logging.getLogger(__name__)

#: with ``cpu_threads`` unset, a CPU batch of fewer characters than this runs on one thread:
#: a lone change or a query gains little from more (one text: 36 ms on 1 thread, 28 ms on 2,
#: alone on 2 cores) and loses much when another process wants the cores (the freshness
#: benchmark, ingest and serve on 2 cores: an update's embedding 168 ms on all cores against
#: 58 ms on one); a backlog batch uses every core (64 texts: 1.6 s on 1 thread, 0.86 s on 2).
SMALL_BATCH_CHARS = 4096

#: padded tokens per batch on CPU unless set: on 2 AVX2 cores fp32 ran one-paragraph texts
#: 20-30% faster (long ones ~10%) in batches of 2048 tokens than of 8192; 512 halved the speed
CPU_TOKEN_BUDGET = 2048
GPU_TOKEN_BUDGET = 8192


class SentenceTransformerEmbedder(Embedder):
    """sentence-transformers backend, loaded offline from a local directory."""

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        token_budget: int | None = None,
        dtype: Any = None,
        cpu_threads: int | None = None,
    ) -> None:
        # Offline by construction: a model id that is not a directory was rejected above,
        # and these keep transformers from probing a hub for the ones we load.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        if cpu_threads is not None:  # torch's intra-op pool is per process: the last setting wins
            torch.set_num_threads(cpu_threads)
        self._all_threads = torch.get_num_threads()
        self._auto_threads = cpu_threads is None
        self._threads = self._all_threads

        name, path = resolve_model(model)
        self.device, default_dtype = pick_device(device)
        super().__init__(token_budget or (CPU_TOKEN_BUDGET if self.device == "cpu" else GPU_TOKEN_BUDGET))
        self.dtype = torch_dtype(dtype) or default_dtype
        self._model = SentenceTransformer(str(path), device=self.device, model_kwargs={"dtype": self.dtype})
        self.max_tokens = int(self._model.max_seq_length or 256)
        dim = self._model.get_embedding_dimension()
        if dim is None:
            raise EmbedderError(f"model at {path} does not report an embedding dimension.")
        self._identity = ModelIdentity(name, int(dim), weights_hash(path))
        self._tokenizer = self._model.tokenizer
        log.info("embedder %s on %s (%s)", self._identity, self.device, self.dtype)

    @property
    def identity(self) -> ModelIdentity:
        return self._identity

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return hf_token_counts(self._tokenizer, texts)

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        if self._auto_threads and self.device == "cpu":
            self._use_threads(1 if sum(len(t) for t in texts) < SMALL_BATCH_CHARS else self._all_threads)
        vectors = self._model.encode(
            list(texts),
            batch_size=len(texts),
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        release_freed_memory()
        return np.asarray(vectors, dtype=np.float32)

    def _use_threads(self, threads: int) -> None:
        if threads != self._threads:
            import torch

            torch.set_num_threads(threads)
            self._threads = threads
