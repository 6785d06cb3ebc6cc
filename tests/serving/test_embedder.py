from __future__ import annotations

import numpy as np
import pytest

from serving.embedder import EmbedderError, ModelIdentity, _token_batches
from serving.fake_embedder import FakeEmbedder
from serving.models import resolve_model


def test_identity_round_trips_through_its_string() -> None:
    ident = ModelIdentity("all-MiniLM-L6-v2", 384, "ab" * 32)
    assert ModelIdentity.parse(str(ident)) == ModelIdentity("all-MiniLM-L6-v2", 384, "ab" * 8)
    with pytest.raises(ValueError, match="not a model identity"):
        ModelIdentity.parse("nonsense")


def test_batches_respect_the_token_budget_counting_padding() -> None:
    lengths = [3, 3, 10, 10, 10, 50]
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches = _token_batches(order, lengths, budget=30)
    for batch in batches:
        assert max(lengths[i] for i in batch) * len(batch) <= 30 or len(batch) == 1
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))


def test_embed_keeps_input_order_and_is_deterministic() -> None:
    emb = FakeEmbedder(dim=16, token_budget=12)
    texts = ["a b c d e f g h", "x", "kafka delta", "x"]
    out = emb.embed(texts)
    assert out.shape == (4, 16)
    np.testing.assert_allclose(out[1], out[3])
    np.testing.assert_allclose(out[0], emb.embed([texts[0]])[0])
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    assert len(emb.batches) > 1  # the small budget forced several batches


def test_embed_rejects_bad_input_with_a_clear_error() -> None:
    emb = FakeEmbedder()
    with pytest.raises(EmbedderError, match="not one string"):
        emb.embed("hello")  # type: ignore[arg-type]
    with pytest.raises(EmbedderError, match="input 1 is int"):
        emb.embed(["ok", 3])  # type: ignore[list-item]
    assert emb.embed([]).shape == (0, 32)


def test_unknown_model_names_are_refused_not_downloaded() -> None:
    with pytest.raises(EmbedderError, match="nothing is downloaded"):
        resolve_model("sentence-transformers/some-other-model")


def test_real_model_identity_and_vectors(real_embedder) -> None:
    ident = real_embedder.identity
    assert ident.name == "all-MiniLM-L6-v2" and ident.dim == 384 and len(ident.weights_hash) == 64
    vecs = real_embedder.embed(["Kafka stores events.", "Kafka keeps a log of events.", "Bananas are yellow."])
    assert vecs.dtype == np.float32
    sims = vecs @ vecs.T
    assert sims[0, 1] > sims[0, 2]
    # Batching does not change results (same vectors one at a time).
    single = np.vstack([real_embedder.embed([t]) for t in ["Kafka stores events.", "Bananas are yellow."]])
    np.testing.assert_allclose(single, vecs[[0, 2]], atol=1e-5)
    assert real_embedder.count_tokens(["hello world"]) == [4]


def test_token_budget_defaults_to_the_cpu_size_unless_set(real_embedder, tmp_path) -> None:
    from pipelines.flow import Runtime
    from pipelines.settings import IngestSettings
    from serving.st_embedder import CPU_TOKEN_BUDGET

    assert real_embedder.device == "cpu" and real_embedder.token_budget == CPU_TOKEN_BUDGET
    settings = IngestSettings(topics=["x"], lake=str(tmp_path / "lake"), model="fake", embed_token_budget=4096)
    assert Runtime(settings).embedder.token_budget == 4096
