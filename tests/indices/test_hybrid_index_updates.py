"""HybridIndex upsert and delete: only changed chunks are embedded, and every leg (docstore,
BM25, Qdrant dense, Qdrant sparse / qdrant_hybrid) ends up holding exactly the new chunks."""

from __future__ import annotations

import json
import logging

import pytest
from llama_index.core.node_parser import get_leaf_nodes
from llama_index.core.schema import MetadataMode, QueryBundle

from llama_index_retrieval_kit.indices import RETRIEVER_MODES, HybridIndex
from llama_index_retrieval_kit.indices.store import point_id
from llama_index_retrieval_kit.retrievers.qdrant_hybrid import bm25_query_vector

from . import _support
from ._support import CHANGED_DOC


def sparse_hits(index: HybridIndex, text: str) -> set:
    """Point ids the Qdrant sparse vectors match for ``text`` (the sparse leg of qdrant_hybrid)."""
    vector = bm25_query_vector(index.bm25.tokenize(text))
    return {point_id(json.loads(payload["_node_content"])["id_"]) for payload, _ in index.store.search(None, vector, limit=1000)}


def ids_in_every_mode(index: HybridIndex, query: str, embed_model) -> dict:
    qb = QueryBundle(query, embedding=embed_model.get_query_embedding(query))
    return {
        mode: {r.node.node_id for r in index.as_retriever(mode, similarity_top_k=100).retrieve(qb)}
        for mode in RETRIEVER_MODES
    }


def test_upsert_of_a_changed_document_embeds_only_changed_chunks_and_leaves_no_stale_chunk(index, embed_model) -> None:
    before = _support.assert_consistent(index)
    old_ids = set(index.docstore.get_ref_doc_info(CHANGED_DOC).node_ids)
    old_texts = {n.get_content(metadata_mode=MetadataMode.EMBED) for n in before.docstore_leaves.values()}
    gps_ids = {i for i in old_ids if "GPS" in before.docstore_leaves[i].get_content()}
    assert gps_ids and sparse_hits(index, "GPS") >= gps_ids

    changed = _support.changed_document()
    new_nodes = get_leaf_nodes(index.node_parser.get_nodes_from_documents([changed]))
    new_ids = {n.node_id for n in new_nodes}
    new_texts = {n.get_content(metadata_mode=MetadataMode.EMBED) for n in new_nodes}
    expected_embedded = len(new_texts - old_texts)
    assert 1 <= expected_embedded < len(new_nodes)  # the edit touches some chunks, not all
    assert old_ids - new_ids, "the longer sentence shifts later chunks, so some old ids must go"

    cache_before = len(index.cache)
    counts = index.upsert([changed])

    assert counts == {
        "documents": 1,
        "chunks": len(new_nodes),
        "removed": len(old_ids - new_ids),
        "embedded": expected_embedded,
        "empty": [],
    }
    assert len(index.cache) == cache_before + expected_embedded
    after = _support.assert_consistent(index)  # docstore == BM25 == Qdrant (ids, texts, dense, sparse)
    assert set(index.docstore.get_ref_doc_info(CHANGED_DOC).node_ids) == new_ids
    others = set(before.docstore_leaves) - old_ids
    assert set(after.docstore_leaves) == others | new_ids  # other documents untouched
    assert after.qdrant_count == len(others) + len(new_ids)

    # The removed sentence is gone from every leg and mode; the new one is found in every mode.
    assert not sparse_hits(index, "GPS") & (old_ids | new_ids)
    assert not any("GPS" in n.get_content() for n in index.bm25.nodes)
    found = ids_in_every_mode(index, "zephyrquartz network beacon", embed_model)
    beacon_ids = {n.node_id for n in new_nodes if "zephyrquartz" in n.get_content()}
    assert beacon_ids
    for mode, ids in found.items():
        assert not ids & (old_ids - new_ids), f"{mode} returned a stale chunk"
        assert ids <= set(after.docstore_leaves), mode
    for mode in ("sparse", "hybrid", "hybrid_score", "qdrant_hybrid"):
        assert beacon_ids <= found[mode], mode
    assert sparse_hits(index, "zephyrquartz") == beacon_ids


def test_upsert_of_an_unchanged_document_embeds_nothing(index) -> None:
    before = _support.read_legs(index)
    (doc,) = [d for d in _support.sample_documents() if d.id_ == CHANGED_DOC]
    counts = index.upsert([doc])
    assert counts["embedded"] == 0 and counts["removed"] == 0
    after = _support.assert_consistent(index)
    assert set(after.qdrant) == set(before.qdrant) and after.qdrant_count == before.qdrant_count


def test_upsert_survives_reopening(index, index_dir, embed_model) -> None:
    index.upsert([_support.changed_document()])
    want = _support.run_modes(index, _support.query_bundles()[:2])
    index.close()
    with HybridIndex.load(index_dir, embed_model=embed_model) as reopened:
        _support.assert_consistent(reopened)
        _support.assert_same_results(_support.run_modes(reopened, _support.query_bundles()[:2]), want)


def test_delete_removes_the_document_from_every_leg(index, embed_model) -> None:
    before = _support.read_legs(index)
    doomed = set(index.docstore.get_ref_doc_info(CHANGED_DOC).node_ids)
    assert index.delete(CHANGED_DOC) == len(doomed)
    after = _support.assert_consistent(index)
    assert CHANGED_DOC not in index.doc_ids()
    assert set(after.qdrant) == set(before.qdrant) - doomed
    assert after.qdrant_count == before.qdrant_count - len(doomed)
    assert not sparse_hits(index, "Contoso privacy retention") & doomed
    for mode, ids in ids_in_every_mode(index, "How long does Contoso keep my account data?", embed_model).items():
        assert ids and not ids & doomed, mode


def test_deleting_an_unknown_document_is_a_clear_error(index) -> None:
    with pytest.raises(ValueError, match=r"no document 'nope.txt' in .*known ids: \['credit_card_terms.md'"):
        index.delete("nope.txt")
    with pytest.raises(TypeError, match=r"delete takes one document id \(a str\), got list \['nope.txt'\]: for several"):
        index.delete(["nope.txt"])  # was Python's bare "unhashable type: 'list'"
    index.delete(CHANGED_DOC)
    with pytest.raises(ValueError, match=f"no document '{CHANGED_DOC}'"):
        index.delete(CHANGED_DOC)  # a second delete of the same document
    _support.assert_consistent(index)


def test_upsert_of_a_document_that_became_empty_removes_its_chunks(index, caplog: pytest.LogCaptureFixture) -> None:
    from llama_index.core import Document

    with caplog.at_level(logging.WARNING, logger="llama_index_retrieval_kit.indices.hybrid_index"):
        counts = index.upsert([Document(text="", id_=CHANGED_DOC)])
    assert counts["chunks"] == 0 and counts["removed"] > 0
    assert counts["empty"] == [CHANGED_DOC]
    _support.assert_consistent(index)
    assert CHANGED_DOC not in index.doc_ids()
    warned = [r.getMessage() for r in caplog.records if "gave no chunks" in r.getMessage()]
    assert len(warned) == 1 and repr(CHANGED_DOC) in warned[0]


def test_upsert_names_every_document_that_gave_no_chunks(index, caplog: pytest.LogCaptureFixture) -> None:
    """A whitespace-only replacement and a whitespace-only new document are listed in
    ``stats["empty"]`` and in one warning; the documents with text are not."""
    from llama_index.core import Document

    (kept,) = [d for d in _support.sample_documents() if d.id_ == CHANGED_DOC]
    before = set(index.doc_ids())
    docs = [Document(text="  \n\t\n", id_="terms-blank.txt"), kept, Document(text="\n\n", id_="new-empty.txt")]
    with caplog.at_level(logging.WARNING, logger="llama_index_retrieval_kit.indices.hybrid_index"):
        counts = index.upsert(docs)
    assert counts["empty"] == ["terms-blank.txt", "new-empty.txt"]
    assert counts["documents"] == 3 and counts["chunks"] > 0
    assert set(index.doc_ids()) == before  # the empty ones are not indexed; CHANGED_DOC still is
    warned = [r.getMessage() for r in caplog.records if "gave no chunks" in r.getMessage()]
    assert len(warned) == 1 and "'terms-blank.txt'" in warned[0] and "'new-empty.txt'" in warned[0]
    assert repr(CHANGED_DOC) not in warned[0]
    _support.assert_consistent(index)
