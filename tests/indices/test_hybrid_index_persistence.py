"""HybridIndex persistence: build/close/load round trip in every mode, and the clear errors of
loading with another model, loading a folder without an index, and building over an index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding

from llama_index_retrieval_kit.indices import RETRIEVER_MODES, HybridIndex
from llama_index_retrieval_kit.indices.hybrid_index import embed_model_name
from llama_index_retrieval_kit.models import DEFAULT_EMBED_MODEL
from llama_index_retrieval_kit.retrievers import BM25Retriever

from . import _support


def tiny_documents() -> list[Document]:
    return [
        Document(text="Annual fee\n\nThe annual fee is 95 dollars, waived in the first year.", id_="fees.txt"),
        Document(text="Water filter\n\nReplace the cartridge every six months or 400 litres.", id_="filter.txt"),
    ]


def test_build_close_load_gives_the_same_results_in_every_mode(template, index, bundles) -> None:
    # template.built_results were taken from the freshly built index, before it was closed.
    assert set(mode for mode, _ in template.built_results) == set(RETRIEVER_MODES)
    reloaded = _support.run_modes(index, bundles[: _support.ROUND_TRIP_QUERIES])
    _support.assert_same_results(reloaded, template.built_results)
    assert any(template.built_results[key] for key in template.built_results)  # not vacuous
    assert index.doc_ids() == template.doc_ids == sorted(d.id_ for d in _support.sample_documents())
    assert index.config["pending"] is None
    _support.assert_consistent(index)


def test_close_and_reopen_twice_is_stable(index_dir: Path, embed_model, bundles) -> None:
    queries = bundles[-3:]
    with HybridIndex.load(index_dir, embed_model=embed_model) as first:
        want = _support.run_modes(first, queries)
        generation = first.config["generation"]
    with HybridIndex.load(index_dir, embed_model=embed_model) as second:  # the lock was released
        _support.assert_same_results(_support.run_modes(second, queries), want)
        assert second.config["generation"] == generation  # reading never writes a generation


def test_folder_layout_holds_one_committed_generation(index, index_dir: Path) -> None:
    config = json.loads((index_dir / "index.json").read_text())
    gen = config["generation"]
    assert [p.name for p in (index_dir / "bm25").iterdir()] == [f"gen-{gen}"]
    assert [p.name for p in (index_dir / "docstore").iterdir()] == [f"gen-{gen}.json"]
    assert config["embed_model"] == DEFAULT_EMBED_MODEL and config["embed_dim"] == 384
    assert (index_dir / "edge" / "shard").is_dir() and (index_dir / "embeddings.sqlite").is_file()
    assert not (index_dir / "qdrant").exists() and config["format_version"] == 2


def test_embed_model_name_of_the_packaged_model_is_its_hub_id(embed_model) -> None:
    assert embed_model_name(embed_model) == DEFAULT_EMBED_MODEL
    assert embed_model_name(MockEmbedding(embed_dim=384)) == "unknown"


def test_loading_with_another_embedding_model_names_both(index_dir: Path) -> None:
    with pytest.raises(ValueError) as err:
        HybridIndex.load(index_dir, embed_model=MockEmbedding(embed_dim=384))
    msg = str(err.value)
    assert f"'{DEFAULT_EMBED_MODEL}' (FastHuggingFaceEmbedding)" in msg
    assert "'unknown' (MockEmbedding)" in msg
    assert "not comparable" in msg


def test_index_built_with_another_model_needs_that_model(tmp_path: Path, embed_model) -> None:
    path = tmp_path / "mock"
    HybridIndex.from_documents(tiny_documents(), path, embed_model=MockEmbedding(embed_dim=8)).close()
    with pytest.raises(ValueError, match=r"built with embedding model 'unknown' \(MockEmbedding\); pass embed_model="):
        HybridIndex.load(path)  # the default model is not the one it was built with
    with pytest.raises(ValueError) as err:
        HybridIndex.load(path, embed_model=embed_model)
    assert "'unknown' (MockEmbedding)" in str(err.value) and f"'{DEFAULT_EMBED_MODEL}' (FastHuggingFaceEmbedding)" in str(err.value)
    with HybridIndex.load(path, embed_model=MockEmbedding(embed_dim=8)) as idx:  # the right model opens it
        assert idx.doc_ids() == ["fees.txt", "filter.txt"]


def test_loading_a_folder_without_an_index_is_a_clear_error(tmp_path: Path) -> None:
    for folder in (tmp_path / "does-not-exist", tmp_path):
        with pytest.raises(ValueError, match="holds no index.json: build an index there with HybridIndex.from_documents"):
            HybridIndex.load(folder, embed_model=MockEmbedding(embed_dim=8))


def test_from_documents_over_an_existing_index_needs_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    model = MockEmbedding(embed_dim=8)
    HybridIndex.from_documents(tiny_documents()[:1], path, embed_model=model).close()
    with pytest.raises(ValueError, match=r"already holds an index; open it with HybridIndex.load\(.*overwrite=True"):
        HybridIndex.from_documents(tiny_documents()[1:], path, embed_model=model)
    with HybridIndex.load(path, embed_model=model) as idx:  # untouched by the refused build
        assert idx.doc_ids() == ["fees.txt"]
    with HybridIndex.from_documents(tiny_documents()[1:], path, embed_model=model, overwrite=True) as idx:
        assert idx.doc_ids() == ["filter.txt"]
        _support.assert_consistent(idx)


def test_failed_build_releases_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """from_documents closes its Qdrant client when it fails, so the folder can be built again;
    a failed build publishes nothing (it is built in a sibling folder, renamed when complete)."""
    path = tmp_path / "idx"
    model = MockEmbedding(embed_dim=8)
    original = BM25Retriever.persist
    calls = []

    def persist_then_fail(self, folder):
        calls.append(folder)
        if len(calls) > 1:  # generation 0 (empty) is committed, the first upsert fails
            raise OSError("disk full")
        return original(self, folder)

    monkeypatch.setattr(BM25Retriever, "persist", persist_then_fail)
    with pytest.raises(OSError, match="disk full") as failure:
        HybridIndex.from_documents(tiny_documents(), path, embed_model=model)
    monkeypatch.undo()
    # The traceback (kept alive here, as a logger or a notebook would) still references the
    # half-built index; its Qdrant client must be closed all the same.
    assert failure.tb is not None
    assert not (path / "index.json").exists()  # nothing half-built was published
    # The retry builds in the same sibling folder: no "already accessed" lock error.
    with HybridIndex.from_documents(tiny_documents(), path, embed_model=model) as idx:
        assert idx.doc_ids() == ["fees.txt", "filter.txt"]
        _support.assert_consistent(idx)
    with HybridIndex.from_documents(tiny_documents(), path, embed_model=model, overwrite=True) as idx:
        assert idx.doc_ids() == ["fees.txt", "filter.txt"]


def test_empty_index_answers_every_mode_with_nothing(tmp_path: Path) -> None:
    model = MockEmbedding(embed_dim=8)
    with HybridIndex.from_documents([], tmp_path / "idx", embed_model=model) as idx:
        assert len(idx) == 0 and idx.doc_ids() == []
        for mode in RETRIEVER_MODES:
            assert idx.as_retriever(mode).retrieve("annual fee") == [], mode
        assert idx.upsert(tiny_documents()[:1])["embedded"] == 1
        assert [r.node.ref_doc_id for r in idx.as_retriever("qdrant_hybrid").retrieve("annual fee")] == ["fees.txt"]
    with HybridIndex.load(tmp_path / "idx", embed_model=model) as idx:
        _support.assert_consistent(idx)


def test_dense_scores_of_a_non_unit_embedding_model_survive_reopening(tmp_path: Path) -> None:
    """Qdrant local mode normalises cosine vectors on upsert but not when it reloads them, so the
    index writes unit vectors itself (MockEmbedding returns [0.5] * dim, norm > 1)."""
    model = MockEmbedding(embed_dim=8)
    with HybridIndex.from_documents(tiny_documents(), tmp_path / "idx", embed_model=model) as idx:
        before = _support.ranking(idx.as_retriever("dense").retrieve("annual fee"))
    with HybridIndex.load(tmp_path / "idx", embed_model=model) as idx:
        after = _support.ranking(idx.as_retriever("dense").retrieve("annual fee"))
        _support.assert_consistent(idx)
    assert [s for _, s in before] == pytest.approx([1.0, 1.0])  # cosine of equal vectors
    assert [s for _, s in after] == pytest.approx([1.0, 1.0])  # not 1.41 (= the stored norm)
    assert {i for i, _ in after} == {i for i, _ in before}
