"""The CPU backends: ONNX Runtime on an export of the model, each text run alone on a thread.

``fp32`` (the CPU default): the model's own graph, so the same model as sentence-transformers
(its vectors agree to 2e-7, well inside the 1e-5 the tests allow between sentence-transformers'
own batchings) and the same :class:`ModelIdentity`. Without torch's padded
batches and intra-op threads it is faster on CPUs: 1.7-1.8x for a lone text, 3-4x for the
small batches of a stream, 1.2-1.6x for one large batch (2 AVX-512 cores, docs/PITFALLS.md).

``int8`` (``--dtype int8``): a quantized export, about 2x the chunks/s of sentence-transformers
fp32 at cosine ~0.99 to its vectors (figures: ``serving.onnx_export`` and
``benchmarks/ingest.py --only precision``). It is a different model as far as vectors go: its
:class:`ModelIdentity` is the model's name with ``+int8`` and the sha256 of the quantized
file, so an index built from int8 vectors is served by an int8 query embedder and never
silently mixed with fp32 vectors.

The tokenizer, the truncation length and the pooling are the sentence-transformers
model's own (``modules.json``: Transformer, Pooling, optionally Normalize), so chunking
and token counts are the same as with the fp32 backend.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt

from serving.embedder import Embedder, EmbedderError, ModelIdentity, Vectors, hf_token_counts
from serving.models import resolve_model, weights_hash
from serving.onnx_export import ensure_onnx

log = logging.getLogger(__name__)

INT8_SUFFIX = "+int8"
POOLINGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}


class OnnxEmbedder(Embedder):
    """A sentence-transformers model run as an ONNX graph (``precision``: "fp32" or "int8") on the CPU."""

    def __init__(
        self,
        model: str | None = None,
        precision: str = "int8",
        token_budget: int = 8192,
        cpu_threads: int | None = None,
    ) -> None:
        super().__init__(token_budget)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import onnxruntime as ort
        from transformers import AutoTokenizer

        name, path = resolve_model(model)
        self._pooling, dim, self.max_tokens = _pipeline(path, precision)
        try:
            source = weights_hash(path)  # hashed once: the export cache's key and fp32's identity
        except OSError as exc:
            raise EmbedderError(f"cannot read the weights of {path}: {exc}") from exc
        onnx_file, sha = ensure_onnx(path, precision, source)
        self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # one text per thread: see embed_batch
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
        self._inputs = [i.name for i in self._session.get_inputs()]
        self._threads = cpu_threads or os.cpu_count() or 1
        self._pool = (
            ThreadPoolExecutor(self._threads, thread_name_prefix=f"{precision}-embed") if self._threads > 1 else None
        )
        # fp32 is the model itself (sentence-transformers' vectors to 2e-7); int8 is another model
        self._identity = (
            ModelIdentity(name, dim, source) if precision == "fp32" else ModelIdentity(name + INT8_SUFFIX, dim, sha)
        )
        log.info(
            "embedder %s on cpu (ONNX Runtime %s, %d threads, %s)", self._identity, precision, self._threads, onnx_file
        )

    @property
    def identity(self) -> ModelIdentity:
        return self._identity

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return hf_token_counts(self._tokenizer, texts)

    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        """Each text runs alone, texts in parallel on a thread each.

        Dynamic quantization scales activations per run: a text batched with others gets a
        vector that depends on its batch-mates and their padding (cosine to itself alone
        down to 0.975, measured). Alone, a text always gets the same vector, and with no
        padding the runs are also faster than batches (int8, one text per thread on 2 cores:
        121 short / 24 long texts/s against 91 / 17 for padded batches, measured together;
        fp32 likewise, docs/PITFALLS.md).
        """
        # Tokenized here, not in the pool: a fast tokenizer called from several threads at once
        # fails ("Already borrowed"), as transformers sets its truncation on every call.
        encoded = self._tokenizer(list(texts), truncation=True, max_length=self.max_tokens)
        feeds = [
            {name: np.asarray([encoded[name][i]], dtype=np.int64) for name in self._inputs} for i in range(len(texts))
        ]
        if self._pool is None or len(texts) == 1:
            return np.vstack([self._one(feed) for feed in feeds])
        return np.vstack(list(self._pool.map(self._one, feeds)))

    def _one(self, feed: dict[str, npt.NDArray[np.int64]]) -> Vectors:
        hidden = self._session.run(None, feed)[0][0]  # (tokens, dim): no padding, every token counts
        if self._pooling == "mean":
            vector = hidden.mean(axis=0)
        elif self._pooling == "cls":
            vector = hidden[0]
        else:
            vector = hidden.max(axis=0)
        return np.asarray(vector / max(float(np.linalg.norm(vector)), 1e-12), dtype=np.float32)[None, :]


def _pipeline(path: Path, precision: str = "int8") -> tuple[str, int, int]:
    """(pooling, dimension, max tokens) of a sentence-transformers directory; unsupported → error."""
    what = "--dtype int8" if precision == "int8" else f"the ONNX {precision} backend"
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError) as exc:
        raise EmbedderError(f"{path} has no readable modules.json: {what} needs a sentence-transformers model") from exc
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise EmbedderError(
            f"{what} supports Transformer → Pooling (→ Normalize) models; {path} has {' → '.join(kinds)}."
        )
    pooling_dir = path / modules[1].get("path", "1_Pooling")
    try:
        config = json.loads((pooling_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EmbedderError(f"{pooling_dir} has no readable config.json: {what} needs its pooling settings") from exc
    modes = [mode for key, mode in POOLINGS.items() if config.get(key)]
    if len(modes) != 1 or any(config.get(k) for k in config if k.startswith("pooling_mode") and k not in POOLINGS):
        raise EmbedderError(f"{what} supports mean, CLS or max pooling alone; {pooling_dir} asks for {config}.")
    max_tokens = 256
    bert_config = path / "sentence_bert_config.json"
    if bert_config.exists():
        max_tokens = int(json.loads(bert_config.read_text()).get("max_seq_length") or max_tokens)
    return modes[0], int(config["word_embedding_dimension"]), max_tokens
