"""Ranking metrics: hand-computed answers, edge cases, argument checks, and ranx as an oracle."""

from __future__ import annotations

import copy
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_index_retrieval_kit.evaluation.metrics import (
    METRIC_NAMES,
    average_precision_at_k,
    evaluate_run,
    hit_rate_at_k,
    ndcg_at_k,
    precision_at_k,
    recall_at_k,
    reciprocal_rank_at_k,
)

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # ranx compiles with numba; stay on one core
try:
    import ranx
except ImportError:  # pragma: no cover - ranx is a dev dependency
    ranx = None

# One query: a (2), b (1), d (1) relevant (R = 3); c judged not relevant; x, y unjudged.
JUDGED = {"a": 2, "b": 1, "c": 0, "d": 1}
RANKING = ["x", "a", "c", "b", "y"]  # relevant at ranks 2 (gain 2) and 4 (gain 1)


def log2(x: float) -> float:
    return math.log2(x)


# --------------------------------------------------------------------------------------------
# Known answers (computed by hand from the definitions)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k, expected", [(1, 0.0), (2, 1 / 3), (4, 2 / 3), (10, 2 / 3)])
def test_recall_known_answers(k: int, expected: float) -> None:
    assert recall_at_k(RANKING, JUDGED, k) == pytest.approx(expected)


@pytest.mark.parametrize("k, expected", [(1, 0.0), (2, 1 / 2), (4, 2 / 4), (10, 2 / 10)])
def test_precision_known_answers_divide_by_k_even_past_the_ranking(k: int, expected: float) -> None:
    assert precision_at_k(RANKING, JUDGED, k) == pytest.approx(expected)


@pytest.mark.parametrize("k, expected", [(1, 0.0), (2, 1 / 2), (5, 1 / 2)])
def test_reciprocal_rank_known_answers(k: int, expected: float) -> None:
    assert reciprocal_rank_at_k(RANKING, JUDGED, k) == pytest.approx(expected)


@pytest.mark.parametrize("k, expected", [(1, 0.0), (2, 1.0), (10, 1.0)])
def test_hit_rate_known_answers(k: int, expected: float) -> None:
    assert hit_rate_at_k(RANKING, JUDGED, k) == expected


@pytest.mark.parametrize("k, expected", [(1, 0.0), (2, (1 / 2) / 3), (4, (1 / 2 + 2 / 4) / 3), (10, (1 / 2 + 2 / 4) / 3)])
def test_average_precision_known_answers(k: int, expected: float) -> None:
    assert average_precision_at_k(RANKING, JUDGED, k) == pytest.approx(expected)


def test_ndcg_known_answers_use_linear_gains() -> None:
    # DCG@4 = 2/log2(3) + 1/log2(5); ideal gains (2, 1, 1) -> 2/log2(2) + 1/log2(3) + 1/log2(4).
    expected = (2 / log2(3) + 1 / log2(5)) / (2 + 1 / log2(3) + 1 / log2(4))
    assert ndcg_at_k(RANKING, JUDGED, 4) == pytest.approx(expected, abs=1e-12)
    assert ndcg_at_k(RANKING, JUDGED, 4) == pytest.approx(0.5405857679450102, abs=1e-12)
    # Exponential gains (2^rel - 1) would give (3/log2(3) + 1/log2(5)) / (3 + 1/log2(3) + 1/2) instead.
    assert ndcg_at_k(RANKING, JUDGED, 4) != pytest.approx((3 / log2(3) + 1 / log2(5)) / (3 + 1 / log2(3) + 0.5))
    # At k=2 the ideal is cut at 2 as well: (2/log2(3)) / (2 + 1/log2(3)).
    assert ndcg_at_k(RANKING, JUDGED, 2) == pytest.approx((2 / log2(3)) / (2 + 1 / log2(3)), abs=1e-12)


def test_ndcg_ideal_counts_relevant_docs_that_were_not_retrieved() -> None:
    assert ndcg_at_k(["b"], JUDGED, 1) == pytest.approx(1 / 2)  # ideal rank 1 holds gain 2
    assert ndcg_at_k(["a", "b", "d"], JUDGED, 3) == pytest.approx(1.0)
    assert ndcg_at_k(["a", "d", "b", "c"], JUDGED, 10) == pytest.approx(1.0)


def test_map_divides_by_all_relevant_docs_not_by_k() -> None:
    assert average_precision_at_k(["a"], JUDGED, 1) == pytest.approx(1 / 3)
    assert recall_at_k(["a"], JUDGED, 1) == pytest.approx(1 / 3)


def test_reciprocal_rank_is_cut_at_k() -> None:
    assert reciprocal_rank_at_k(["x", "y", "a"], JUDGED, 2) == 0.0
    assert reciprocal_rank_at_k(["x", "y", "a"], JUDGED, 3) == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "metric", [recall_at_k, precision_at_k, reciprocal_rank_at_k, ndcg_at_k, hit_rate_at_k, average_precision_at_k]
)
def test_empty_ranking_is_a_miss(metric) -> None:
    assert metric([], JUDGED, 5) == 0.0


@pytest.mark.parametrize(
    "metric", [recall_at_k, precision_at_k, reciprocal_rank_at_k, ndcg_at_k, hit_rate_at_k, average_precision_at_k]
)
def test_query_without_relevant_docs_scores_zero_per_query(metric) -> None:
    assert metric(["c", "x"], {"c": 0}, 5) == 0.0
    assert metric(["c", "x"], {}, 5) == 0.0


def test_scored_pairs_give_the_same_values_and_scores_do_not_reorder() -> None:
    pairs = [("x", 0.1), ("a", 0.2), ("c", 0.3), ("b", 0.4), ("y", 0.5)]  # increasing scores on purpose
    for k in (1, 2, 4, 10):
        assert ndcg_at_k(pairs, JUDGED, k) == ndcg_at_k(RANKING, JUDGED, k)
        assert average_precision_at_k(pairs, JUDGED, k) == average_precision_at_k(RANKING, JUDGED, k)


# --------------------------------------------------------------------------------------------
# evaluate_run
# --------------------------------------------------------------------------------------------


def test_evaluate_run_per_query_and_means() -> None:
    run = {"q1": RANKING, "q2": [("a", 3.0), ("b", 2.0)]}
    qrels = {"q1": JUDGED, "q2": {"a": 1}}
    result = evaluate_run(run, qrels, metrics=("recall", "mrr"), ks=(1, 4))
    assert list(result.per_query["q1"]) == ["recall@1", "recall@4", "mrr@1", "mrr@4"]
    assert result.per_query["q1"]["recall@4"] == pytest.approx(2 / 3)
    assert result.per_query["q2"] == {"recall@1": 1.0, "recall@4": 1.0, "mrr@1": 1.0, "mrr@4": 1.0}
    assert result.mean["recall@4"] == pytest.approx((2 / 3 + 1) / 2)
    assert result.mean["mrr@1"] == pytest.approx(0.5)
    assert result.num_queries == 2
    assert result.skipped == () and result.missing == ()


def test_evaluate_run_defaults_cover_all_metrics_and_cutoffs() -> None:
    result = evaluate_run({"q1": RANKING}, {"q1": JUDGED})
    assert set(result.mean) == {f"{m}@{k}" for m in METRIC_NAMES for k in (1, 5, 10, 100)}
    assert result.mean["precision@100"] == pytest.approx(2 / 100)


def test_evaluate_run_accepts_a_single_metric_name_and_cutoff() -> None:
    result = evaluate_run({"q1": RANKING}, {"q1": JUDGED}, metrics="ndcg", ks=4)
    assert result.mean == {"ndcg@4": pytest.approx(0.5405857679450102)}


def test_queries_without_relevant_docs_are_skipped_by_default() -> None:
    run = {"q1": ["a"], "q2": ["c"], "q3": ["a"]}
    qrels = {"q1": {"a": 1}, "q2": {"c": 0}, "q3": {}}
    result = evaluate_run(run, qrels, metrics=("recall",), ks=(1,))
    assert result.skipped == ("q2", "q3")
    assert set(result.per_query) == {"q1"}
    assert result.mean == {"recall@1": 1.0}


def test_queries_without_relevant_docs_count_as_zero_on_request() -> None:
    run = {"q1": ["a"], "q2": ["c"]}
    qrels = {"q1": {"a": 1}, "q2": {"c": 0}}
    result = evaluate_run(run, qrels, metrics=("recall", "ndcg"), ks=(1,), no_relevant="zero")
    assert result.skipped == ()
    assert result.per_query["q2"] == {"recall@1": 0.0, "ndcg@1": 0.0}
    assert result.mean == {"recall@1": 0.5, "ndcg@1": 0.5}


def test_judged_query_missing_from_run_is_an_empty_retrieval() -> None:
    result = evaluate_run({"q1": ["a"]}, {"q1": {"a": 1}, "q2": {"a": 1}}, metrics=("hit_rate",), ks=(1,))
    assert result.missing == ("q2",)
    assert result.per_query["q2"] == {"hit_rate@1": 0.0}
    assert result.mean == {"hit_rate@1": 0.5}


def test_unjudged_run_queries_are_ignored() -> None:
    result = evaluate_run({"q1": ["a"], "extra": ["a"]}, {"q1": {"a": 1}}, metrics=("hit_rate",), ks=(1,))
    assert set(result.per_query) == {"q1"}


def test_nothing_to_evaluate_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing to evaluate"):
        evaluate_run({"q1": ["a"]}, {"q1": {"a": 0}})
    with pytest.raises(ValueError, match="nothing to evaluate"):
        evaluate_run({"q1": ["a"]}, {})


def test_evaluate_run_does_not_modify_its_inputs() -> None:
    run = {"q1": [("x", 0.9), ("a", 0.5)], "q2": ["b", "a"], "extra": ["a"]}
    qrels = {"q1": {"a": 2, "c": 0}, "q2": {"b": 1}, "q3": {"a": 1}, "q4": {"c": 0}}
    run_before, qrels_before = copy.deepcopy(run), copy.deepcopy(qrels)
    evaluate_run(run, qrels)
    evaluate_run(run, qrels, no_relevant="zero")
    assert run == run_before and qrels == qrels_before


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -1, 1.5, "5", True, None])
def test_bad_k_is_rejected(k: object) -> None:
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        recall_at_k(RANKING, JUDGED, k)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        evaluate_run({"q": RANKING}, {"q": JUDGED}, ks=(5, k))  # type: ignore[arg-type]


@pytest.mark.parametrize("relevance", [-1, 1.0, "1", True, None])
def test_bad_relevance_is_rejected(relevance: object) -> None:
    with pytest.raises(ValueError, match=r"qrels\['q'\]\['a'\] must be an int >= 0"):
        evaluate_run({"q": ["a"]}, {"q": {"a": relevance}})  # type: ignore[dict-item]


def test_duplicate_doc_in_ranking_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"run\['q'\] lists doc id 'a' twice \(ranks 1 and 3\)"):
        evaluate_run({"q": ["a", "b", "a"]}, {"q": {"a": 1}})


@pytest.mark.parametrize(
    "ranking, message",
    [
        ({"a": 1.0}, "a dict has no rank order"),
        ({"a", "b"}, "must be a list of doc ids"),
        ("ab", "must be a list of doc ids"),
        ([1, 2], r"\[0\] must be a doc id"),
        ([("a", "high")], r"\[0\] must be a doc id"),
        ([("a", 1.0, "x")], r"\[0\] must be a doc id"),
        (["a", ("b", 1.0)], "mixes bare doc ids and"),
    ],
)
def test_malformed_rankings_are_rejected(ranking: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ndcg_at_k(ranking, JUDGED, 5)  # type: ignore[arg-type]


def test_bad_metric_and_policy_names_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"unknown metric 'ndcg_cut'; choose from \('ndcg'"):
        evaluate_run({"q": ["a"]}, {"q": {"a": 1}}, metrics=("ndcg_cut",))
    with pytest.raises(ValueError, match="metrics is empty"):
        evaluate_run({"q": ["a"]}, {"q": {"a": 1}}, metrics=())
    with pytest.raises(ValueError, match="ks is empty"):
        evaluate_run({"q": ["a"]}, {"q": {"a": 1}}, ks=())
    with pytest.raises(ValueError, match=r"no_relevant must be one of \('skip', 'zero'\), got 'drop'"):
        evaluate_run({"q": ["a"]}, {"q": {"a": 1}}, no_relevant="drop")


def test_run_and_qrels_must_be_dicts() -> None:
    with pytest.raises(ValueError, match="run must be a dict"):
        evaluate_run([["a"]], {"q": {"a": 1}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="qrels must be a dict"):
        evaluate_run({"q": ["a"]}, [("q", "a", 1)])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Oracle: ranx (same conventions as trec_eval for these metrics, see module docstring)
# --------------------------------------------------------------------------------------------

DOC_IDS = [f"d{i}" for i in range(30)]


@st.composite
def runs_and_qrels(draw: st.DrawFn) -> tuple[dict[str, list[str]], dict[str, dict[str, int]], list[int]]:
    """Random judged queries (graded 0-2, some without a relevant doc), rankings and cutoffs."""
    qrels: dict[str, dict[str, int]] = {}
    run: dict[str, list[str]] = {}
    for index in range(draw(st.integers(1, 8))):
        query_id = f"q{index}"
        qrels[query_id] = draw(st.dictionaries(st.sampled_from(DOC_IDS), st.integers(0, 2), min_size=1, max_size=12))
        if index == 0:  # ranx needs one non-empty ranking
            run[query_id] = draw(st.lists(st.sampled_from(DOC_IDS), unique=True, min_size=1, max_size=25))
        elif draw(st.booleans()):  # the other judged queries may be missing from the run or empty
            run[query_id] = draw(st.lists(st.sampled_from(DOC_IDS), unique=True, max_size=25))
    if draw(st.booleans()):
        run["unjudged"] = draw(st.lists(st.sampled_from(DOC_IDS), unique=True, max_size=5))
    ks = draw(st.lists(st.integers(1, 20), min_size=1, max_size=3, unique=True))
    return run, qrels, ks


def ranx_per_query(
    run: dict[str, list[str]], qrels: dict[str, dict[str, int]], keys: list[str]
) -> dict[str, dict[str, float]]:
    """ranx's value of every metric key for every judged query (one batched ranx call)."""
    ranx_qrels = ranx.Qrels(copy.deepcopy(qrels))
    # Strictly decreasing scores fix ranx's order to the given one; empty rankings are left out
    # and come back as empty results through make_comparable (like judged queries missing from run).
    ranx_run = ranx.Run(
        {
            query_id: {doc_id: float(len(ids) - rank) for rank, doc_id in enumerate(ids)}
            for query_id, ids in run.items()
            if ids
        }
    )
    scores = ranx.evaluate(
        ranx_qrels, ranx_run, keys, return_mean=False, threads=1, make_comparable=True, save_results_in_run=False
    )
    query_ids = list(ranx_run.get_query_ids())
    assert query_ids == list(ranx_qrels.get_query_ids())
    return {query_id: {key: float(scores[key][i]) for key in keys} for i, query_id in enumerate(query_ids)}


@pytest.mark.skipif(ranx is None, reason="ranx is not installed")
@pytest.mark.filterwarnings("ignore:unsafe cast")
@settings(max_examples=60, deadline=None, database=None)
@given(case=runs_and_qrels())
def test_every_metric_matches_ranx(case: tuple[dict[str, list[str]], dict[str, dict[str, int]], list[int]]) -> None:
    run, qrels, ks = case
    keys = [f"{metric}@{k}" for metric in METRIC_NAMES for k in ks]
    expected = ranx_per_query(run, qrels, keys)

    # no_relevant="zero" is exactly ranx's (and trec_eval's) query set.
    zero = evaluate_run(run, qrels, METRIC_NAMES, ks, no_relevant="zero")
    assert set(zero.per_query) == set(expected)
    for query_id, values in expected.items():
        for key, value in values.items():
            assert zero.per_query[query_id][key] == pytest.approx(value, abs=1e-9), (query_id, key)
    for key in keys:
        assert zero.mean[key] == pytest.approx(math.fsum(v[key] for v in expected.values()) / len(expected), abs=1e-9)

    # The default leaves out queries without a relevant doc; the others keep ranx's values.
    answerable = [q for q, judged in qrels.items() if any(value > 0 for value in judged.values())]
    if not answerable:
        with pytest.raises(ValueError, match="nothing to evaluate"):
            evaluate_run(run, qrels, METRIC_NAMES, ks)
        return
    skip = evaluate_run(run, qrels, METRIC_NAMES, ks)
    assert list(skip.per_query) == answerable
    for key in keys:
        expected_mean = math.fsum(expected[q][key] for q in answerable) / len(answerable)
        assert skip.mean[key] == pytest.approx(expected_mean, abs=1e-9), key
