"""HybridIndex crash safety: a write that dies after Qdrant was changed leaves the previous index
readable, both on the next open (journal roll-back in ``load``) and in the live object
(roll-back on the failed call).

A killed process runs no ``except`` handler, so the tests that simulate a kill also switch off
``HybridIndex._recover`` (the in-process roll-back) and leave the repair to ``HybridIndex.load``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llama_index.core.node_parser import get_leaf_nodes
from llama_index.core.storage.docstore import SimpleDocumentStore

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices import storage as storage_module  # index.json writes: fault injection
from llama_index_retrieval_kit.retrievers import BM25Retriever

from . import _support
from ._support import CHANGED_DOC


class SimulatedCrash(Exception):
    pass


def crash(*args, **kwargs):
    raise SimulatedCrash("power cut")


def snapshot(index: HybridIndex, bundles) -> dict:
    legs = _support.assert_consistent(index)
    return {
        "docs": index.doc_ids(),
        "ids": set(legs.docstore_leaves),
        "parents": set(legs.docstore_parents),
        "results": _support.run_modes(index, bundles),
        "generation": index.config["generation"],
    }


def assert_previous_index(reopened: HybridIndex, before: dict, bundles, failed_ids: set, index_dir: Path) -> None:
    """The reopened index is exactly the committed one: same documents, chunks and answers."""
    assert reopened.config["pending"] is None
    assert json.loads((index_dir / "index.json").read_text())["pending"] is None
    assert reopened.config["generation"] == before["generation"]
    assert reopened.doc_ids() == before["docs"]
    legs = _support.assert_consistent(reopened)  # docstore == BM25 == Qdrant dense/sparse, texts, vectors
    assert set(legs.docstore_leaves) == before["ids"]
    assert not failed_ids & (set(legs.qdrant) | set(legs.bm25) | set(legs.docstore_leaves))
    _support.assert_same_results(_support.run_modes(reopened, bundles), before["results"])
    # The unfinished generation's files are gone; only the committed one is left.
    gen = before["generation"]
    assert [p.name for p in (index_dir / "bm25").iterdir()] == [f"gen-{gen}"]
    assert [p.name for p in (index_dir / "docstore").iterdir()] == [f"gen-{gen}.json"]


def new_leaf_ids(index: HybridIndex) -> set:
    return {n.node_id for n in get_leaf_nodes(index.node_parser.get_nodes_from_documents([_support.changed_document()]))}


@pytest.mark.parametrize("where", ["bm25_persist", "index_json_switch"])
def test_crash_during_upsert_after_qdrant_write_is_rolled_back_on_load(
    index_dir: Path, embed_model, bundles, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    queries = bundles[:3]
    crashed = HybridIndex.load(index_dir, embed_model=embed_model)
    before = snapshot(crashed, queries)
    failed_ids = new_leaf_ids(crashed) - before["ids"]
    assert failed_ids

    with monkeypatch.context() as m:
        m.setattr(HybridIndex, "_recover", lambda self: None)  # a killed process runs no handler
        if where == "bm25_persist":  # dies while writing the next generation's files
            m.setattr(BM25Retriever, "persist", crash)
        else:  # dies after the next generation's files, before index.json switches to them
            real = storage_module.write_json_atomic

            def switch_fails(path, data):
                if data.get("pending") is None:
                    crash()
                real(path, data)

            m.setattr(storage_module, "write_json_atomic", switch_fails)
        with pytest.raises(SimulatedCrash):
            crashed.upsert([_support.changed_document()])

    # The crash hit after Qdrant was written: the failed write's chunks are in the collection.
    assert failed_ids <= _support.qdrant_ids(crashed)
    journal = json.loads((index_dir / "index.json").read_text())["pending"]
    assert journal["generation"] == before["generation"] + 1 and failed_ids <= set(journal["touched_ids"])
    crashed.close()  # Qdrant local mode: one client per folder

    with HybridIndex.load(index_dir, embed_model=embed_model) as reopened:
        assert_previous_index(reopened, before, queries, failed_ids, index_dir)
        # ...and the index takes the same write once the fault is gone.
        reopened.upsert([_support.changed_document()])
        assert new_leaf_ids(reopened) <= set(_support.assert_consistent(reopened).qdrant)


def test_crash_during_delete_is_rolled_back_on_load_from_the_embedding_cache(
    index_dir: Path, embed_model, bundles, monkeypatch: pytest.MonkeyPatch
) -> None:
    queries = bundles[20:23]
    crashed = HybridIndex.load(index_dir, embed_model=embed_model)
    before = snapshot(crashed, queries)
    doomed = set(crashed.docstore.get_ref_doc_info(CHANGED_DOC).node_ids)
    with monkeypatch.context() as m:
        m.setattr(HybridIndex, "_recover", lambda self: None)
        m.setattr(SimpleDocumentStore, "persist", crash)
        with pytest.raises(SimulatedCrash):
            crashed.delete(CHANGED_DOC)
    assert not doomed & _support.qdrant_ids(crashed)  # Qdrant had already dropped the points
    crashed.close()

    calls = []
    real = type(embed_model).get_text_embedding_batch
    monkeypatch.setattr(type(embed_model), "get_text_embedding_batch", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    with HybridIndex.load(index_dir, embed_model=embed_model) as reopened:
        assert calls == []  # the restored points' vectors came from the cache, not the model
        assert_previous_index(reopened, before, queries, set(), index_dir)
        assert CHANGED_DOC in reopened.doc_ids() and doomed <= _support.qdrant_ids(reopened)


def test_two_failed_writes_in_one_process_are_both_rolled_back(
    index_dir: Path, embed_model, bundles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the in-process roll-back fails too, the journal keeps the ids of every unfinished
    write (it grows until a commit), so the next open repairs both."""
    queries = bundles[:2]
    crashed = HybridIndex.load(index_dir, embed_model=embed_model)
    before = snapshot(crashed, queries)
    failed_ids = new_leaf_ids(crashed) - before["ids"]
    with monkeypatch.context() as m:
        m.setattr(HybridIndex, "_recover", lambda self: None)
        m.setattr(BM25Retriever, "persist", crash)
        with pytest.raises(SimulatedCrash):
            crashed.upsert([_support.changed_document()])
        with pytest.raises(SimulatedCrash):
            crashed.delete("product_manual.md")
    assert failed_ids <= _support.qdrant_ids(crashed)
    touched = set(json.loads((index_dir / "index.json").read_text())["pending"]["touched_ids"])
    assert failed_ids <= touched
    crashed.close()
    with HybridIndex.load(index_dir, embed_model=embed_model) as reopened:
        assert_previous_index(reopened, before, queries, failed_ids, index_dir)


def test_failed_write_is_rolled_back_in_the_live_object(
    index, index_dir: Path, bundles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a restart: the object that saw the write fail reads the previous index at once
    (BM25 views made before the failure included), and takes later writes normally."""
    queries = bundles[5:8]
    before = snapshot(index, queries)
    failed_ids = new_leaf_ids(index) - before["ids"]
    bm25_view = index.as_retriever("sparse", similarity_top_k=100)
    view_before = _support.ranking(bm25_view.retrieve("GPS location zephyrquartz beacon"))
    with monkeypatch.context() as m:
        m.setattr(BM25Retriever, "persist", crash)
        with pytest.raises(SimulatedCrash):
            index.upsert([_support.changed_document()])
    assert_previous_index(index, before, queries, failed_ids, index_dir)
    assert _support.ranking(bm25_view.retrieve("GPS location zephyrquartz beacon")) == view_before

    index.upsert([_support.changed_document()])
    assert new_leaf_ids(index) <= set(_support.assert_consistent(index).qdrant)
