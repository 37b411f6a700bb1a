"""Filters on a chunk's document id mean what LlamaIndex's vector stores make them mean, in every
mode: ``ref_doc_id`` / ``document_id`` (which ``node_to_metadata_dict`` fills with the document
id) and ``doc_id`` also for chunks of a parser that leaves ``metadata["doc_id"]`` out.

Before, ``ref_doc_id NIN ["secret.txt"]`` kept secret.txt's chunks in every mode (the key was
"missing" from the chunk metadata, and a missing key matches NIN), while LlamaIndex's
``SimpleVectorStore`` and the index's own ``vector_store`` excluded them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Set

import pytest
from llama_index.core import Document
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode
from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.retrievers.filters import DOCUMENT_ID_ALIASES, metadata_matches

from . import _support

QUERY = "common text about fees"
PATHS = [(mode, {}) for mode in ("hybrid", "hybrid_score", "hybrid_rrf", "dense", "sparse", "qdrant_hybrid")] + [
    (mode, {"dense_search": "qdrant"}) for mode in ("hybrid", "hybrid_rrf", "dense")
]
DOCS = [
    Document(text="Common public text about fees and the annual charge.", id_="public.txt", metadata={"tenant": "a"}),
    Document(text="Common secret text about fees and the late charge.", id_="secret.txt", metadata={"tenant": "a"}),
    Document(text="Common text about fees, with its own document number.", id_="own.txt", metadata={"document_id": "C-7"}),
]


def _one(key: str, value, op: FilterOperator = FilterOperator.EQ) -> MetadataFilters:
    return MetadataFilters(filters=[MetadataFilter(key=key, value=value, operator=op)])


@pytest.fixture(scope="module", params=["package parser", "SentenceSplitter"])
def index(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridIndex]:
    parser = SentenceSplitter() if request.param == "SentenceSplitter" else None
    folder = tmp_path_factory.mktemp("docid") / "index"
    kwargs = {"node_parser": parser} if parser is not None else {}
    idx = HybridIndex.from_documents([d.model_copy(deep=True) for d in DOCS], folder, embed_model=_support.embed_model(), **kwargs)
    try:
        yield idx
    finally:
        idx.close()


def _docs(index: HybridIndex, mode: str, extra: dict, filters: MetadataFilters) -> Set[str]:
    retriever = index.as_retriever(mode, similarity_top_k=50, filters=filters, **extra)
    return {r.node.ref_doc_id for r in retriever.retrieve(QUERY)}


@pytest.mark.parametrize("key", ["doc_id", *DOCUMENT_ID_ALIASES])
def test_excluding_a_document_by_its_id_excludes_it_in_every_mode(index: HybridIndex, key: str) -> None:
    exclude = _one(key, ["secret.txt"], FilterOperator.NIN)
    only = _one(key, "secret.txt")
    for mode, extra in PATHS:
        assert "secret.txt" not in _docs(index, mode, extra, exclude), (key, mode, extra)
        assert _docs(index, mode, extra, only) == {"secret.txt"}, (key, mode, extra)


def test_a_chunk_s_own_value_under_an_alias_key_is_what_its_filter_reads(index: HybridIndex) -> None:
    """own.txt's metadata has a document_id of its own ("C-7"): a filter on that key reads it."""
    for mode, extra in PATHS:
        assert _docs(index, mode, extra, _one("document_id", "C-7")) == {"own.txt"}, (mode, extra)
        assert _docs(index, mode, extra, _one("document_id", "own.txt")) == set(), (mode, extra)
        assert _docs(index, mode, extra, _one("ref_doc_id", "own.txt")) == {"own.txt"}, (mode, extra)  # no own value


def test_the_recorded_doc_id_is_bookkeeping(index: HybridIndex) -> None:
    """A foreign parser's chunks get metadata["doc_id"] without changing what is embedded or shown to the LLM."""
    retriever = index.as_retriever("sparse", similarity_top_k=50)
    for result in retriever.retrieve(QUERY):
        node = result.node
        assert node.metadata["doc_id"] == node.ref_doc_id
        for mode in (MetadataMode.EMBED, MetadataMode.LLM):
            assert "doc_id:" not in node.get_content(metadata_mode=mode)


@pytest.mark.parametrize(
    "metadata, filters, expected",
    [
        ({"doc_id": "a.txt"}, _one("ref_doc_id", "a.txt"), True),
        ({"doc_id": "a.txt"}, _one("document_id", ["a.txt"], FilterOperator.NIN), False),
        ({"doc_id": "a.txt", "document_id": "C-7"}, _one("document_id", "a.txt"), False),
        ({"doc_id": "a.txt", "document_id": None}, _one("document_id", "a.txt"), True),
        ({}, _one("ref_doc_id", ["a.txt"], FilterOperator.NIN), True),
        ({"doc_id": "a.txt"}, _one("ref_doc_id", None, FilterOperator.IS_EMPTY), False),
    ],
)
def test_alias_semantics_in_memory(metadata: dict, filters: MetadataFilters, expected: bool) -> None:
    assert metadata_matches(metadata, filters) is expected
