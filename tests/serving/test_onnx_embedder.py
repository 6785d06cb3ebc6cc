"""The ONNX CPU embedders: fp32 (the CPU default, the same model as sentence-transformers) and
int8 (a distinct model close to fp32), each exported once, offline, and checked."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from serving import onnx_export
from serving.embedder import Embedder, EmbedderError, load_embedder
from serving.models import default_model_path
from serving.onnx_embedder import OnnxEmbedder
from serving.st_embedder import SentenceTransformerEmbedder
from tests.corpus import make_corpus

TEXTS = [
    "Kafka stores events.",
    "Kafka keeps a log of events.",
    "Bananas are yellow.",
    "x",
    "Why are default values shared between objects? " * 60,  # past the 256-token limit: truncated
]


@pytest.fixture(scope="session")
def int8_embedder() -> Embedder:
    return load_embedder(dtype="int8")


def test_int8_is_a_distinct_model_whose_vectors_stay_close_to_fp32(real_embedder, int8_embedder) -> None:
    fp32, int8 = real_embedder.identity, int8_embedder.identity
    assert int8.name == fp32.name + "+int8" and int8.dim == fp32.dim and int8.weights_hash != fp32.weights_hash
    texts = TEXTS + [body for _, body, _ in make_corpus(seed=3, docs=20).expected.values()]
    a, b = int8_embedder.embed(texts), real_embedder.embed(texts)
    assert np.allclose(np.linalg.norm(a, axis=1), 1, atol=1e-4)
    cosines = np.sum(a * b, axis=1)
    assert cosines.min() > 0.97 and cosines.mean() > 0.985, cosines
    # Same tokenizer: the same chunks and token counts as fp32; order and batching do not matter.
    assert int8_embedder.count_tokens(TEXTS) == real_embedder.count_tokens(TEXTS)
    assert int8_embedder.max_tokens == real_embedder.max_tokens
    single = np.vstack([int8_embedder.embed([t]) for t in texts[:5]])
    assert np.allclose(single, a[:5], atol=1e-5)  # a text's vector does not depend on its batch-mates
    # Still a semantic model: the paraphrase is nearer than the unrelated sentence.
    assert a[0] @ a[1] > a[0] @ a[2] + 0.2


def test_the_cpu_default_is_the_onnx_fp32_export_the_same_model_as_sentence_transformers(real_embedder) -> None:
    onnx = load_embedder(device="cpu")
    assert isinstance(onnx, OnnxEmbedder) and isinstance(load_embedder(device="cpu", dtype="fp32"), OnnxEmbedder)
    assert onnx.identity == real_embedder.identity  # one model: lakes and indexes of either serve the other
    texts = TEXTS + [body for _, body, _ in make_corpus(seed=3, docs=20).expected.values()]
    a, b = onnx.embed(texts), real_embedder.embed(texts)
    assert np.abs(a - b).max() < 1e-5, np.abs(a - b).max()  # measured: 2e-7
    assert onnx.count_tokens(TEXTS) == real_embedder.count_tokens(TEXTS) and onnx.max_tokens == real_embedder.max_tokens
    single = np.vstack([onnx.embed([t]) for t in texts[:5]])
    assert np.array_equal(single, a[:5])  # each text runs alone: its vector never depends on its batch-mates
    # bf16 and fp16 stay on sentence-transformers
    assert isinstance(load_embedder(device="cpu", dtype="bf16"), SentenceTransformerEmbedder)


def test_a_model_the_onnx_backend_cannot_run_falls_back_to_sentence_transformers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import serving.onnx_embedder

    def unsupported(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise EmbedderError("the ONNX fp32 backend supports Transformer → Pooling (→ Normalize) models")

    monkeypatch.setattr(serving.onnx_embedder, "OnnxEmbedder", unsupported)
    found = load_embedder(device="cpu")
    assert isinstance(found, SentenceTransformerEmbedder)
    assert "embedding with sentence-transformers instead" in caplog.text
    with pytest.raises(EmbedderError, match="nothing is downloaded"):  # a missing model is its own error
        load_embedder("no-such-model", device="cpu")


def test_int8_runs_on_the_cpu_only_and_only_for_models_it_can_pool(tmp_path: Path) -> None:
    with pytest.raises(EmbedderError, match="runs on the CPU"):
        load_embedder(device="cuda", dtype="int8")
    model = tmp_path / "with-dense"
    model.mkdir()
    kinds = ("Transformer", "Pooling", "Dense")
    (model / "modules.json").write_text(json.dumps([{"type": f"sentence_transformers.models.{k}"} for k in kinds]))
    with pytest.raises(EmbedderError, match="Transformer → Pooling → Dense"):
        load_embedder(str(model), dtype="int8")
    with pytest.raises(EmbedderError, match="no ONNX export for precision 'fp16'"):
        onnx_export.ensure_onnx(model, "fp16")


def _model_copy(tmp_path: Path) -> Path:
    """A model directory of our own (links to the package's files), so its cache is ours too."""
    source = default_model_path()
    copy = tmp_path / "model"
    shutil.copytree(source, copy, copy_function=lambda s, d: Path(d).symlink_to(s))
    return copy


def test_export_happens_once_under_concurrency_is_reproducible_and_rebuilt_when_tampered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model_copy(tmp_path)
    exports = []
    run = subprocess.run

    def counting_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        exports.append(args[0])
        return run(*args, **kwargs)

    monkeypatch.setattr(onnx_export.subprocess, "run", counting_run)
    results: list[tuple[Path, str]] = []
    threads = [
        threading.Thread(target=lambda: results.append(onnx_export.ensure_onnx(model, "int8"))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(exports) == 1 and len(results) == 2 and results[0] == results[1]
    path, sha = results[0]
    assert path.parent == tmp_path / "model.int8" and not list(model.rglob("*.onnx"))  # beside, not inside
    assert sha == onnx_export.ensure_onnx(default_model_path(), "int8")[1]  # deterministic: every replica agrees

    # A file that is not what was written is exported again, to the same bytes.
    with path.open("ab") as fh:
        fh.write(b"rot")
    assert onnx_export.ensure_onnx(model, "int8") == (path, sha) and len(exports) == 2

    # Another recipe (or other source weights) invalidates the cache; a failed export says why.
    meta = path.parent / onnx_export.META_FILE
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "recipe": "older"}))
    monkeypatch.setattr(
        onnx_export.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "Boom: out of disk")
    )
    with pytest.raises(EmbedderError, match=r"(?s)ONNX int8 failed.*out of disk"):
        onnx_export.ensure_onnx(model, "int8")
    assert not meta.exists()  # nothing half-written is taken for a valid cache later


def test_the_fp32_export_is_cached_beside_the_model_apart_from_int8_and_reproducible(tmp_path: Path) -> None:
    model = _model_copy(tmp_path)
    path, sha = onnx_export.ensure_onnx(model, "fp32")
    assert path.parent == tmp_path / "model.fp32" and not list(model.rglob("*.onnx"))
    assert sha == onnx_export.ensure_onnx(default_model_path(), "fp32")[1]  # every replica agrees
    assert sha != onnx_export.ensure_onnx(default_model_path(), "int8")[1]
    meta = json.loads((path.parent / onnx_export.META_FILE).read_text())
    assert meta["recipe"] == onnx_export.RECIPES["fp32"]
