"""Metadata filters apply to every leg and every mode of a HybridIndex: no mode returns a node
that violates the filter (oracle: ``metadata_matches``), and none loses a node that matches."""

from __future__ import annotations

from typing import Iterator, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

from llama_index_retrieval_kit.indices import RETRIEVER_MODES, HybridIndex
from llama_index_retrieval_kit.retrievers import metadata_matches

from . import _support


@pytest.fixture(scope="module")
def filter_index(template: _support.Template, tmp_path_factory: pytest.TempPathFactory, embed_model) -> Iterator[HybridIndex]:
    path = _support.copy_index(template, tmp_path_factory.mktemp("filters") / "index")
    idx = HybridIndex.load(path, embed_model=embed_model)
    try:
        yield idx
    finally:
        idx.close()


@pytest.fixture(scope="module")
def leaves(filter_index: HybridIndex) -> dict:
    """The indexed chunks (node id -> node), read once."""
    return _support.read_legs(filter_index).docstore_leaves


# The sample index's metadata, known up front so that strategies can be built at import time.
DOC_IDS = ["credit_card_terms.md", "product_manual.md", "privacy_policy.txt", "missing.txt"]
PAGES = list(range(0, 12))
TITLES = [
    "2. Fees",
    "2.1 Annual Fee",
    "2.2 Late Payment Fee",
    "3.1 Purchase APR",
    "6. Disputes",
    "Safety Information",
    "How to Replace the Cartridge",
    "Section 2 - Data We Collect",
    "Section 4 - Retention",
    "No Such Section",
]
EQUALITY_OPS = [FilterOperator.EQ, FilterOperator.NE]
LIST_OPS = [FilterOperator.IN, FilterOperator.NIN]
ORDER_OPS = [FilterOperator.GT, FilterOperator.LT]


def _leaf(key: str, values: List, ops: List[FilterOperator]) -> st.SearchStrategy[MetadataFilter]:
    scalar = st.builds(MetadataFilter, key=st.just(key), value=st.sampled_from(values), operator=st.sampled_from(ops))
    listed = st.builds(
        MetadataFilter,
        key=st.just(key),
        value=st.lists(st.sampled_from(values), min_size=1, max_size=3, unique=True),
        operator=st.sampled_from(LIST_OPS),
    )
    return st.one_of(scalar, listed)


leaf_st = st.one_of(
    _leaf("doc_id", DOC_IDS, EQUALITY_OPS),
    _leaf("page_start", PAGES, EQUALITY_OPS + ORDER_OPS),
    _leaf("section_title", TITLES, EQUALITY_OPS),
)
condition_st = st.sampled_from([FilterCondition.AND, FilterCondition.OR])
group_st = st.builds(MetadataFilters, filters=st.lists(leaf_st, min_size=1, max_size=3), condition=condition_st)
filters_st = st.builds(
    MetadataFilters, filters=st.lists(st.one_of(leaf_st, leaf_st, group_st), min_size=1, max_size=3), condition=condition_st
)


def test_sample_index_has_the_metadata_the_strategies_use(leaves: dict) -> None:
    nodes = leaves.values()
    assert {n.metadata["doc_id"] for n in nodes} == set(DOC_IDS[:3])
    pages = {n.metadata["page_start"] for n in nodes}
    assert len(pages) >= 5 and pages <= set(PAGES)
    assert set(TITLES[:-1]) <= {n.metadata["section_title"] for n in nodes}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filters=filters_st, query_index=st.integers(0, 37), top_k=st.sampled_from([3, 100]))
def test_no_leg_and_no_mode_returns_a_node_outside_the_filter(
    filter_index: HybridIndex, leaves: dict, filters, query_index, top_k
) -> None:
    bundles = _support.query_bundles()
    qb = bundles[query_index % len(bundles)]
    matching = {i for i, n in leaves.items() if metadata_matches(n.metadata, filters)}
    # What BM25 finds without the filter: the filtered sparse leg must be exactly its matching part.
    unfiltered_sparse = [r.node.node_id for r in filter_index.as_retriever("sparse", similarity_top_k=100).retrieve(qb)]
    expected_sparse = [i for i in unfiltered_sparse if i in matching][:top_k]

    for mode in RETRIEVER_MODES:
        results = filter_index.as_retriever(mode, similarity_top_k=top_k, filters=filters).retrieve(qb)
        ids = [r.node.node_id for r in results]
        assert len(ids) == len(set(ids)), f"{mode}: duplicate results"
        for r in results:
            assert metadata_matches(r.node.metadata, filters), f"{mode} leaked {r.node.metadata} through {filters}"
            assert r.node.node_id in matching
        # Filters apply before the cut: a filtered mode never comes back short while matches exist.
        if mode == "sparse":
            assert ids == expected_sparse
        else:  # the dense leg ranks every point, so fused modes always fill up to top_k
            assert len(ids) == min(top_k, len(matching)), f"{mode}: {len(ids)} of {len(matching)} matches"
            if top_k >= len(leaves):  # nothing cut: every leg's whole candidate list is visible here
                assert set(ids) == matching, mode


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filters=filters_st, query_index=st.integers(0, 37), fusion=st.sampled_from(["rrf", "score"]))
def test_array_fusion_equals_generic_fusion_under_filters(filter_index: HybridIndex, filters, query_index, fusion) -> None:
    from llama_index_retrieval_kit.retrievers import HybridRetriever

    qb = _support.query_bundles()[query_index % 38]
    fast = filter_index.as_retriever(f"hybrid_{fusion}", similarity_top_k=8, candidate_top_k=30, filters=filters)
    generic = HybridRetriever(
        [
            filter_index.as_retriever("sparse", similarity_top_k=30, filters=filters),
            filter_index.as_retriever("dense", similarity_top_k=30, filters=filters),
        ],
        names=["bm25", "dense"],
        mode=fusion,
        similarity_top_k=8,
    )
    got, want = fast.retrieve(qb), generic.retrieve(qb)
    assert [(r.node.node_id, r.score, r.leg_ranks) for r in got] == [(r.node.node_id, r.score, r.leg_ranks) for r in want]


@pytest.mark.parametrize(
    "mode, options",
    [
        ("dense", {"dense_search": "memory"}),
        ("hybrid_score", {"dense_search": "memory"}),
        ("dense", {"dense_search": "qdrant"}),
        ("hybrid_score", {"dense_search": "qdrant"}),
        ("hybrid_rrf", {"dense_search": "qdrant"}),
        ("qdrant_hybrid", {}),
        ("sparse", {}),
    ],
)
def test_a_filter_changed_in_place_is_followed_by_the_retriever_built_with_it(
    filter_index: HybridIndex, mode: str, options: dict
) -> None:
    """A caller reusing one MetadataFilters object for the next tenant: every leg, the Qdrant-side
    ones included, answers for the filter's current value, as a retriever built anew would."""
    qb = _support.query_bundles()[0]
    flt = MetadataFilters(filters=[MetadataFilter(key="doc_id", value=DOC_IDS[0])])
    retriever = filter_index.as_retriever(mode, similarity_top_k=100, filters=flt, **options)
    assert {r.node.metadata["doc_id"] for r in retriever.retrieve(qb)} == {DOC_IDS[0]}

    flt.filters[0].value = DOC_IDS[1]  # the same object, now another document
    after = retriever.retrieve(qb)
    fresh = filter_index.as_retriever(mode, similarity_top_k=100, filters=flt, **options).retrieve(qb)
    assert after and {r.node.metadata["doc_id"] for r in after} == {DOC_IDS[1]}
    assert [r.node.node_id for r in after] == [r.node.node_id for r in fresh]


@pytest.mark.parametrize(
    "mode, options",
    [
        ("dense", {"dense_search": "qdrant"}),
        ("qdrant_hybrid", {}),
        ("dense", {"dense_search": "memory"}),
        ("sparse", {}),
        ("hybrid", {}),
        ("hybrid_score", {"dense_search": "memory"}),
        ("hybrid_score", {"dense_search": "qdrant"}),
        ("hybrid_rrf", {"dense_search": "qdrant"}),
    ],
)
def test_filters_assigned_to_a_retriever_are_followed(filter_index: HybridIndex, mode: str, options: dict) -> None:
    """``retriever.filters = other`` answers for ``other`` in every mode and leg (the engine-side
    retrievers used to keep the filter they were built with, the fused ones to ignore it)."""
    qb = _support.query_bundles()[0]
    retriever = filter_index.as_retriever(
        mode, similarity_top_k=100, filters=MetadataFilters(filters=[MetadataFilter(key="doc_id", value=DOC_IDS[0])]), **options
    )
    assert {r.node.metadata["doc_id"] for r in retriever.retrieve(qb)} == {DOC_IDS[0]}
    retriever.filters = MetadataFilters(filters=[MetadataFilter(key="doc_id", value=DOC_IDS[1])])
    assert {r.node.metadata["doc_id"] for r in retriever.retrieve(qb)} == {DOC_IDS[1]}
