"""Hypothesis strategies and an independent filter oracle shared by the retriever tests."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Union

from hypothesis import strategies as st
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)
from llama_index.core.vector_stores.utils import build_metadata_filter_fn

WORDS = ["apple", "banana", "cherry", "date", "elder", "fig", "grape", "honey"]
LANGS = ["en", "de", "fr", "English", "eng"]
TAGS = ["a", "b", "c", "d"]
YEARS = st.integers(min_value=2018, max_value=2024)

metadata_st = st.fixed_dictionaries(
    {},
    optional={
        "year": YEARS,
        "lang": st.sampled_from(LANGS),
        "tags": st.lists(st.sampled_from(TAGS), unique=True, max_size=3),
    },
)


def _year_filter() -> st.SearchStrategy[MetadataFilter]:
    scalar_ops = [FilterOperator.EQ, FilterOperator.NE, FilterOperator.GT, FilterOperator.GTE, FilterOperator.LT, FilterOperator.LTE]
    return st.one_of(
        st.builds(MetadataFilter, key=st.just("year"), value=YEARS, operator=st.sampled_from(scalar_ops)),
        st.builds(
            MetadataFilter,
            key=st.just("year"),
            value=st.lists(YEARS, min_size=1, max_size=3),
            operator=st.sampled_from([FilterOperator.IN, FilterOperator.NIN]),
        ),
    )


def _lang_filter() -> st.SearchStrategy[MetadataFilter]:
    return st.one_of(
        st.builds(
            MetadataFilter,
            key=st.just("lang"),
            value=st.sampled_from(LANGS),
            operator=st.sampled_from([FilterOperator.EQ, FilterOperator.NE, FilterOperator.GT, FilterOperator.LTE]),
        ),
        st.builds(
            MetadataFilter,
            key=st.just("lang"),
            value=st.lists(st.sampled_from(LANGS), min_size=1, max_size=3),
            operator=st.sampled_from([FilterOperator.IN, FilterOperator.NIN]),
        ),
        st.builds(
            MetadataFilter,
            key=st.just("lang"),
            value=st.sampled_from(["en", "E", "g", "fr"]),
            operator=st.sampled_from([FilterOperator.TEXT_MATCH, FilterOperator.TEXT_MATCH_INSENSITIVE]),
        ),
    )


def _tags_filter() -> st.SearchStrategy[MetadataFilter]:
    return st.one_of(
        st.builds(MetadataFilter, key=st.just("tags"), value=st.sampled_from(TAGS), operator=st.just(FilterOperator.CONTAINS)),
        st.builds(
            MetadataFilter,
            key=st.just("tags"),
            value=st.lists(st.sampled_from(TAGS), min_size=1, max_size=2),
            operator=st.sampled_from([FilterOperator.ANY, FilterOperator.ALL]),
        ),
        st.builds(MetadataFilter, key=st.just("tags"), value=st.none(), operator=st.just(FilterOperator.IS_EMPTY)),
    )


leaf_filter_st = st.one_of(_year_filter(), _lang_filter(), _tags_filter())
conditions_st = st.sampled_from([FilterCondition.AND, FilterCondition.OR, FilterCondition.NOT])

filters_st: st.SearchStrategy[MetadataFilters] = st.recursive(
    st.builds(MetadataFilters, filters=st.lists(leaf_filter_st, min_size=1, max_size=3), condition=conditions_st),
    lambda children: st.builds(
        MetadataFilters,
        filters=st.lists(st.one_of(leaf_filter_st, children), min_size=1, max_size=3),
        condition=conditions_st,
    ),
    max_leaves=6,
)


def oracle_matches(metadata: Mapping[str, Any], filters: Union[MetadataFilters, MetadataFilter]) -> bool:
    """Reference semantics: LlamaIndex's SimpleVectorStore filter per leaf, combined recursively here."""
    if isinstance(filters, MetadataFilter):
        return build_metadata_filter_fn(lambda _: metadata, MetadataFilters(filters=[filters]))("node")
    results = [oracle_matches(metadata, sub) for sub in filters.filters]
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.AND:
        return all(results)
    if condition == FilterCondition.OR:
        return any(results)
    return not any(results)


@st.composite
def corpus_st(draw: st.DrawFn, min_size: int = 1, max_size: int = 12) -> List[TextNode]:
    """Small random nodes: texts over a tiny vocabulary (many overlaps), random metadata."""
    n = draw(st.integers(min_value=min_size, max_value=max_size))
    nodes = []
    for i in range(n):
        words = draw(st.lists(st.sampled_from(WORDS), min_size=0, max_size=8))
        metadata: Dict[str, Any] = draw(metadata_st)
        nodes.append(TextNode(id_=f"n{i:02d}", text=" ".join(words), metadata=metadata))
    return nodes


query_st = st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(" ".join)
