"""``HybridIndex.as_chat_engine``: LlamaIndex's chat engines over the index (real index over the
bundled samples, real embedding model, MockLLM), every keyword used or refused."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from llama_index.core.chat_engine import CondensePlusContextChatEngine, CondenseQuestionChatEngine, ContextChatEngine
from llama_index.core.chat_engine.types import ChatMode
from llama_index.core.llms import MockLLM
from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

from llama_index_retrieval_kit import ContextAssembler
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.retrievers import FusedNodeWithScore

from . import _support

QUESTION = "How much is the late payment fee?"


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridIndex]:
    with _support.opened_sample_copy(tmp_path_factory.mktemp("chat")) as opened:
        yield opened


def test_the_default_is_condense_plus_context_over_the_hybrid_retriever(index: HybridIndex) -> None:
    engine = index.as_chat_engine(llm=MockLLM(max_tokens=5), similarity_top_k=3)
    assert type(engine) is CondensePlusContextChatEngine
    reply = engine.chat(QUESTION)
    assert len(reply.source_nodes) == 3 and all(isinstance(n, FusedNodeWithScore) for n in reply.source_nodes)
    expected = [n.node.node_id for n in index.as_retriever("hybrid", similarity_top_k=3).retrieve(QUESTION)]
    assert [n.node.node_id for n in reply.source_nodes] == expected
    assert type(index.as_chat_engine(chat_mode=ChatMode.BEST, llm=MockLLM())) is CondensePlusContextChatEngine  # LlamaIndex's default


def test_context_mode_takes_retriever_options_and_postprocessors(index: HybridIndex) -> None:
    source = index.as_retriever("hybrid", similarity_top_k=1).retrieve(QUESTION)[0].node.metadata["source"]
    only = MetadataFilters(filters=[MetadataFilter(key="source", value=source)])
    engine = index.as_chat_engine(
        chat_mode=ChatMode.CONTEXT, llm=MockLLM(max_tokens=5), mode="sparse", similarity_top_k=4, filters=only,
        node_postprocessors=[ContextAssembler(max_tokens=120)], system_prompt="Answer from the context.",
    )
    assert type(engine) is ContextChatEngine
    reply = engine.chat(QUESTION)
    assert reply.source_nodes, "the assembler's context reaches the chat engine"
    for node in reply.source_nodes:  # assembled nodes (citations, the chunks they were built from), all from the filtered file
        assert node.node.metadata["source_node_ids"] and node.node.metadata["citation"]
        assert node.node.metadata["source"] == source


def test_condense_question_gets_the_query_engine_with_its_options(index: HybridIndex) -> None:
    engine = index.as_chat_engine(chat_mode="condense_question", llm=MockLLM(max_tokens=5), similarity_top_k=2, response_mode="compact")
    assert type(engine) is CondenseQuestionChatEngine
    reply = engine.chat(QUESTION)
    assert len(reply.source_nodes) == 2 and all(isinstance(n, FusedNodeWithScore) for n in reply.source_nodes)


@pytest.mark.parametrize(
    "chat_mode, error, match",
    [
        ("simple", ValueError, "SimpleChatEngine.from_defaults"),
        (ChatMode.REACT, ValueError, "ReActAgent"),
        ("openai", ValueError, "FunctionAgent"),
        ("chatty", ValueError, "unknown chat engine mode 'chatty'; allowed: 'condense_plus_context', 'context', 'condense_question'"),
    ],
)
def test_modes_that_do_not_read_the_index_are_refused_saying_what_to_use(index: HybridIndex, chat_mode, error, match) -> None:
    with pytest.raises(error, match=match):
        index.as_chat_engine(chat_mode=chat_mode, llm=MockLLM())


def test_a_keyword_nothing_takes_is_refused_not_dropped(index: HybridIndex) -> None:
    # LlamaIndex's ContextChatEngine.from_defaults(**kwargs) would drop both silently
    with pytest.raises(TypeError, match=r"'response_mode'.*ContextChatEngine.from_defaults \(chat_history"):
        index.as_chat_engine(chat_mode="context", llm=MockLLM(), response_mode="compact")
    with pytest.raises(TypeError, match="'similarty_top_k'"):
        index.as_chat_engine(llm=MockLLM(), similarty_top_k=3)
    with pytest.raises(ValueError, match="mode='dense' does not use rrf_k"):
        index.as_chat_engine(llm=MockLLM(), mode="dense", rrf_k=10)
    with pytest.raises(ValueError, match="unknown retriever mode"):
        index.as_chat_engine(llm=MockLLM(), mode="bm25s")


def test_an_llm_is_required(index: HybridIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index.core import Settings

    monkeypatch.setattr(Settings, "_llm", None)
    with pytest.raises(ValueError, match="as_chat_engine needs an LLM"):
        index.as_chat_engine()


def test_postprocessors_and_templates_llamaindex_would_fail_on_later_are_refused_up_front(index: HybridIndex) -> None:
    """LlamaIndex builds these engines and fails later: one postprocessor not in a list with
    "'tuple' object has no attribute 'callback_manager'", a function or a str template at the first query."""
    from llama_index.core.prompts import PromptTemplate

    assembler = ContextAssembler(max_tokens=100)
    with pytest.raises(TypeError, match=r"node_postprocessors takes a list: pass node_postprocessors=\[ContextAssembler\(...\)\]"):
        index.as_query_engine(llm=MockLLM(), node_postprocessors=assembler)
    with pytest.raises(TypeError, match=r"node_postprocessors\[1\] is function, not a LlamaIndex BaseNodePostprocessor"):
        index.as_chat_engine(chat_mode="context", llm=MockLLM(), node_postprocessors=[assembler, lambda nodes: nodes])
    with pytest.raises(TypeError, match=r"text_qa_template must be a LlamaIndex prompt template.*got str"):
        index.as_query_engine(llm=MockLLM(), text_qa_template="Context: {context_str}\nQ: {query_str}")
    with pytest.raises(TypeError, match="node_postprocessors takes a list"):
        index.as_chat_engine(chat_mode="condense_question", llm=MockLLM(), node_postprocessors=assembler)
    template = PromptTemplate("Context: {context_str}\nQ: {query_str}\nA: ")
    engine = index.as_query_engine(llm=MockLLM(max_tokens=3), node_postprocessors=(assembler,), text_qa_template=template)
    assert engine.query(QUESTION).source_nodes  # a tuple of postprocessors and a real template work


@pytest.mark.parametrize("chat_mode", ["condense_plus_context", "context", "condense_question"])
def test_every_chat_mode_attaches_its_turn_trace_to_the_reply(index: HybridIndex, chat_mode: str, tmp_path: Path) -> None:
    """Each turn's reply carries one trace of its stages, and the JSON lines hold one line per turn.
    Before, a condense_question reply had none (the trace was only on the inner query's Response)."""
    from llama_index_retrieval_kit.tracing import JsonlTraceWriter, read_traces

    path = tmp_path / "traces.jsonl"
    writer = JsonlTraceWriter(path=str(path))
    with writer:
        reply = index.as_chat_engine(chat_mode=chat_mode, llm=MockLLM(max_tokens=5), similarity_top_k=3).chat(QUESTION)
    writer.close()
    trace = reply.metadata["trace"]
    assert [s["name"] for s in trace["stages"]][-1] == "fusion" and trace["query_str"]
    lines = read_traces(path)
    assert len(lines) == 1 and lines[0].trace_id == trace["trace_id"]
    if chat_mode == "condense_question":
        assert reply.sources[0].raw_output.metadata["trace"] is trace
