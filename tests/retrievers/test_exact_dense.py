"""Exact dense search: the pure top-k against a brute-force oracle, and the retriever wrapper."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import QueryBundle, TextNode

from llama_index_retrieval_kit.retrievers import DenseMatrix, ExactDenseRetriever
from llama_index_retrieval_kit.retrievers.exact_dense import top_dense_matches, top_dense_positions

from ._strategies import corpus_st, filters_st, oracle_matches

DIM = 4
finite = st.floats(-4, 4, allow_nan=False, width=32)


def _oracle(nodes, vectors: np.ndarray, query: np.ndarray, top_k: int, filters=None):
    """Cosine similarity of every row, sorted high first (ties by row), filtered, cut."""
    vectors, query = vectors.astype(np.float64), query.astype(np.float64)  # float32 subnormals stay exact
    unit = vectors / np.where(np.linalg.norm(vectors, axis=1, keepdims=True) > 0, np.linalg.norm(vectors, axis=1, keepdims=True), 1)
    q = query / (np.linalg.norm(query) or 1)
    scores = unit.astype(np.float64) @ q.astype(np.float64)
    rows = [i for i in sorted(range(len(nodes)), key=lambda i: (-scores[i], i)) if filters is None or oracle_matches(nodes[i].metadata, filters)]
    return rows[:top_k], scores


@settings(max_examples=150, deadline=None)
@given(
    nodes=corpus_st(max_size=15),
    data=st.data(),
    top_k=st.integers(1, 20),
    filters=st.one_of(st.none(), filters_st),
)
def test_top_k_equals_brute_force_with_and_without_filters(nodes, data, top_k, filters) -> None:
    vectors = data.draw(arrays(np.float32, (len(nodes), DIM), elements=finite))
    query = data.draw(arrays(np.float32, (DIM,), elements=finite))
    matrix = DenseMatrix.build(nodes, vectors)
    got = top_dense_matches(matrix, query, top_k, filters)
    want_rows, scores = _oracle(nodes, vectors, query, top_k, filters)
    assert len(got) == len(want_rows)
    # Same scores position by position; rows may differ only inside a group of (near-)equal scores.
    for (row, score), want_row in zip(got, want_rows):
        assert abs(score - scores[want_row]) < 1e-5
        assert abs(scores[row] - scores[want_row]) < 1e-5
        if filters is not None:
            assert oracle_matches(nodes[row].metadata, filters)
    assert len({row for row, _ in got}) == len(got)
    assert [s for _, s in got] == sorted((s for _, s in got), reverse=True)


def test_known_answer_and_unit_normalisation() -> None:
    from llama_index.core.schema import TextNode

    nodes = [TextNode(id_=f"n{i}", text=str(i), metadata={"k": i % 2}) for i in range(4)]
    vectors = np.array([[1, 0], [0, 3], [1, 1], [-2, 0]], dtype=np.float32)
    matrix = DenseMatrix.build(nodes, vectors)
    np.testing.assert_allclose(np.linalg.norm(matrix.vectors, axis=1), 1.0, atol=1e-6)
    got = top_dense_matches(matrix, [2.0, 0.0], top_k=3)
    assert [r for r, _ in got] == [0, 2, 1]
    np.testing.assert_allclose([s for _, s in got], [1.0, np.sqrt(0.5), 0.0], atol=1e-6)
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

    odd = MetadataFilters(filters=[MetadataFilter(key="k", value=1)])
    assert [r for r, _ in top_dense_matches(matrix, [2.0, 0.0], top_k=3, filters=odd)] == [1, 3]
    assert top_dense_matches(DenseMatrix.build([], np.zeros((0, 2))), [1.0, 0.0], 3) == []
    with pytest.raises(ValueError, match="3-dimensional|shape"):
        top_dense_matches(matrix, [1.0, 0.0, 0.0], 3)


def test_retriever_returns_copies_and_follows_the_matrix_it_is_given() -> None:
    from llama_index.core.schema import TextNode

    nodes = [TextNode(id_=f"n{i}", text=f"text {i}", metadata={"i": i}) for i in range(3)]
    current = {"m": DenseMatrix.build(nodes, np.eye(3, dtype=np.float32))}
    retriever = ExactDenseRetriever(lambda: current["m"], MockEmbedding(embed_dim=3), similarity_top_k=2)
    first = retriever.retrieve(QueryBundle("q", embedding=[0.0, 1.0, 0.0]))
    assert [r.node.node_id for r in first] == ["n1", "n0"] and first[0].score == pytest.approx(1.0)
    first[0].node.metadata["i"] = "changed"
    first[0].node.text = "changed"
    again = retriever.retrieve(QueryBundle("q", embedding=[0.0, 1.0, 0.0]))
    assert again[0].node.metadata["i"] == 1 and again[0].node.text == "text 1"
    assert nodes[1].metadata["i"] == 1
    current["m"] = DenseMatrix.build(nodes[:1], np.eye(3, dtype=np.float32)[:1])
    assert [r.node.node_id for r in retriever.retrieve(QueryBundle("q", embedding=[0.0, 1.0, 0.0]))] == ["n0"]
    with pytest.raises(ValueError, match="similarity_top_k"):
        ExactDenseRetriever(lambda: current["m"], MockEmbedding(embed_dim=3), similarity_top_k=0)



def test_a_built_matrix_keeps_its_own_nodes_and_read_only_vectors() -> None:
    """``DenseMatrix.build`` copies the caller's nodes: the caller moving a node to another tenant
    afterwards changes neither filtering nor results. Its vectors are a new read-only array."""
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

    nodes = [TextNode(id_=f"n{i}", text=f"chunk {i}", metadata={"tenant": "A" if i < 2 else "B", "tags": ["t"]}) for i in range(4)]
    vectors = np.random.default_rng(0).normal(size=(4, DIM)).astype(np.float32)
    matrix = DenseMatrix.build(nodes, vectors)
    assert [n.to_dict() for n in matrix.nodes] == [n.to_dict() for n in nodes]
    assert not any(a is b or a.metadata["tags"] is b.metadata["tags"] for a, b in zip(matrix.nodes, nodes))
    tenant_a = MetadataFilters(filters=[MetadataFilter(key="tenant", value="A")])
    retriever = ExactDenseRetriever(lambda: matrix, MockEmbedding(embed_dim=DIM), similarity_top_k=4, filters=tenant_a)
    before = [r.node.node_id for r in retriever.retrieve("q")]
    nodes[0].metadata["tenant"] = "B"  # the caller's own list, edited afterwards
    results = retriever.retrieve("q")
    assert set(before) == {"n0", "n1"} and [r.node.node_id for r in results] == before
    assert all(r.node.metadata["tenant"] == "A" for r in results)

    assert not matrix.vectors.flags.writeable and not np.shares_memory(matrix.vectors, vectors)
    with pytest.raises(ValueError, match="read-only"):
        matrix.vectors[0, 0] = 1.0
    assert vectors.flags.writeable  # the caller's array is left as it was


def test_copy_nodes_false_keeps_private_nodes_as_given() -> None:
    """The no-copy path for nodes nobody else holds (an index's own snapshot): the same tuple object."""
    nodes = tuple(TextNode(id_=f"n{i}", text=f"chunk {i}") for i in range(3))
    matrix = DenseMatrix.build(nodes, np.eye(3, dtype=np.float32), copy_nodes=False)
    assert matrix.nodes is nodes and not matrix.vectors.flags.writeable
    with pytest.raises(ValueError, match="copy_nodes must be True or False, got 'no'"):
        DenseMatrix.build(nodes, np.eye(3, dtype=np.float32), copy_nodes="no")


# ----- query input ---------------------------------------------------------------------------------


def _eye_retriever(embed_model=None) -> ExactDenseRetriever:
    from llama_index.core.schema import TextNode

    nodes = [TextNode(id_=f"n{i}", text=f"text {i}") for i in range(3)]
    matrix = DenseMatrix.build(nodes, np.eye(3, dtype=np.float32))
    return ExactDenseRetriever(lambda: matrix, embed_model or MockEmbedding(embed_dim=3), similarity_top_k=2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 2])
def test_a_non_finite_given_query_embedding_is_refused(bad: float, position: int) -> None:
    vector = [0.0, 1.0, 0.0]
    vector[position] = bad
    with pytest.raises(ValueError, match=rf"QueryBundle.embedding has 1 NaN or infinite value\(s\) \(first at position {position}"):
        _eye_retriever().retrieve(QueryBundle("q", embedding=vector))
    matrix = DenseMatrix.build([], np.zeros((0, 3)))
    with pytest.raises(ValueError, match="NaN or infinite"):
        top_dense_matches(matrix, vector, 3)  # refused even when there is nothing to rank


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, 3, elements=st.floats(allow_nan=True, allow_infinity=True)))
def test_retrieval_never_returns_nan_scores(vector: np.ndarray) -> None:
    retriever = _eye_retriever()
    try:
        results = retriever.retrieve(QueryBundle("q", embedding=vector.tolist()))
    except ValueError as exc:
        with np.errstate(over="ignore"):
            assert not np.isfinite(vector.astype(np.float32)).all(), exc
    else:
        assert all(np.isfinite(r.score) for r in results)
        single = vector.astype(np.float32)  # what the index compares
        if np.abs(single).max() > 0:  # the best row is a largest component's, however large
            # a largest component's row, up to float32 rounding of the normalised query
            # (a subnormal and a zero component tie after normalisation)
            best = single[int(results[0].node.node_id[1:])]
            assert single.max() - best <= 1e-6 * np.abs(single).max()


def test_a_non_finite_embedding_from_the_model_is_refused_and_not_stored() -> None:
    class NanEmbedding(MockEmbedding):
        def _get_query_embedding(self, query: str):
            return [float("nan")] * 3

    bundle = QueryBundle("q")
    with pytest.raises(ValueError, match=r"the query embedding computed by NanEmbedding has 3 NaN"):
        _eye_retriever(NanEmbedding(embed_dim=3)).retrieve(bundle)
    assert bundle.embedding is None  # a later stage does not reuse it


def test_a_bytes_query_is_a_clear_error() -> None:
    retriever = _eye_retriever()
    with pytest.raises(ValueError, match=r"the query must be a str, got bytes b'fees': decode it first"):
        retriever.retrieve(b"fees")  # type: ignore[arg-type]
    import asyncio

    with pytest.raises(ValueError, match=r"the query must be a str or a QueryBundle, got NoneType"):
        asyncio.run(retriever.aretrieve(None))  # type: ignore[arg-type]
    assert [r.node.node_id for r in retriever.retrieve(QueryBundle("q", embedding=[1.0, 0.0, 0.0]))][0] == "n0"


def test_the_query_product_runs_on_one_blas_thread_and_restores_the_limit() -> None:
    """A busy neighbour core must not stall the dense leg on a second BLAS thread; queries,
    nested or from several threads, must not leave BLAS limited after they finish."""
    import threading

    from threadpoolctl import threadpool_info

    from llama_index_retrieval_kit.retrievers.exact_dense import one_blas_thread

    def blas_threads() -> list:
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    before = blas_threads()
    assert before, "numpy has a BLAS"
    with one_blas_thread():
        assert blas_threads() == [1] * len(before)
        with one_blas_thread():
            assert blas_threads() == [1] * len(before)
        assert blas_threads() == [1] * len(before)
    assert blas_threads() == before
    barrier = threading.Barrier(3)

    def query() -> None:
        with one_blas_thread():
            barrier.wait()

    threads = [threading.Thread(target=query) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert blas_threads() == before
    rng = np.random.default_rng(0)
    matrix = DenseMatrix.build([TextNode(text=str(i)) for i in range(50)], rng.standard_normal((50, 8)).astype(np.float32))
    rows, _ = top_dense_positions(matrix, matrix.vectors[3], 1)
    assert rows.tolist() == [3] and blas_threads() == before


@pytest.mark.parametrize("every", [10, 3, 2, 1])
def test_filtered_search_scores_only_the_passing_rows_when_few_and_answers_as_brute_force(every: int) -> None:
    """A filter keeping 1 row in 10 (or 3) is answered from a gathered block of those rows only
    (the other rows score -inf), one keeping half or all from the whole matrix; the top is the
    brute-force filtered top either way, and a second query vector reuses the same space."""
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

    from llama_index_retrieval_kit.retrievers.exact_dense import GATHER_FRACTION, FilteredDense, unit_query

    rng = np.random.default_rng(every)
    nodes = [TextNode(id_=f"n{i}", text=str(i), metadata={"bucket": i % every}) for i in range(300)]
    vectors = rng.standard_normal((300, 8)).astype(np.float32)
    matrix = DenseMatrix.build(nodes, vectors)
    flt = MetadataFilters(filters=[MetadataFilter(key="bucket", value=0)])
    space = FilteredDense.of(matrix, flt)
    assert space.rows.tolist() == list(range(0, 300, every))
    gathered = len(space.rows) <= GATHER_FRACTION * len(matrix)
    assert (space.block is not matrix.vectors) == gathered and gathered == (every >= 10)
    for query in (rng.standard_normal(8), vectors[7]):
        scores = space.similarities(unit_query(matrix, query))
        if gathered:
            outside = np.setdiff1d(np.arange(300), space.rows)
            assert np.isneginf(scores[outside]).all()
        rows, top = space.top(scores, 12)
        want_rows, want_scores = _oracle(nodes, vectors, np.asarray(query, np.float32), 12, flt)
        assert rows.tolist() == want_rows
        np.testing.assert_allclose(top, want_scores[want_rows], atol=1e-5)
