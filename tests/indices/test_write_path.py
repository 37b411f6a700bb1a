"""The bulk write path of HybridIndex: each shortcut gives exactly what the general code gave.

* ``IndexDocumentStore`` holds and persists the same data as LlamaIndex's ``SimpleDocumentStore``;
* ``store.bm25_sparse_parts`` (numpy, a batch) equals ``bm25_doc_vector`` per document;
* ``check_sparse``'s fast path for lists still refuses bad vectors;
* ``storage.paused_gc`` restores the collector's state;
* a write that only adds points commits without reloading the shard, and the live shard then
  scores the sparse leg exactly like the same folder reopened.
"""

from __future__ import annotations

import gc
import math
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.node_parser import HierarchicalNodeParser, SentenceSplitter
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.storage.docstore import SimpleDocumentStore

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices import storage as index_storage
from llama_index_retrieval_kit.indices.docstore import IndexDocumentStore, json_copy
from llama_index_retrieval_kit.indices.store import CheckedSparse, bm25_sparse_parts, check_sparse
from llama_index_retrieval_kit.retrievers.qdrant_hybrid import bm25_doc_vector, bm25_query_vector, token_id


def _documents() -> list:
    text = " ".join(f"Sentence {i} talks about fees, rates and the {i % 7}th clause of the agreement." for i in range(60))
    return [
        Document(id_="a", text=text, metadata={"tenant": "t1", "tags": ["x", "y"], "nested": {"k": [1, 2]}}),
        Document(id_="b", text=text[::-1], metadata={"tenant": "t2"}),
        Document(id_="c", text="short one", metadata={}),
    ]


def _loose_nodes() -> list:
    """Nodes without a document, and one whose document is already in the store."""
    free = TextNode(id_="free", text="no source")
    child = TextNode(id_="late", text="joins a", metadata={"extra": True})
    child.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="a")
    return [free, child]


@pytest.mark.parametrize(
    "parser",
    [SentenceSplitter(chunk_size=64, chunk_overlap=8), HierarchicalNodeParser.from_defaults(chunk_sizes=[256, 64])],
    ids=["flat", "hierarchical"],
)
def test_index_docstore_holds_what_simple_docstore_holds(parser) -> None:
    nodes = parser.get_nodes_from_documents(_documents())
    ours, theirs = IndexDocumentStore(), SimpleDocumentStore()
    for store in (ours, theirs):
        store.add_documents(nodes, allow_update=True)
        store.add_documents(_loose_nodes(), allow_update=True)  # onto existing ref doc info
        store.delete_ref_doc("b", raise_error=False)
        store.add_documents(nodes[-3:], allow_update=True)  # replaced in place
    assert ours.to_dict() == theirs.to_dict()
    assert list(ours.to_dict()["docstore/ref_doc_info"]) == list(theirs.to_dict()["docstore/ref_doc_info"])
    assert ours.get_ref_doc_info("a") == theirs.get_ref_doc_info("a")


def test_index_docstore_persists_and_reads_like_simple_docstore(tmp_path: Path) -> None:
    nodes = SentenceSplitter(chunk_size=64, chunk_overlap=8).get_nodes_from_documents(_documents())
    ours, theirs = IndexDocumentStore(), SimpleDocumentStore()
    ours.add_documents(nodes)
    theirs.add_documents(nodes)
    ours.persist(str(tmp_path / "ours.json"))
    theirs.persist(str(tmp_path / "theirs.json"))
    assert (tmp_path / "ours.json").read_bytes() == (tmp_path / "theirs.json").read_bytes()
    reread = IndexDocumentStore.from_persist_path(str(tmp_path / "theirs.json"))
    assert isinstance(reread, IndexDocumentStore) and reread.to_dict() == theirs.to_dict()


def test_ref_doc_info_does_not_share_the_nodes_metadata() -> None:
    node = TextNode(id_="n", text="t", metadata={"tags": ["x"], "nested": {"k": [1]}})
    node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="doc")
    store = IndexDocumentStore()
    store.add_documents([node])
    node.metadata["tags"].append("changed")
    node.metadata["nested"]["k"].append(2)
    assert store.get_ref_doc_info("doc").metadata == {"tags": ["x"], "nested": {"k": [1]}}


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=10))
def test_json_copy_is_equal_and_shares_no_container(value) -> None:
    copied = json_copy(value)
    assert copied == value

    def containers(v):
        if isinstance(v, (list, dict)):
            yield v
            for item in v.values() if isinstance(v, dict) else v:
                yield from containers(item)

    assert not {id(c) for c in containers(value)} & {id(c) for c in containers(copied)}


_TERMS = st.sampled_from([f"t{i}" for i in range(40)] + ["ünï", "a b", ""])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(_TERMS, max_size=30), max_size=12),
    st.floats(min_value=0.5, max_value=200),
    st.floats(min_value=0, max_value=3),
    st.floats(min_value=0, max_value=1),
)
def test_bm25_sparse_parts_equals_bm25_doc_vector(token_lists, avgdl, k1, b) -> None:
    got = bm25_sparse_parts(token_lists, avgdl, k1, b, term_id=token_id)
    assert len(got) == len(token_lists)
    for tokens, part in zip(token_lists, got):
        indices, values = part
        want = bm25_doc_vector(tokens, avgdl, k1, b)
        assert indices == want.indices
        assert values == want.values  # the same float operations, so exactly equal
        # marked as checked, and rightly: the full check passes on the same lists
        assert type(part) is CheckedSparse and check_sparse(part) is part
        assert check_sparse((list(indices), list(values))) == (indices, values)


def test_bm25_sparse_parts_adds_up_terms_sharing_an_id() -> None:
    [(indices, values)] = bm25_sparse_parts([["a", "b", "a", "c"]], 2.0, 1.2, 0.75, term_id=lambda t: 9 if t in "ab" else 4)
    norm = 1.2 * (1 - 0.75 + 0.75 * 4 / 2.0)
    assert indices == [4, 9]
    assert values == [1 / (1 + norm), 2 / (2 + norm) + 1 / (1 + norm)]


def test_bm25_sparse_parts_refuses_a_non_positive_avgdl() -> None:
    with pytest.raises(ValueError, match="avgdl"):
        bm25_sparse_parts([["a"]], 0.0, 1.2, 0.75, term_id=token_id)


@pytest.mark.parametrize(
    "vector, problem",
    [
        (([1, 2], [0.5]), "indices but"),
        (([1, 1], [0.5, 0.5]), "repeated"),
        (([-1], [0.5]), r"\[0, 2\*\*32\)"),
        (([2**32], [0.5]), r"\[0, 2\*\*32\)"),
        (([1], [math.nan]), "NaN"),
        (([1], [math.inf]), "NaN"),
    ],
)
def test_check_sparse_lists_are_still_checked(vector, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        check_sparse(vector)


def test_check_sparse_converts_lists_of_other_number_types() -> None:
    assert check_sparse(([True, 3], [1, 2.5])) == ([1, 3], [1.0, 2.5])


def test_paused_gc_restores_the_collector_and_nests() -> None:
    assert gc.isenabled()
    with index_storage.paused_gc():
        assert not gc.isenabled()
        with index_storage.paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still runs
    assert gc.isenabled()
    gc.disable()
    try:
        with index_storage.paused_gc():
            pass
        assert not gc.isenabled()  # a collector the caller disabled stays disabled
    finally:
        gc.enable()


def test_paused_gc_from_threads_ends_enabled() -> None:
    barrier = threading.Barrier(4)

    def work() -> None:
        for _ in range(50):
            with index_storage.paused_gc():
                barrier.wait() if _ == 0 else None

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert gc.isenabled()


def _sparse_scores(index: HybridIndex, text: str) -> dict:
    vector = bm25_query_vector(index.bm25.tokenize(text))
    hits = index.store.search(None, (vector.indices, vector.values), limit=50)
    return {payload["_node_content"]: score for payload, score in hits}


def test_an_insert_only_upsert_scores_like_the_reopened_folder(tmp_path: Path) -> None:
    model = MockEmbedding(embed_dim=8)
    docs = [Document(id_=f"d{i}", text=f"fee rate {'penalty ' * (i % 4)} clause{i} annual", metadata={"i": i}) for i in range(30)]
    index = HybridIndex.from_documents(docs[:20], tmp_path / "idx", embed_model=model)
    try:
        counts = index.upsert(docs[20:])  # only new documents: committed without reloading the shard
        assert counts["removed"] == 0 and counts["chunks"] == 10
        live = {q: _sparse_scores(index, q) for q in ("penalty fee", "clause25 annual", "rate")}
    finally:
        index.close()
    with HybridIndex.load(tmp_path / "idx", embed_model=model) as reopened:
        assert len(reopened) == 30
        for query, scores in live.items():
            again = _sparse_scores(reopened, query)
            assert again.keys() == scores.keys() and scores
            for key, score in scores.items():
                assert again[key] == pytest.approx(score, rel=1e-6)
