"""Text embedders: one base class owns batching and input checks, backends embed a batch.

Every vector is stored with the :class:`ModelIdentity` of the model that made it
(name + dimension + a hash of the weights), so vectors of different models never mix
silently: the lake writer, the index builder and the query path all compare identities.

Backends: ``serving.onnx_embedder`` (ONNX Runtime: fp32, the CPU default, and int8),
``serving.st_embedder`` (sentence-transformers: GPUs, bf16/fp16, and models the ONNX backend
cannot pool) and ``serving.fake_embedder`` (the test double);
:func:`load_embedder` builds the one a setting names. Model files: ``serving.models``;
device and precision: ``serving.devices``.

>>> from serving.fake_embedder import FakeEmbedder
>>> FakeEmbedder(dim=8).embed(["hello world"]).shape
(1, 8)
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

import serving.memory  # noqa: F401 - turns oneDNN's per-shape cache off before torch loads

log = logging.getLogger(__name__)


Vectors = npt.NDArray[np.float32]

DEFAULT_MODEL = "all-MiniLM-L6-v2"


class EmbedderError(Exception):
    """An embedder could not be built or was given input it cannot embed."""


@dataclass(frozen=True)
class ModelIdentity:
    """What made a vector: stored with every vector, compared before mixing any."""

    name: str
    dim: int
    weights_hash: str

    def __str__(self) -> str:
        return f"{self.name}@{self.weights_hash[:16]}/{self.dim}"

    @classmethod
    def parse(cls, text: str) -> ModelIdentity:
        """Inverse of ``str()``: ``"name@hash/dim"``."""
        match = re.fullmatch(r"(.+)@([0-9a-f]+)/(\d+)", text)
        if match is None:
            raise ValueError(f"not a model identity: {text!r} (expected 'name@hash/dim')")
        return cls(match.group(1), int(match.group(3)), match.group(2))


class Embedder(ABC):
    """Base class: input checks, token-budget batching, order restoration.

    A backend implements :meth:`embed_batch` and :meth:`count_tokens`.
    """

    #: Longest input in tokens (special tokens included); longer input is truncated.
    max_tokens: int = 256

    def __init__(self, token_budget: int = 8192) -> None:
        if token_budget < 1:
            raise EmbedderError("token_budget must be at least 1.")
        self.token_budget = token_budget

    @property
    @abstractmethod
    def identity(self) -> ModelIdentity: ...

    @abstractmethod
    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens each text takes in the model (special tokens included, no truncation)."""

    @abstractmethod
    def embed_batch(self, texts: Sequence[str]) -> Vectors:
        """Embed one batch; return a (len(texts), dim) float32 array of unit vectors."""

    def embed(self, texts: Sequence[str], token_counts: Sequence[int] | None = None) -> Vectors:
        """Embed texts in batches bounded by a token budget; rows in input order.

        Texts are sorted by length so each batch pads little; a batch holds as many
        texts as fit ``token_budget`` counted as ``longest * count`` (what padding costs).
        """
        if isinstance(texts, str):
            raise EmbedderError("embed() takes a sequence of strings, not one string.")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise EmbedderError(f"input {i} is {type(text).__name__}, not str.")
        dim = self.identity.dim
        if not texts:
            return np.zeros((0, dim), dtype=np.float32)
        if token_counts is None:
            token_counts = self.count_tokens(texts)
        lengths = [min(max(1, n), self.max_tokens) for n in token_counts]
        order = sorted(range(len(texts)), key=lambda i: lengths[i])
        out = np.empty((len(texts), dim), dtype=np.float32)
        for batch in _token_batches(order, lengths, self.token_budget):
            vectors = np.asarray(self.embed_batch([texts[i] for i in batch]), dtype=np.float32)
            if vectors.shape != (len(batch), dim):
                raise EmbedderError(f"backend returned shape {vectors.shape}, expected {(len(batch), dim)}.")
            out[batch] = vectors
        return out


def hf_token_counts(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Tokens per text, special tokens included, untruncated, by a Hugging Face tokenizer."""
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=True, truncation=False)["input_ids"]]


def _token_batches(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Split indices (sorted by ascending length) into batches of padded cost <= budget."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Lengths ascend, so the newest item is the longest: cost = its length * count.
        if current and lengths[i] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def load_embedder(model: str | None = None, device: str = "auto", **kwargs: Any) -> Embedder:
    """Build the embedder a setting names: ``"fake"`` or a sentence-transformers model.

    On the CPU, fp32 (the default) runs the model's ONNX export (``serving.onnx_embedder``:
    the same vectors and identity as sentence-transformers, faster), falling back to
    sentence-transformers for a model it cannot run; ``dtype="int8"`` selects the quantized
    export. GPUs, bf16 and fp16 run on sentence-transformers.
    """
    if model == "fake":
        from serving.fake_embedder import FakeEmbedder

        return FakeEmbedder(**{k: v for k, v in kwargs.items() if k in ("dim", "token_budget")})
    dtype = kwargs.get("dtype")
    onnx_kwargs = {k: v for k, v in kwargs.items() if k in ("token_budget", "cpu_threads") and v is not None}
    if dtype == "int8":
        if device not in ("auto", "cpu"):
            raise EmbedderError(f"--dtype int8 runs on the CPU; drop --device {device} or choose another dtype.")
        from serving.onnx_embedder import OnnxEmbedder

        return OnnxEmbedder(model, "int8", **onnx_kwargs)
    if dtype in (None, "auto", "fp32") and _on_cpu(device):
        from serving.models import resolve_model
        from serving.onnx_embedder import OnnxEmbedder

        resolve_model(model)  # a model that is not there: its own error, not a fallback
        try:
            return OnnxEmbedder(model, "fp32", **onnx_kwargs)
        except EmbedderError as exc:
            log.warning("%s; embedding with sentence-transformers instead (the same vectors, slower)", exc)
    from serving.st_embedder import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder(model, device=device, **kwargs)


def _on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device != "auto":
        return False
    from serving.devices import pick_device

    return pick_device(device)[0] == "cpu"
