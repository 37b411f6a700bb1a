"""The precision stage (gate, reranker, assembler, tracing) in the LlamaIndex flows users compose
by hand: postprocessor orders the pipeline config would refuse, and chat engines (sync, async,
streaming) whose turns must be traced as one query each (real index over the bundled samples,
real embedding model, a tiny offline cross-encoder, MockLLM)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.llms import MockLLM
from llama_index.core.schema import NodeWithScore

from llama_index_retrieval_kit import ContextAssembler, CrossEncoderReranker, NoAnswerPostprocessor
from llama_index_retrieval_kit.evaluation import load_jsonl
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.samples import QUESTIONS_FILE
from llama_index_retrieval_kit.tracing import JsonlTraceWriter

from .indices import _support
from .postprocessor._cross_encoder_folder import build_tiny_cross_encoder

ANSWERED = "How much is the late payment fee?"
STAGES = ["bm25", "dense", "feedback", "fusion", "no_answer", "context"]


@pytest.fixture(scope="module")
def sample_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridIndex]:
    with _support.opened_sample_copy(tmp_path_factory.mktemp("interop")) as index:
        yield index


def _labelled(index: HybridIndex, mode: str) -> Tuple[List[Tuple[str, List[NodeWithScore]]], List[Tuple[str, List[NodeWithScore]]]]:
    dataset = load_jsonl(QUESTIONS_FILE)
    retriever = index.as_retriever(mode, similarity_top_k=5)
    pairs = lambda ids: [(dataset.queries[q], retriever.retrieve(dataset.queries[q])) for q in ids]  # noqa: E731
    return pairs(dataset.answerable_ids()), pairs(dataset.no_answer_ids())


@pytest.fixture(scope="module")
def legs_gate(sample_index: HybridIndex) -> NoAnswerPostprocessor:
    return NoAnswerPostprocessor.fit(*_labelled(sample_index, "hybrid"), no_answer_text="No answer in these documents.")


@pytest.fixture(scope="module")
def closed_questions(legs_gate: NoAnswerPostprocessor, sample_index: HybridIndex) -> List[str]:
    dataset = load_jsonl(QUESTIONS_FILE)
    retriever = sample_index.as_retriever("hybrid", similarity_top_k=5)
    questions = [dataset.queries[q] for q in dataset.no_answer_ids()]
    closed = [q for q in questions if not legs_gate.postprocess_nodes(retriever.retrieve(q), query_str=q)]
    assert len(closed) >= 2 and legs_gate.postprocess_nodes(retriever.retrieve(ANSWERED), query_str=ANSWERED)
    return closed


class FailingLLM(MockLLM):
    """Answers only a chat engine's condense step (with the follow-up itself); any other call fails."""

    def complete(self, prompt, formatted: bool = False, **kwargs):  # type: ignore[override]
        if "Follow Up Input:" in prompt:
            return CompletionResponse(text=prompt.split("Follow Up Input:")[-1].split("Standalone question")[0].strip())
        raise AssertionError("the LLM was called although the gate closed")

    async def acomplete(self, prompt, formatted: bool = False, **kwargs):  # type: ignore[override]
        return self.complete(prompt, formatted, **kwargs)

    def stream_complete(self, *args, **kwargs):  # type: ignore[override]
        raise AssertionError("the LLM was called although the gate closed")

    async def astream_complete(self, *args, **kwargs):  # type: ignore[override]
        raise AssertionError("the LLM was called although the gate closed")


# ----------------------------------------------------------------------------- gate after other stages
def test_a_gate_refuses_results_unlike_its_calibration_instead_of_misgating(
    sample_index: HybridIndex, legs_gate: NoAnswerPostprocessor, tmp_path: Path
) -> None:
    """A gate fitted on a dense retriever's scores, put after the hybrid retriever (the index's
    default mode), read the fused score as a cosine and passed all 8 bundled no-answer questions
    (2 at its calibration); one fitted on retrieval results, put after a reranker, read the
    reranker's top_n instead of the results it was calibrated on. Both are refused now, as a gate
    fitted on fused results is refused single-leg results."""
    score_gate = NoAnswerPostprocessor.fit(*_labelled(sample_index, "dense"))
    assert score_gate.feature_set == "score"
    dense = sample_index.as_retriever("dense", similarity_top_k=5).retrieve(ANSWERED)
    assert isinstance(score_gate.confidence(dense, ANSWERED), float)  # the results it was fitted on
    with pytest.raises(ValueError, match="fused"):
        sample_index.as_query_engine(llm=FailingLLM(), node_postprocessors=[score_gate]).query(ANSWERED)
    reranker = CrossEncoderReranker(
        model=str(build_tiny_cross_encoder(tmp_path / "ce")), backend="sentence_transformers", device="cpu", top_n=3, max_length=128
    )
    reranked = reranker.postprocess_nodes(sample_index.as_retriever("hybrid", similarity_top_k=5).retrieve(ANSWERED), query_str=ANSWERED)
    with pytest.raises(ValueError, match="before the reranker"):
        legs_gate.postprocess_nodes(reranked, query_str=ANSWERED)
    with pytest.raises(ValueError, match="reranked"):
        score_gate.postprocess_nodes(reranker.postprocess_nodes(dense, query_str=ANSWERED), query_str=ANSWERED)
    # an assembler's nodes carry no leg scores: the message says where the gate goes
    with pytest.raises(ValueError, match="before any ContextAssembler"):
        sample_index.as_query_engine(llm=MockLLM(max_tokens=5), node_postprocessors=[ContextAssembler(max_tokens=200), legs_gate]).query(ANSWERED)


# ----------------------------------------------------------------------------- chat engines, traced
class AnsweringLLM(FailingLLM):
    """Condenses as FailingLLM does and answers anything else (MockLLM's echo)."""

    def complete(self, prompt, formatted: bool = False, **kwargs):  # type: ignore[override]
        if "Follow Up Input:" in prompt:
            return super().complete(prompt, formatted, **kwargs)
        return MockLLM.complete(self, prompt, formatted, **kwargs)


@pytest.mark.parametrize("engine_class", [ContextChatEngine, CondensePlusContextChatEngine])
def test_each_chat_turn_is_one_trace_with_its_own_gate_decision(
    sample_index: HybridIndex, legs_gate: NoAnswerPostprocessor, closed_questions: List[str], engine_class: type, tmp_path: Path
) -> None:
    """Chat engines run retriever, gate and assembler with no query start/end event: each stage
    was written as a trace of its own (3 JSON lines per turn, none attached to the response).
    Now a turn is one trace, attached to its AgentChatResponse, under asyncio.gather too."""
    closed = closed_questions[:2]
    path = tmp_path / "traces.jsonl"

    def engine(llm: MockLLM) -> object:
        retriever = sample_index.as_retriever("hybrid", similarity_top_k=5)
        return engine_class.from_defaults(retriever, llm=llm, node_postprocessors=[legs_gate, ContextAssembler(max_tokens=150)])

    async def ask(question: str) -> object:
        return await engine(AnsweringLLM(max_tokens=5) if question == ANSWERED else FailingLLM()).achat(question)

    async def stream(question: str) -> str:
        response = await engine(FailingLLM()).astream_chat(question)
        return "".join([token async for token in response.async_response_gen()])

    async def run_all() -> Tuple[list, list]:
        return await asyncio.gather(*[ask(q) for q in [closed[0], ANSWERED, closed[1]]]), await asyncio.gather(*[stream(q) for q in closed])

    with JsonlTraceWriter(path=str(path)) as writer:
        replies, streamed = asyncio.run(run_all())
        synced = engine(FailingLLM()).chat(closed[0])
    writer.flush()
    for question, reply in zip([closed[0], ANSWERED, closed[1]], replies):
        assert bool(reply.metadata.get("no_answer")) is (question != ANSWERED)
        assert (str(reply) == "No answer in these documents.") is (question != ANSWERED)
        assert bool(reply.source_nodes) is (question == ANSWERED)
        assert all(n.node.metadata["citation"] for n in reply.source_nodes)  # the assembler's nodes
        trace = reply.metadata["trace"]
        assert trace["query_str"] == question and [s["name"] for s in trace["stages"]] == STAGES
        gate_stage = trace["stages"][STAGES.index("no_answer")]
        assert (gate_stage["confidence"] < gate_stage["threshold"]) is (question != ANSWERED)
    assert streamed == ["No answer in these documents."] * 2
    assert synced.metadata["trace"]["query_str"] == closed[0] and synced.metadata["no_answer"] is True
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 6  # 3 achat + 2 astream_chat + 1 chat: one line per turn
    assert sorted(line["query_str"] for line in lines) == sorted([closed[0], ANSWERED, closed[1], *closed, closed[0]])
    assert all([s["name"] for s in line["stages"]] == STAGES for line in lines)


def test_the_chat_turn_span_handler_leaves_with_the_last_collector() -> None:
    """Tracing off costs nothing: no span handler of tracing stays on LlamaIndex's dispatcher."""
    from llama_index.core.instrumentation import get_dispatcher

    from llama_index_retrieval_kit.tracing import TraceCollector

    def scopes() -> int:
        return sum(type(h).__name__ == "ChatTraceScope" for h in get_dispatcher().span_handlers)

    leftover = [h for h in get_dispatcher().event_handlers if isinstance(h, TraceCollector)]  # another test's
    for handler in leftover:
        handler.uninstall()
    try:
        assert scopes() == 0
        first, second = TraceCollector(), TraceCollector()
        with first:
            with second:
                assert scopes() == 1
            assert scopes() == 1  # the first collector still listens
        assert scopes() == 0
    finally:
        for handler in leftover:
            handler.install()


@pytest.mark.parametrize("streaming", [False, True])
def test_no_text_response_mode_answers_with_the_given_llm(sample_index: HybridIndex, streaming: bool) -> None:
    """LlamaIndex's get_response_synthesizer builds NoText without the llm it is given (it then falls
    back to Settings.llm: OpenAI, an ImportError here); the engine builders pass the llm through."""
    from llama_index_retrieval_kit._settings import settings_llm
    from llama_index_retrieval_kit.pipeline import PipelineConfig, build_query_engine

    assert settings_llm() is None  # nothing to fall back to
    engine = sample_index.as_query_engine(llm=MockLLM(), response_mode="no_text", streaming=streaming)
    response = engine.query("What is the late payment fee?")
    assert response.source_nodes
    config = PipelineConfig.from_dict({"index": {"storage_dir": str(sample_index.storage_dir)}})
    pipeline_engine = build_query_engine(config, llm=MockLLM(), index=sample_index, response_mode="no_text", streaming=streaming)
    assert pipeline_engine.query("What is the late payment fee?").source_nodes
