"""A blank query (empty or whitespace, no embedding) is refused by every retriever of the package
with a ValueError saying what to pass, instead of empty (BM25) or arbitrary (the embedding of
nothing) results. A QueryBundle with blank text that carries its embedding, or strings to embed,
is a real query and keeps working, through LlamaIndex's query engine and the no-answer gate too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator, List

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.chat_engine import ContextChatEngine
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_retrieval_kit import NoAnswerPostprocessor
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.retrievers import BM25Retriever, HybridRetriever
from llama_index_retrieval_kit.retrievers.checks import check_not_blank

from .indices import _support

RETRIEVERS = _support.RETRIEVER_KINDS
BLANKS = ["", " ", "   ", "\n\t", "\u3000"]
WITH_A_DENSE_LEG = [r for r in RETRIEVERS if r[0] != "sparse"]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridIndex]:
    with _support.opened_sample_copy(tmp_path_factory.mktemp("blank")) as idx:
        yield idx


@pytest.fixture(scope="module")
def question() -> QueryBundle:
    """A sample question with its embedding."""
    return _support.query_bundles()[0]


def _ids(results: List[NodeWithScore]) -> List[str]:
    return [r.node.node_id for r in results]


@pytest.mark.parametrize(("mode", "options"), RETRIEVERS)
def test_every_index_retriever_refuses_a_blank_query(index: HybridIndex, mode: str, options: dict) -> None:
    retriever = index.as_retriever(mode, similarity_top_k=3, **options)
    for blank in BLANKS:
        with pytest.raises(ValueError, match="is blank") as caught:
            retriever.retrieve(blank)
        assert repr(blank) in str(caught.value) and "embedding" in str(caught.value)  # the value, and what to pass
        with pytest.raises(ValueError, match="is blank"):
            retriever.retrieve(QueryBundle(blank))
        with pytest.raises(ValueError, match="is blank"):
            asyncio.run(retriever.aretrieve(blank))


@pytest.mark.parametrize(("mode", "options"), WITH_A_DENSE_LEG)
def test_an_embedded_query_with_blank_text_still_retrieves(index: HybridIndex, question: QueryBundle, mode: str, options: dict) -> None:
    retriever = index.as_retriever(mode, similarity_top_k=3, **options)
    got = retriever.retrieve(QueryBundle("  ", embedding=list(question.embedding)))
    assert len(got) == 3
    dense_only = index.as_retriever("dense", similarity_top_k=3, **{k: v for k, v in options.items() if k == "dense_search"})
    if mode == "dense":  # no text leg: the same answer as with the text
        assert _ids(got) == _ids(dense_only.retrieve(QueryBundle(question.query_str, embedding=list(question.embedding))))
    assert len(asyncio.run(retriever.aretrieve(QueryBundle("", embedding=list(question.embedding))))) == 3


def test_strings_to_embed_count_as_a_query(index: HybridIndex, question: QueryBundle) -> None:
    dense = index.as_retriever("dense", similarity_top_k=3)
    by_strs = dense.retrieve(QueryBundle("", custom_embedding_strs=[question.query_str]))
    assert _ids(by_strs) == _ids(dense.retrieve(question.query_str))
    assert len(index.as_retriever("hybrid", similarity_top_k=3).retrieve(QueryBundle(" ", custom_embedding_strs=[question.query_str]))) == 3
    with pytest.raises(ValueError, match="no embedding"):  # blank strings to embed are no better
        dense.retrieve(QueryBundle("", custom_embedding_strs=["  "]))


def test_a_stand_alone_bm25_retriever_refuses_a_blank_query() -> None:
    bm25 = BM25Retriever.from_nodes([TextNode(text="the annual fee is 95 dollars", id_="a")])
    with pytest.raises(ValueError, match=r"the query is blank \('  '\).*pass the question text"):
        bm25.retrieve("  ")
    assert _ids(bm25.retrieve("annual fee")) == ["a"]
    assert bm25.retrieve("the of") == []  # text whose terms are all stop words is a query, just unmatched


class _Echo(BaseRetriever):
    """A leg of another kind: answers any bundle (e.g. from image_path)."""

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text="picture", id_="img"), score=1.0)]


def test_a_hybrid_retriever_leaves_blank_queries_to_its_legs(index: HybridIndex) -> None:
    bm25 = index.as_retriever("sparse", similarity_top_k=3)
    with pytest.raises(ValueError, match="is blank"):
        HybridRetriever([bm25, _Echo()]).retrieve("")
    assert _ids(HybridRetriever([_Echo(), _Echo()], names=["a", "b"]).retrieve(QueryBundle("", image_path="x.png"))) == ["img"]


def test_check_not_blank_passes_real_queries_unchanged() -> None:
    bundle = QueryBundle("", embedding=[0.1, 0.2])
    assert check_not_blank(bundle) is bundle
    assert check_not_blank(" fee ") == " fee "
    with pytest.raises(ValueError, match=r"QueryBundle.query_str is blank \(' '\) and the bundle has no embedding"):
        check_not_blank(QueryBundle(" "))


# ----------------------------------------------------------------------------- LlamaIndex flows
@pytest.fixture(scope="module")
def gate(index: HybridIndex) -> NoAnswerPostprocessor:
    return _support.calibrated_gate(index, top_k=5)


def test_a_query_engine_with_the_gate_refuses_blank_text_and_answers_an_embedded_query(
    index: HybridIndex, gate: NoAnswerPostprocessor, question: QueryBundle
) -> None:
    engine = RetrieverQueryEngine.from_args(
        index.as_retriever("hybrid", similarity_top_k=5), llm=MockLLM(max_tokens=5), node_postprocessors=[gate]
    )
    with pytest.raises(ValueError, match="is blank"):
        engine.query("   ")
    response = engine.query(QueryBundle("", embedding=list(question.embedding)))
    assert response.response  # the gate decided (answer or its no-answer text); nothing failed


def test_a_chat_engine_refuses_a_blank_message_and_chats_otherwise(index: HybridIndex, question: QueryBundle) -> None:
    chat = ContextChatEngine.from_defaults(index.as_retriever("hybrid", similarity_top_k=3), llm=MockLLM(max_tokens=5))
    with pytest.raises(ValueError, match="is blank"):
        chat.chat(" ")
    assert chat.chat(question.query_str).source_nodes
