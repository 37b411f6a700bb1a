"""CrossEncoderReranker: real models (a tiny random cross-encoder folder), real backends, real events."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Optional

import numpy as np
import pytest
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_retrieval_kit.postprocessor import rerank as rerank_module
from llama_index_retrieval_kit.postprocessor.rerank import (
    CrossEncoderReranker,
    RerankBackend,
    RerankedNodeWithScore,
    cap_candidates,
    check_device,
    large_model_warning,
    max_input_tokens,
    max_passage_chars,
    passage_text,
    running_estimate,
    sigmoid,
)
from llama_index_retrieval_kit.retrievers.fusion import FusedNodeWithScore, reciprocal_rank_fusion

from ._cross_encoder_folder import build_tiny_cross_encoder

REPO = Path(__file__).resolve().parents[2]
HAS_FLAG = importlib.util.find_spec("FlagEmbedding") is not None
BACKENDS = [
    "sentence_transformers",
    pytest.param("flag_embedding", marks=pytest.mark.skipif(not HAS_FLAG, reason="FlagEmbedding not installed ([rerank] extra)")),
]
QUERY = "what is the late payment fee"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_cross_encoder(tmp_path_factory.mktemp("tiny_cross_encoder")))


@pytest.fixture(scope="module")
def cross_encoder(model_dir: str) -> Any:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(model_dir, max_length=128, device="cpu")


def make_reranker(model_dir: str, **kwargs: Any) -> CrossEncoderReranker:
    kwargs.setdefault("backend", "sentence_transformers")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("max_length", 128)
    return CrossEncoderReranker(model=model_dir, **kwargs)


def chunks(n: int = 8) -> List[TextNode]:
    topics = ["late payment fee", "annual fee", "interest rate", "disputes", "card security", "billing cycle"]
    return [
        TextNode(
            id_=f"chunk-{i}",
            text=f"Clause {i}: the {topics[i % len(topics)]} is described here. " * (1 + i % 3),
            metadata={"section_header": f"{i % 4 + 1}. Fees > {i % 4 + 1}.{i} {topics[i % len(topics)].title()}", "doc_id": "agreement"},
        )
        for i in range(n)
    ]


def fused_candidates(n: int = 8) -> List[NodeWithScore]:
    nodes = chunks(n)
    dense = [NodeWithScore(node=node, score=0.9 - 0.05 * i) for i, node in enumerate(nodes)]
    bm25 = [NodeWithScore(node=node, score=12.0 - i) for i, node in enumerate(reversed(nodes))]
    return reciprocal_rank_fusion([dense, bm25], names=["dense", "bm25"])


def direct_probabilities(cross_encoder: Any, candidates: List[NodeWithScore], max_length: int = 128) -> List[float]:
    """What sentence-transformers' CrossEncoder says for the same pairs, sigmoid applied."""
    pairs = [(QUERY, passage_text(c.node, True, max_passage_chars(max_length))) for c in candidates]
    return [float(p) for p in cross_encoder.predict(pairs, show_progress_bar=False)]  # its default: Sigmoid for one logit


class SimulatedClock:
    """Stands in for the rerank module's ``time``: only model calls move it, by a known cost.

    A call on pairs costs ``fixed_ms`` plus ``ms_per_char`` per passage character, so the
    tiny warm-up pair costs almost only the fixed part, as on a real model.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fixed_ms: float, ms_per_char: float) -> None:
        self.now_ms = 0.0
        self.fixed_ms, self.ms_per_char = fixed_ms, ms_per_char
        monkeypatch.setattr(rerank_module, "time", SimpleNamespace(perf_counter=lambda: self.now_ms / 1000))

    def call(self, pairs: List[Any]) -> None:
        self.now_ms += self.fixed_ms + self.ms_per_char * sum(len(passage) for _, passage in pairs)


class PairCounter:
    """Wraps CrossEncoder.predict: counts the pairs scored (optionally moving a simulated clock)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, clock: Optional[SimulatedClock] = None) -> None:
        from sentence_transformers import CrossEncoder

        self.calls: List[List[Any]] = []
        original = CrossEncoder.predict
        counter = self

        def predict(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            counter.calls.append(list(inputs))
            if clock is not None:
                clock.call(list(inputs))
            return original(model, inputs, *args, **kwargs)

        monkeypatch.setattr(CrossEncoder, "predict", predict)

    @property
    def pairs(self) -> int:
        return sum(len(c) for c in self.calls)


# ------------------------------------------------------------------------------ pure functions
def test_sigmoid_is_the_logistic_function_without_overflow() -> None:
    assert sigmoid(0.0) == 0.5
    for x in (-30.0, -2.5, -1e-3, 0.7, 4.0, 30.0):
        assert sigmoid(x) == pytest.approx(1 / (1 + math.exp(-x)), rel=1e-12)
        assert sigmoid(x) + sigmoid(-x) == pytest.approx(1.0)
    assert sigmoid(-1000.0) == 0.0 and sigmoid(1000.0) == 1.0


def test_cap_candidates_fits_the_budget_between_minimum_and_all() -> None:
    assert cap_candidates(40, per_pair_ms=10.0, budget_ms=205.0) == 20
    assert cap_candidates(40, per_pair_ms=10.0, budget_ms=10_000.0) == 40
    assert cap_candidates(40, per_pair_ms=10.0, budget_ms=5.0, minimum=3) == 3
    assert cap_candidates(40, per_pair_ms=10.0, budget_ms=-50.0, minimum=0) == 0
    assert cap_candidates(2, per_pair_ms=10.0, budget_ms=0.0, minimum=5) == 2
    with pytest.raises(ValueError, match=r"per_pair_ms must be a finite number > 0, got 0"):
        cap_candidates(4, 0.0, 100.0)
    with pytest.raises(ValueError, match=r"got -1 and 0"):
        cap_candidates(-1, 1.0, 100.0)


def test_running_estimate_starts_at_the_measurement_then_moves_towards_new_ones() -> None:
    assert running_estimate(None, 12.0) == 12.0
    assert running_estimate(10.0, 20.0, weight=0.3) == pytest.approx(13.0)


def test_passage_text_prefixes_the_section_path_and_cuts_long_text() -> None:
    node = TextNode(text="A late fee of $40 applies.", metadata={"section_header": "3. Fees > 3.2 Late payment"})
    assert passage_text(node) == "3. Fees > 3.2 Late payment\nA late fee of $40 applies."
    assert passage_text(node, prefix_section=False) == "A late fee of $40 applies."
    assert passage_text(TextNode(text="no header", metadata={"section_header": ""})) == "no header"
    assert passage_text(TextNode(text="plain")) == "plain"
    long = TextNode(text="word " * 100_000)
    assert len(passage_text(long, max_chars=max_passage_chars(64))) == 64 * 16
    assert "section_header" not in passage_text(node)  # metadata is not rendered as "key: value"


def test_backend_names_and_errors() -> None:
    assert RerankBackend.from_str("flag_embedding") is RerankBackend.FLAG_EMBEDDING
    assert RerankBackend.from_str(RerankBackend.SENTENCE_TRANSFORMERS) is RerankBackend.SENTENCE_TRANSFORMERS
    with pytest.raises(ValueError, match=r"unknown rerank backend 'onnx'; allowed: 'flag_embedding', 'sentence_transformers'"):
        RerankBackend.from_str("onnx")
    assert check_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match=r"device 'gpu' is not supported; allowed: auto, cpu, cuda, cuda:<index>, mps"):
        check_device("gpu")


def test_large_model_warning_only_for_big_models_on_cpu() -> None:
    message = large_model_warning("BAAI/bge-reranker-large", 560_000_000, "cpu")
    assert message is not None and "560M parameters" in message and "cross-encoder/ms-marco-MiniLM-L6-v2" in message
    assert "docs/reranking.md" in message
    assert large_model_warning("BAAI/bge-reranker-large", 560_000_000, "cuda") is None
    assert large_model_warning("minilm", 22_700_000, "cpu") is None


def test_max_input_tokens_knows_roberta_position_offset() -> None:
    from transformers import BertConfig, XLMRobertaConfig

    assert max_input_tokens(BertConfig(max_position_embeddings=512)) == 512
    assert max_input_tokens(XLMRobertaConfig(max_position_embeddings=514, pad_token_id=1)) == 512


def test_importing_the_module_does_not_import_torch() -> None:
    # The package's own __init__ imports the embeddings (torch); load this subpackage without it.
    code = f"""
import sys, types
for name, sub in (("llama_index_retrieval_kit", ""), ("llama_index_retrieval_kit.postprocessor", "/postprocessor")):
    module = types.ModuleType(name)
    module.__path__ = [{str(REPO / "llama_index_retrieval_kit")!r} + sub]
    sys.modules[name] = module
import llama_index_retrieval_kit.postprocessor.rerank as r
r.CrossEncoderReranker(model="BAAI/bge-reranker-large", backend="sentence_transformers", device="cpu")
heavy = [m for m in ("torch", "transformers", "sentence_transformers", "FlagEmbedding", "onnxruntime") if m in sys.modules]
print(",".join(heavy) or "none")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "none"


# ------------------------------------------------------------------------------ reranking
@pytest.mark.parametrize("backend", BACKENDS)
def test_orders_by_its_own_probability_and_keeps_what_came_before(model_dir: str, cross_encoder: Any, backend: str) -> None:
    candidates = fused_candidates(8)
    reranker = make_reranker(model_dir, backend=backend, top_n=8)
    results = reranker.postprocess_nodes(candidates, query_str=QUERY)

    expected = direct_probabilities(cross_encoder, candidates)
    expected_order = sorted(range(len(candidates)), key=lambda i: -expected[i])
    assert [r.pre_rerank_rank - 1 for r in results] == expected_order
    assert len(set(np.round(expected, 6))) == len(expected)  # no ties: the order is really decided by the model
    for result in results:
        i = result.pre_rerank_rank - 1
        source = candidates[i]
        assert isinstance(result, RerankedNodeWithScore) and isinstance(result, FusedNodeWithScore)
        assert 0.0 < result.score < 1.0
        assert result.score == pytest.approx(expected[i], abs=1e-5)
        assert result.score == pytest.approx(sigmoid(result.rerank_logit))
        assert result.pre_rerank_score == source.score
        assert result.node is source.node  # same node object, new result object
        assert result.leg_scores == source.leg_scores and result.leg_ranks == source.leg_ranks
    assert [r.score for r in results] == sorted((r.score for r in results), reverse=True)
    assert reranker.engine in ("torch", "flag") and reranker.resolved_device == "cpu"


def test_plain_inputs_keep_their_score_and_rank_with_empty_legs(model_dir: str) -> None:
    candidates = [NodeWithScore(node=node, score=None if i == 2 else 10.0 - i) for i, node in enumerate(chunks(4))]
    results = make_reranker(model_dir, top_n=4).postprocess_nodes(candidates, query_str=QUERY)
    by_rank = {r.pre_rerank_rank: r for r in results}
    assert sorted(by_rank) == [1, 2, 3, 4]
    assert by_rank[3].pre_rerank_score is None and by_rank[1].pre_rerank_score == 10.0
    assert all(r.leg_scores == {} and r.leg_ranks == {} for r in results)


def test_inputs_are_not_mutated(model_dir: str) -> None:
    candidates = fused_candidates(6)
    before = [copy.deepcopy(c.model_dump()) for c in candidates]
    nodes_before = [copy.deepcopy(c.node.model_dump()) for c in candidates]
    results = make_reranker(model_dir, top_n=3).postprocess_nodes(candidates, query_str=QUERY)
    assert [c.model_dump() for c in candidates] == before
    assert [c.node.model_dump() for c in candidates] == nodes_before
    assert all(type(c) is FusedNodeWithScore for c in candidates)
    assert not any(r is c for r in results for c in candidates)


def test_top_n_and_candidate_cap_limit_what_is_scored_and_returned(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    candidates = fused_candidates(10)
    reranker = make_reranker(model_dir, top_n=2, max_candidates=4).load()  # loading runs two warm-up passes
    counter = PairCounter(monkeypatch)
    results = reranker.postprocess_nodes(candidates, query_str=QUERY)
    assert counter.pairs == 4
    assert len(results) == 2 and all(r.pre_rerank_rank <= 4 for r in results)
    stats = reranker.last_stats
    assert (stats.candidates, stats.capped_to, stats.scored, stats.returned) == (10, 4, 4, 2)

    counter.calls.clear()
    reranker.max_candidates = None
    assert len(reranker.postprocess_nodes(candidates, query_str=QUERY)) == 2
    assert counter.pairs == 10


def test_latency_budget_caps_the_pairs_scored(model_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Simulated time (no timed test): a model call costs 8 ms plus 0.5 ms per 50-character passage."""
    fixed_ms, pair_ms, budget_ms = 8.0, 0.5, 30.2
    clock = SimulatedClock(monkeypatch, fixed_ms=fixed_ms, ms_per_char=pair_ms / 50)
    counter = PairCounter(monkeypatch, clock)
    candidates = [NodeWithScore(node=TextNode(id_=f"p{i}", text=f"{i:02d} " + "x" * 47), score=1.0) for i in range(80)]
    reranker = make_reranker(model_dir, top_n=3, max_candidates=None, latency_budget_ms=budget_ms, section_prefix=False)
    reranker.load()  # a warm-up pass (not measured), then a tiny pass measuring the fixed cost
    assert [len(c) for c in counter.calls] == [1, 1]

    counter.calls.clear()
    first = reranker.postprocess_nodes(candidates, query_str=QUERY)
    # first call: the top_n pairs alone to measure the cost, then what fits in the rest of the budget
    sizes = [len(c) for c in counter.calls]
    assert sizes[0] == 3 and len(sizes) == 2 and sizes[1] >= 20  # the per-call average would allow 6
    assert reranker.last_stats.scored == sum(sizes) and len(first) == 3
    assert all(r.pre_rerank_rank <= sum(sizes) for r in first)
    # two calls of different sizes separate the fixed cost from the per-pair cost
    assert reranker.fixed_call_ms == pytest.approx(fixed_ms) and reranker.per_pair_ms == pytest.approx(pair_ms)

    for _ in range(3):  # later calls: one model call on all that fits, floor((30.2 - 8) / 0.5) = 44 pairs
        counter.calls.clear()
        started = clock.now_ms
        reranker.postprocess_nodes(candidates, query_str=QUERY)
        assert [len(c) for c in counter.calls] == [44] and clock.now_ms - started == pytest.approx(fixed_ms + 44 * pair_ms)
        stats = reranker.last_stats
        assert (stats.scored, stats.fixed_call_ms, stats.per_pair_ms) == (44, pytest.approx(fixed_ms), pytest.approx(pair_ms))

    counter.calls.clear()
    reranker.latency_budget_ms = 1.0  # below the cost of top_n pairs: top_n are still scored, with one warning
    with caplog.at_level(logging.WARNING, logger=rerank_module.__name__):
        assert len(reranker.postprocess_nodes(candidates, query_str=QUERY)) == 3
        reranker.postprocess_nodes(candidates, query_str=QUERY)
    assert [len(c) for c in counter.calls] == [3, 3]
    assert caplog.text.count("is below the cost of top_n=3 pairs") == 1


def test_passages_are_truncated_to_max_length_tokens(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    head = "The late payment fee is forty dollars when the minimum payment is not received on time."
    tail = " Unrelated words about museums, rivers and mountains follow here." * 200
    short, long = (NodeWithScore(node=TextNode(id_=i, text=t), score=1.0) for i, t in (("a", head), ("b", head + tail)))

    tight = make_reranker(model_dir, top_n=2, max_length=24)
    a, b = sorted(tight.postprocess_nodes([short, long], query_str=QUERY), key=lambda r: r.pre_rerank_rank)
    assert a.rerank_logit == pytest.approx(b.rerank_logit, abs=1e-5)  # the tail is beyond what the model reads

    roomy = make_reranker(model_dir, top_n=2, max_length=128)
    a, b = sorted(roomy.postprocess_nodes([short, long], query_str=QUERY), key=lambda r: r.pre_rerank_rank)
    assert abs(a.rerank_logit - b.rerank_logit) > 1e-3  # ...and it matters once the model reads it

    counter = PairCounter(monkeypatch)
    tight.postprocess_nodes([long], query_str=QUERY)
    assert len(counter.calls[0][0][1]) == 24 * 16  # cut before tokenizing, not the whole 13k characters

    with pytest.raises(ValueError, match=r"max_length=256 is more than .* reads; allowed: 8 to 128 tokens"):
        make_reranker(model_dir, max_length=256).load()


def test_emits_rerank_events_in_its_span(model_dir: str) -> None:
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent

    seen: List[Any] = []

    class Collect(BaseEventHandler):
        def handle(self, event: Any, **kwargs: Any) -> None:
            if isinstance(event, (ReRankStartEvent, ReRankEndEvent)):
                seen.append(event)

    handler = Collect()
    root = get_dispatcher()
    root.add_event_handler(handler)
    try:
        candidates = fused_candidates(5)
        results = make_reranker(model_dir, top_n=3).postprocess_nodes(candidates, query_bundle=QueryBundle(QUERY))
    finally:
        root.event_handlers.remove(handler)
    start, end = seen
    assert isinstance(start, ReRankStartEvent) and isinstance(end, ReRankEndEvent)
    assert start.query.query_str == QUERY and start.top_n == 3 and start.model_name == model_dir
    assert [n.node.node_id for n in start.nodes] == [c.node.node_id for c in candidates]
    assert [n.node.node_id for n in end.nodes] == [r.node.node_id for r in results]
    assert start.span_id and start.span_id == end.span_id and "CrossEncoderReranker" in start.span_id


def test_empty_input_and_missing_query(model_dir: str) -> None:
    reranker = make_reranker(model_dir)
    assert reranker.postprocess_nodes([], query_str=QUERY) == []
    assert not reranker.is_loaded  # nothing to score: the model is not even loaded
    with pytest.raises(ValueError, match="needs the query"):
        reranker.postprocess_nodes(fused_candidates(2))
    with pytest.raises(ValueError, match="the query text is blank"):  # an embedded query without its text
        reranker.postprocess_nodes(fused_candidates(2), query_bundle=QueryBundle("  ", embedding=[0.1, 0.2]))
    with pytest.raises(ValueError, match=r"nodes\[1\] is TextNode; expected NodeWithScore"):
        reranker.postprocess_nodes([fused_candidates(1)[0], TextNode(text="x")], query_str=QUERY)  # type: ignore[list-item]


def test_to_dict_round_trip_leaves_the_model_out(model_dir: str) -> None:
    reranker = make_reranker(model_dir, top_n=3, max_candidates=20, latency_budget_ms=500.0, batch_size=4).load()
    data = reranker.to_dict()
    assert data["class_name"] == "CrossEncoderReranker" and data["backend"] == "sentence_transformers"
    assert set(data) == set(CrossEncoderReranker.model_fields) - {"callback_manager"} | {"class_name"}
    assert json.loads(json.dumps(data)) == data  # plain JSON: no model, no tensors

    again = CrossEncoderReranker.from_dict(json.loads(json.dumps(data)))
    assert not again.is_loaded and again.to_dict() == data
    candidates = fused_candidates(5)
    first = reranker.postprocess_nodes(candidates, query_str=QUERY)
    second = again.postprocess_nodes(candidates, query_str=QUERY)
    assert [(r.node.node_id, r.score) for r in first] == [(r.node.node_id, pytest.approx(r2.score, abs=1e-6)) for r, r2 in zip(first, second)]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_n", 0, r"top_n must be an int >= 1, got 0 \(int\)"),
        ("top_n", "5", r"top_n must be an int >= 1, got '5' \(str\)"),
        ("batch_size", 2.0, r"batch_size must be an int >= 1, got 2.0 \(float\)"),
        ("max_candidates", 0, r"max_candidates must be None \(score all\) or an int >= 1, got 0"),
        ("max_length", 4, r"max_length must be an int >= 8 \(tokens per pair\), got 4"),
        ("latency_budget_ms", -5, r"latency_budget_ms must be None \(no budget\) or a finite number > 0, got -5"),
        ("latency_budget_ms", float("nan"), r"latency_budget_ms must be .* got nan"),
        ("device", "gpu", r"device 'gpu' is not supported; allowed: auto, cpu, cuda, cuda:<index>, mps"),
        ("backend", "onnx", r"unknown rerank backend 'onnx'; allowed: 'flag_embedding', 'sentence_transformers'"),
        ("model", "", r"model must be a local model folder or a hub name such as 'BAAI/bge-reranker-large', got ''"),
        ("model", "./no/such/folder", r"model folder './no/such/folder' does not exist"),
        ("onnx_tolerance", 0, r"onnx_tolerance must be a finite number > 0, got 0"),
    ],
)
def test_bad_knob_values_are_rejected_with_value_and_allowed(field: str, value: Any, message: str) -> None:
    kwargs = {"backend": "sentence_transformers", field: value}
    with pytest.raises(ValueError, match=message):
        CrossEncoderReranker(**kwargs)


def test_bad_combinations_and_assignments_are_rejected(model_dir: str) -> None:
    with pytest.raises(ValueError, match=r"onnx=True needs backend='sentence_transformers', got backend='flag_embedding'"):
        CrossEncoderReranker(model=model_dir, backend="flag_embedding", onnx=True)
    reranker = make_reranker(model_dir)
    with pytest.raises(ValueError, match=r"top_n must be an int >= 1, got -1"):
        reranker.top_n = -1
    assert reranker.top_n == 5


def test_changing_a_model_setting_drops_the_loaded_model(model_dir: str) -> None:
    reranker = make_reranker(model_dir).load()
    reranker.top_n = 2  # not a model setting
    assert reranker.is_loaded
    reranker.max_length = 64
    assert not reranker.is_loaded and reranker.per_pair_ms is None


def test_defaults_follow_the_design(monkeypatch: pytest.MonkeyPatch) -> None:
    if HAS_FLAG:
        reranker = CrossEncoderReranker()
        assert reranker.model == "BAAI/bge-reranker-large" and reranker.backend is RerankBackend.FLAG_EMBEDDING
        assert reranker.device == "auto" and reranker.use_fp16 is None and reranker.section_prefix
    monkeypatch.setitem(sys.modules, "FlagEmbedding", None)  # as on a core install (no 'rerank' extra)
    with pytest.raises(ImportError, match=r"needs the 'rerank' extra: pip install 'llama-index-retrieval-kit\[rerank\]'"):
        CrossEncoderReranker()


@pytest.mark.skipif(not HAS_FLAG, reason="FlagEmbedding not installed ([rerank] extra)")
def test_flag_backend_import_failure_says_how_to_install(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reranker = make_reranker(model_dir, backend="flag_embedding")
    monkeypatch.setitem(sys.modules, "FlagEmbedding", None)  # the import fails as on a machine without it
    with pytest.raises(ImportError, match=r"pip install 'llama-index-retrieval-kit\[rerank\]'"):
        reranker.load()


def test_hub_names_go_to_from_pretrained(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    asked: List[str] = []

    def from_pretrained(name: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(name)
        raise OSError(f"offline: {name}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    reranker = CrossEncoderReranker(model="BAAI/bge-reranker-base", backend="sentence_transformers", device="cpu")
    with pytest.raises(OSError, match="offline: BAAI/bge-reranker-base"):
        reranker.load()
    assert asked == ["BAAI/bge-reranker-base"]


def test_fp16_on_cpu_falls_back_to_fp32_with_a_warning(model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=rerank_module.__name__):
        reranker = make_reranker(model_dir, use_fp16=True).load()
    assert reranker.engine == "torch"
    assert "use_fp16=True is ignored on cpu" in caplog.text


def test_large_model_on_cpu_logs_the_recommendation(model_dir: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rerank_module, "LARGE_MODEL_PARAMETERS", 1000)  # the tiny model counts as large
    with caplog.at_level(logging.WARNING, logger=rerank_module.__name__):
        make_reranker(model_dir).load()
    assert "runs on CPU" in caplog.text and "docs/reranking.md" in caplog.text


def test_onnx_engine_gives_the_same_scores(model_dir: str, tmp_path: Path) -> None:
    candidates = fused_candidates(6)
    torch_results = make_reranker(model_dir, top_n=6).postprocess_nodes(candidates, query_str=QUERY)
    onnx_reranker = make_reranker(model_dir, top_n=6, onnx=True, onnx_cache_dir=str(tmp_path))
    onnx_results = onnx_reranker.postprocess_nodes(candidates, query_str=QUERY)
    assert onnx_reranker.engine == "onnx" and list((tmp_path / "onnx").glob("*/model.onnx"))
    assert [r.node.node_id for r in onnx_results] == [r.node.node_id for r in torch_results]
    assert [r.rerank_logit for r in onnx_results] == pytest.approx([r.rerank_logit for r in torch_results], abs=1e-4)


def test_a_damaged_or_stale_onnx_export_is_replaced_once(model_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cut export file, or one whose logits no longer match PyTorch, is exported again (not used,
    and not left to keep the model on PyTorch for good)."""
    make_reranker(model_dir, onnx=True, onnx_cache_dir=str(tmp_path)).load()
    (path,) = list((tmp_path / "onnx").glob("*/model.onnx"))
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 3])  # a damaged file
    with caplog.at_level(logging.WARNING, logger=rerank_module.__name__):
        reranker = make_reranker(model_dir, top_n=6, onnx=True, onnx_cache_dir=str(tmp_path)).load()
    assert reranker.engine == "onnx" and "re-exporting reranker" in caplog.text and "cannot be loaded" in caplog.text
    assert path.stat().st_size == len(good)
    candidates = fused_candidates(6)
    torch_results = make_reranker(model_dir, top_n=6).postprocess_nodes(candidates, query_str=QUERY)
    assert [r.rerank_logit for r in reranker.postprocess_nodes(candidates, query_str=QUERY)] == pytest.approx(
        [r.rerank_logit for r in torch_results], abs=1e-4
    )


def test_onnx_failure_falls_back_to_torch(model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken_export(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("export failed")

    monkeypatch.setattr(rerank_module, "export_sequence_classifier", broken_export)
    with caplog.at_level(logging.WARNING, logger=rerank_module.__name__):
        reranker = make_reranker(model_dir, onnx=True, onnx_cache_dir=str(tmp_path)).load()
    assert reranker.engine == "torch" and "RuntimeError: export failed" in caplog.text
    assert len(reranker.postprocess_nodes(fused_candidates(3), query_str=QUERY)) == 3


def test_onnx_without_the_extra_falls_back_to_torch_naming_it(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # a core install: no 'onnx' extra
    with caplog.at_level(logging.WARNING, logger=rerank_module.__name__):
        reranker = make_reranker(model_dir, onnx=True, onnx_cache_dir=str(tmp_path)).load()
    assert reranker.engine == "torch" and not list(tmp_path.rglob("*.onnx"))
    assert "onnx=True needs the 'onnx' extra: pip install 'llama-index-retrieval-kit[onnx]' (not installed: onnxruntime)" in caplog.text
    assert len(reranker.postprocess_nodes(fused_candidates(3), query_str=QUERY)) == 3


def test_works_in_a_retriever_query_engine(model_dir: str) -> None:
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine

    from llama_index_retrieval_kit.retrievers import BM25Retriever

    retriever = BM25Retriever(chunks(12), similarity_top_k=8)
    reranker = make_reranker(model_dir, top_n=3)
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM(), node_postprocessors=[reranker])
    response = engine.query("late payment fee")
    sources = response.source_nodes
    retrieved = retriever.retrieve("late payment fee")
    assert len(sources) == 3 and all(isinstance(s, RerankedNodeWithScore) for s in sources)
    assert all(0.0 < s.score < 1.0 for s in sources)
    assert [s.score for s in sources] == sorted((s.score for s in sources), reverse=True)
    by_id = {r.node.node_id: (rank, r.score) for rank, r in enumerate(retrieved, start=1)}
    assert all(by_id[s.node.node_id] == (s.pre_rerank_rank, s.pre_rerank_score) for s in sources)
