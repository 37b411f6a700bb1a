"""CrossEncoderReranker under concurrent queries, with repeated node ids, long passages, and the cost estimate.

Real tiny cross-encoders (random weights) through both backends; LlamaIndex's own query engine for
``aquery``; simulated timings only (no timed tests).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index_retrieval_kit.postprocessor import rerank as rerank_module
from llama_index_retrieval_kit.postprocessor.rerank import (
    CallCostEstimate,
    cap_candidates,
    count_truncated,
    first_occurrences,
    fit_call_cost,
    reranked_results,
    truncation_warning,
    update_call_cost,
)

from ._cross_encoder_folder import build_tiny_cross_encoder
from .test_rerank import BACKENDS, HAS_FLAG, QUERY, PairCounter, make_reranker

WORDS = "fee payment card interest statement dispute charge account annual limit credit balance".split()
QUERIES = [" ".join(WORDS[k : k + 1 + k % 4]) * (1 + k % 3) for k in range(12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_cross_encoder(tmp_path_factory.mktemp("tiny_cross_encoder_safety")))


def varied_candidates(n: int = 24) -> List[NodeWithScore]:
    """Passages of 90 to 129 one-token words: some fit in max_length=128 tokens with the query, some do not,
    and each is longer than the 96 tokens FlagEmbedding allows a query (so mixing the two settings shows)."""
    texts = [" ".join(WORDS[(i * j) % len(WORDS)] for j in range(90 + (i * 13) % 40)) for i in range(n)]
    return [NodeWithScore(node=TextNode(id_=f"n{i}", text=text), score=1.0) for i, text in enumerate(texts)]


def logits_by_id(results: List[Any]) -> Dict[str, float]:
    return {r.node.node_id: r.rerank_logit for r in results}


# ------------------------------------------------------------------------------ F1: concurrent queries
@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_queries_in_threads_get_their_serial_results(model_dir: str, backend: str) -> None:
    candidates = varied_candidates()
    reranker = make_reranker(model_dir, backend=backend, top_n=len(candidates), batch_size=2).load()
    serial = {q: logits_by_id(reranker.postprocess_nodes(candidates, query_str=q)) for q in QUERIES}

    def rerank(query: str) -> Dict[str, float]:
        return logits_by_id(reranker.postprocess_nodes(candidates, query_str=query))

    with ThreadPoolExecutor(6) as pool:  # an exception in a thread (FlagEmbedding's "Truncation error") fails here
        concurrent = list(pool.map(rerank, QUERIES * 3))
    for query, got in zip(QUERIES * 3, concurrent):
        assert got.keys() == serial[query].keys()
        assert all(got[k] == pytest.approx(serial[query][k], abs=1e-5) for k in got), query


@pytest.mark.skipif(not HAS_FLAG, reason="FlagEmbedding not installed ([rerank] extra)")
def test_flag_embedding_calls_never_overlap(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """FlagReranker.compute_score changes its tokenizer's shared truncation settings on every call:
    the reranker must not enter it from two threads at once."""
    from FlagEmbedding import FlagReranker

    reranker = make_reranker(model_dir, backend="flag_embedding", top_n=3, batch_size=4).load()
    original = FlagReranker.compute_score
    inside, most_inside, guard = [0], [0], threading.Lock()

    def compute_score(self: Any, *args: Any, **kwargs: Any) -> Any:
        with guard:
            inside[0] += 1
            most_inside[0] = max(most_inside[0], inside[0])
        try:
            time.sleep(0.05)  # keep the call open so that an unserialized second caller would overlap it
            return original(self, *args, **kwargs)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(FlagReranker, "compute_score", compute_score)
    candidates = varied_candidates(6)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda q: reranker.postprocess_nodes(candidates, query_str=q), QUERIES))
    assert all(len(r) == 3 for r in results)
    assert most_inside[0] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_gathered_aquery_in_a_query_engine_gets_the_serial_results(model_dir: str, backend: str) -> None:
    """LlamaIndex runs a sync postprocessor in a thread for aquery: asyncio.gather is concurrent use."""
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine

    from llama_index_retrieval_kit.retrievers import BM25Retriever

    nodes = [c.node for c in varied_candidates(30)]
    reranker = make_reranker(model_dir, backend=backend, top_n=8, batch_size=2)
    engine = RetrieverQueryEngine.from_args(BM25Retriever(nodes, similarity_top_k=20), llm=MockLLM(max_tokens=4), node_postprocessors=[reranker])
    serial = {q: [(s.node.node_id, s.rerank_logit) for s in engine.query(q).source_nodes] for q in QUERIES}

    async def gathered() -> List[Any]:
        return await asyncio.gather(*(engine.aquery(q) for q in QUERIES * 4))

    for query, response in zip(QUERIES * 4, asyncio.run(gathered())):
        got = [(s.node.node_id, s.rerank_logit) for s in response.source_nodes]
        assert [i for i, _ in got] == [i for i, _ in serial[query]], query
        assert [z for _, z in got] == pytest.approx([z for _, z in serial[query]], abs=1e-5), query


# ------------------------------------------------------------------------------ F9: repeated node ids
@given(st.lists(st.sampled_from("abcdef"), max_size=30))
def test_first_occurrences_keeps_each_node_id_once_at_its_first_position(ids: List[str]) -> None:
    results = [NodeWithScore(node=TextNode(id_=i, text=i), score=None) for i in ids]
    positions = first_occurrences(results)
    assert positions == sorted(positions)
    assert [ids[p] for p in positions] == list(dict.fromkeys(ids))  # every id once, in first-seen order
    assert all(ids.index(ids[p]) == p for p in positions)


def test_repeated_node_ids_are_scored_and_returned_once(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n1, n2, n3 = (NodeWithScore(node=TextNode(id_=f"n{i}", text=f"Clause {i}: the late fee is ${10 * i}."), score=1.0 - i / 10) for i in (1, 2, 3))
    repeated = [n1, NodeWithScore(node=n1.node, score=0.05), n2, n2, n3]
    reranker = make_reranker(model_dir, top_n=3).load()
    alone = reranker.postprocess_nodes([n1, n2, n3], query_str=QUERY)

    counter = PairCounter(monkeypatch)
    results = reranker.postprocess_nodes(repeated, query_str=QUERY)
    assert sorted(r.node.node_id for r in results) == ["n1", "n2", "n3"] and counter.pairs == 3
    assert [(r.node.node_id, r.rerank_logit) for r in results] == [(r.node.node_id, pytest.approx(r.rerank_logit, abs=1e-6)) for r in alone]
    by_id = {r.node.node_id: r for r in results}
    assert (by_id["n1"].pre_rerank_rank, by_id["n1"].pre_rerank_score) == (1, n1.score)  # the first occurrence
    assert (by_id["n2"].pre_rerank_rank, by_id["n3"].pre_rerank_rank) == (3, 5)  # positions in the caller's list
    stats = reranker.last_stats
    assert (stats.candidates, stats.duplicates_dropped, stats.capped_to, stats.scored, stats.returned) == (5, 2, 3, 3, 3)
    assert [c.node.node_id for c in repeated] == ["n1", "n1", "n2", "n2", "n3"] and repeated[1].score == 0.05  # not changed

    counter.calls.clear()
    reranker.max_candidates = 2  # counts distinct results
    reranker.postprocess_nodes(repeated, query_str=QUERY)
    assert [passage.split(":")[0] for _, passage in counter.calls[0]] == ["Clause 1", "Clause 2"]
    assert (reranker.last_stats.capped_to, reranker.last_stats.duplicates_dropped) == (2, 2)


def test_reranked_results_takes_the_callers_ranks() -> None:
    nodes = [NodeWithScore(node=TextNode(id_=i, text=i), score=0.5) for i in "abc"]
    results = reranked_results(nodes, [0.1, 0.9, 0.5], top_n=3, input_ranks=[1, 4, 6])
    assert [(r.node.node_id, r.pre_rerank_rank) for r in results] == [("b", 4), ("c", 6), ("a", 1)]
    assert [r.pre_rerank_rank for r in reranked_results(nodes, [0.1, 0.9, 0.5], top_n=3)] == [2, 3, 1]
    with pytest.raises(ValueError, match="input_ranks has 2 entries for 3 scored candidates"):
        reranked_results(nodes, [0.1, 0.9, 0.5], top_n=3, input_ranks=[1, 2])


# ------------------------------------------------------------------------------ F10: long passages
def test_count_truncated_counts_pairs_over_max_length_or_cut_by_characters() -> None:
    assert count_truncated([10, 24, 25, 300], 24) == 2
    assert count_truncated([10, 24, 25], 24, [True, False, False]) == 2
    assert count_truncated([], 24) == 0


def test_truncation_warning_says_what_to_do() -> None:
    message = truncation_warning("m", 3, 40, 256, 512)
    assert "3 of 40 (query, passage) pairs are longer than max_length=256 tokens" in message
    assert "raise max_length (this model reads up to 512) or split documents into smaller chunks" in message
    assert "max_length is this model's limit, so split documents into smaller chunks" in truncation_warning("m", 1, 5, 512, 512)
    assert "raise max_length or split" in truncation_warning("m", 1, 5, 512, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pair_one_token_too_long_is_counted_and_read_like_its_cut_version(model_dir: str, backend: str) -> None:
    from transformers import AutoTokenizer

    max_length = 32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    query_tokens = len(tokenizer(QUERY, add_special_tokens=False)["input_ids"])
    assert len(tokenizer("fee " * 7, add_special_tokens=False)["input_ids"]) == 7  # one token per word
    fitting = "fee " * (max_length - query_tokens - 3)  # [CLS] query [SEP] passage [SEP] = max_length tokens
    candidates = [NodeWithScore(node=TextNode(id_=i, text=t), score=1.0) for i, t in (("fits", fitting), ("over", fitting + "fee"))]
    reranker = make_reranker(model_dir, backend=backend, top_n=2, max_length=max_length, section_prefix=False)

    by_id = logits_by_id(reranker.postprocess_nodes(candidates, query_str=QUERY))
    assert reranker.last_stats.truncated == 1
    assert by_id["over"] == pytest.approx(by_id["fits"], abs=1e-5)  # the model did not read the last word
    reranker.postprocess_nodes(candidates[:1], query_str=QUERY)
    assert reranker.last_stats.truncated == 0


def test_truncation_is_logged_once_per_reranker_with_what_to_do(model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    filler = "The cardholder agreement describes the account terms in general. " * 20  # ~220 tokens
    answer = "The late payment fee is $40 per missed payment."
    candidates = [
        NodeWithScore(node=TextNode(id_="answer_at_end", text=filler + answer), score=1.0),
        NodeWithScore(node=TextNode(id_="short", text=answer), score=1.0),
        NodeWithScore(node=TextNode(id_="one_long_word", text="x" * 5000), score=1.0),  # cut by characters
    ]
    reranker = make_reranker(model_dir, top_n=3, max_length=64)
    with caplog.at_level(logging.INFO, logger=rerank_module.__name__):
        reranker.postprocess_nodes(candidates, query_str=QUERY)
        assert reranker.last_stats.truncated == 2
        reranker.postprocess_nodes(candidates, query_str=QUERY)
        assert reranker.last_stats.truncated == 2  # counted on every call...
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "max_length=64" in r.getMessage()]
    assert len(warnings) == 1  # ...logged once
    message = warnings[0].getMessage()
    assert "2 of 3" in message and "raise max_length (this model reads up to 128) or split documents into smaller chunks" in message

    caplog.clear()
    other = make_reranker(model_dir, top_n=3, max_length=64)  # the once is per reranker
    with caplog.at_level(logging.WARNING, logger=rerank_module.__name__):
        other.postprocess_nodes(candidates[1:2], query_str=QUERY)
        other.postprocess_nodes(candidates, query_str=QUERY)
    assert other.last_stats.truncated == 2 and caplog.text.count("tokens; the model read only their start") == 1


# ------------------------------------------------------------------------------ F11: cost estimate
def run_calls(sizes: List[int], fixed_ms: float, pair_ms: float, prior_ms: float = 0.0) -> CallCostEstimate:
    estimate = None
    for n in sizes:
        estimate = update_call_cost(estimate, n, fixed_ms + n * pair_ms, fixed_prior_ms=prior_ms)
    assert estimate is not None
    return estimate


@settings(max_examples=200)
@given(
    fixed_ms=st.floats(0.0, 200.0),
    pair_ms=st.floats(0.01, 50.0),
    first=st.integers(1, 50),
    factor=st.integers(2, 10),
    later=st.lists(st.integers(1, 200), max_size=40),
    prior_ms=st.floats(0.0, 300.0),
)
def test_two_call_sizes_separate_the_fixed_cost_from_the_per_pair_cost(
    fixed_ms: float, pair_ms: float, first: int, factor: int, later: List[int], prior_ms: float
) -> None:
    """Exact synthetic timings: after calls of two sizes the estimate is the true line, and stays it."""
    estimate = run_calls([first, first * factor] + later, fixed_ms, pair_ms, prior_ms)
    assert estimate.fixed_ms == pytest.approx(fixed_ms, rel=1e-6, abs=1e-6)
    assert estimate.per_pair_ms == pytest.approx(pair_ms, rel=1e-6)
    budget = fixed_ms + 37.5 * pair_ms
    assert cap_candidates(1000, estimate.per_pair_ms, budget, fixed_ms=estimate.fixed_ms) in (37, 36)  # 36: rounding at .5


def test_one_call_size_keeps_the_measured_fixed_cost() -> None:
    # Only calls of 16 pairs at 8 + 16 * 0.5 = 16 ms: the fixed part is the one measured at load.
    estimate = run_calls([16] * 5, fixed_ms=8.0, pair_ms=0.5, prior_ms=8.0)
    assert (estimate.fixed_ms, estimate.per_pair_ms) == (pytest.approx(8.0), pytest.approx(0.5))
    # without a prior (or one not below the call time) it is the per-call average, as before
    assert run_calls([16], 8.0, 0.5).per_pair_ms == pytest.approx(1.0)
    assert run_calls([16], 8.0, 0.5, prior_ms=20.0).fixed_ms == 0.0
    # the per-call average over-estimates a pair: a 30 ms budget fits 44 pairs, not 30 / (16 ms / 16)
    fitted = run_calls([3, 26], 8.0, 0.5)
    assert cap_candidates(100, fitted.per_pair_ms, 30.2, fixed_ms=fitted.fixed_ms) == 44
    assert cap_candidates(100, 16.0 / 16, 30.2) == 30


def test_noisy_or_degenerate_fits_stay_usable() -> None:
    # larger calls measured faster (noise): no slope; the fixed part stays, the rest is per pair
    fixed, per_pair = fit_call_cost(2.0, 30.0, 500.0, 30.0, 400.0, fixed_before=5.0)
    assert (fixed, per_pair) == (5.0, pytest.approx((15.0 - 5.0) / 15.0))
    # a negative intercept: no fixed cost, the line through the origin
    estimate = run_calls([10, 30], fixed_ms=-3.0, pair_ms=1.0)
    assert estimate.fixed_ms == 0.0 and estimate.per_pair_ms == pytest.approx((10 * 7 * 0.7 + 30 * 27) / (100 * 0.7 + 900))
    # zero-time calls still give a positive per-pair cost (cap_candidates needs one)
    assert run_calls([4, 8], 0.0, 0.0).per_pair_ms == rerank_module.MIN_PER_PAIR_MS
    assert CallCostEstimate(fixed_ms=2.0, per_pair_ms=0.25).call_ms(8) == 4.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(previous=None, pairs=0, elapsed_ms=1.0), r"pairs must be an int >= 1, got 0"),
        (dict(previous=None, pairs=True, elapsed_ms=1.0), r"pairs must be an int >= 1, got True"),
        (dict(previous=None, pairs=2, elapsed_ms=float("nan")), r"elapsed_ms must be a finite number >= 0, got nan"),
        (dict(previous=None, pairs=2, elapsed_ms=1.0, weight=0.0), r"weight must be in \(0, 1\], got 0.0"),
    ],
)
def test_update_call_cost_rejects_bad_measurements(kwargs: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        update_call_cost(**kwargs)


def test_cap_candidates_subtracts_the_fixed_cost() -> None:
    assert cap_candidates(100, per_pair_ms=0.5, budget_ms=30.2, fixed_ms=8.0) == 44
    assert cap_candidates(100, per_pair_ms=0.5, budget_ms=7.0, fixed_ms=8.0, minimum=3) == 3
    with pytest.raises(ValueError, match=r"fixed_ms must be a finite number >= 0, got -1.0"):
        cap_candidates(10, 1.0, 10.0, fixed_ms=-1.0)


def test_loading_warms_up_and_measures_the_fixed_cost_outside_the_estimate(model_dir: str) -> None:
    reranker = make_reranker(model_dir, top_n=2).load()
    assert reranker.per_pair_ms is None and reranker.fixed_call_ms is None  # warm-up passes are not measurements
    reranker.postprocess_nodes(varied_candidates(4), query_str=QUERY)
    stats = reranker.last_stats
    assert stats.per_pair_ms is not None and stats.per_pair_ms > 0 and stats.fixed_call_ms is not None and stats.fixed_call_ms >= 0
    assert (stats.per_pair_ms, stats.fixed_call_ms) == (reranker.per_pair_ms, reranker.fixed_call_ms)
    reranker.max_length = 64  # a model setting: the model and its estimate go
    assert reranker.per_pair_ms is None and reranker.fixed_call_ms is None


# ------------------------------------------------------------------------------ stats per query, copies
def test_each_gathered_query_reads_and_traces_its_own_stats(model_dir: str) -> None:
    """``last_stats`` and the trace's rerank record belong to the query that made the call, not to
    whichever concurrent call finished last: queries with 2 to 13 distinct candidates, gathered."""
    from llama_index_retrieval_kit.tracing import collect_traces

    reranker = make_reranker(model_dir, top_n=1, batch_size=2).load()
    pools = {f"q{k}": varied_candidates(2 + k) for k in range(12)}

    async def one(query: str) -> Any:
        await reranker.apostprocess_nodes(pools[query], query_str=query)
        await asyncio.sleep(0)  # let the other queries finish theirs first
        return query, reranker.last_stats

    async def gathered() -> List[Any]:
        return await asyncio.gather(*(one(q) for q in pools))

    with collect_traces() as collector:
        seen = asyncio.run(gathered())
    assert {q: stats.candidates for q, stats in seen} == {q: len(pool) for q, pool in pools.items()}
    traced = {t.query_str: t.stage("rerank").attributes["scored"] for t in collector.traces}
    assert traced == {q: len(pool) for q, pool in pools.items()}

    with ThreadPoolExecutor(4) as pool:
        def in_thread(query: str) -> int:
            reranker.postprocess_nodes(pools[query], query_str=query)
            time.sleep(0.01)
            return reranker.last_stats.candidates
        assert list(pool.map(in_thread, list(pools) * 2)) == [len(pools[q]) for q in list(pools) * 2]


def test_a_used_reranker_deep_copies_and_pickles_like_a_new_one(model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    import copy
    import pickle

    reranker = make_reranker(model_dir, top_n=3).load()
    candidates = varied_candidates(6)
    first = logits_by_id(reranker.postprocess_nodes(candidates, query_str=QUERIES[0]))
    twin = copy.deepcopy(reranker)  # a lock in the state made this raise TypeError
    assert twin.to_dict() == reranker.to_dict() and twin.is_loaded  # the loaded model is shared, not copied
    assert twin.last_stats is None
    assert logits_by_id(twin.postprocess_nodes(candidates, query_str=QUERIES[0])) == pytest.approx(first)
    with caplog.at_level(logging.WARNING):
        restored = pickle.loads(pickle.dumps(reranker))
    assert "unpickleable" not in caplog.text  # LlamaIndex warned for each lock and context variable
    assert restored.to_dict() == reranker.to_dict()
