"""Report pieces on synthetic results: paired tests, tables, per-query rows, plots (no models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llama_index_retrieval_kit.evaluation import RetrievalDataset, score_retrievals
from llama_index_retrieval_kit.evaluation.evaluate import Retrieval, RetrieverEvaluation
from llama_index_retrieval_kit.evaluation.report import (
    DELTA_PLOT_SIZE,
    METRICS_PLOT_SIZE,
    best_configs,
    comparison_table,
    compared_metrics,
    main_k,
    paired_tests,
    per_query_rows,
    plot_deltas,
    plot_metrics_vs_k,
    safe_name,
    significance_tests,
)

KS = (1, 3, 10)


def dataset() -> RetrievalDataset:
    """Eight questions with one relevant doc each, plus one no-answer question."""
    queries = {f"q{i}": f"question {i}" for i in range(8)}
    queries["none"] = "a question the documents do not answer"
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(8)}
    return RetrievalDataset(queries=queries, qrels=qrels, name="synthetic")


def run_with_rank(rank_of: dict[str, int]) -> dict[str, Retrieval]:
    """Retrievals that put query i's relevant doc at ``rank_of[qid]`` (0 = not retrieved)."""
    out = {}
    for qid in dataset().queries:
        docs = [f"x{j}" for j in range(5)]
        rank = rank_of.get(qid, 0)
        if rank and qid != "none":
            docs.insert(rank - 1, f"d{qid[1:]}")
        out[qid] = Retrieval(qid, tuple(f"n-{d}" for d in docs), tuple(1.0 / (j + 1) for j in range(len(docs))), tuple(docs), (), 0.001)
    return out


def evaluations() -> dict[str, RetrieverEvaluation]:
    ds = dataset()
    good = score_retrievals(run_with_rank({f"q{i}": 1 for i in range(8)}), ds, ks=KS, relevance="doc")
    mixed = score_retrievals(run_with_rank({f"q{i}": (1 if i < 4 else 3) for i in range(8)}), ds, ks=KS, relevance="doc")
    same = score_retrievals(run_with_rank({f"q{i}": 1 for i in range(8)}), ds, ks=KS, relevance="doc")
    return {"good": good, "mixed": mixed, "same-as-good": same}


def test_paired_tests_all_zero_differences_give_p_one() -> None:
    result = paired_tests([0.5, 1.0, 0.0], [0.5, 1.0, 0.0])
    assert result["wilcoxon_p"] == 1.0 and result["permutation_p"] == 1.0
    assert result["note"] == "all differences are zero" and result["ties"] == 3
    empty = paired_tests([], [])
    assert empty["n"] == 0 and empty["permutation_p"] == 1.0


def test_paired_tests_detect_a_consistent_difference_and_are_symmetric() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0.2, 0.6, size=40)
    b = a + rng.uniform(0.05, 0.3, size=40)
    forward, backward = paired_tests(a, b), paired_tests(b, a)
    assert forward["mean_diff"] > 0 and forward["wins"] == 40
    assert forward["wilcoxon_p"] < 1e-6 and forward["permutation_p"] < 1e-3
    assert backward["mean_diff"] == pytest.approx(-forward["mean_diff"])
    assert backward["wilcoxon_p"] == pytest.approx(forward["wilcoxon_p"])
    noise = paired_tests(a, a + rng.normal(0, 0.05, size=40))
    assert noise["permutation_p"] > 0.01


def test_paired_tests_exact_sign_flips_for_few_queries() -> None:
    # 4 queries, all better by 1: of the 16 sign patterns only 2 reach |mean| = 1, so p = 2/16.
    result = paired_tests([0, 0, 0, 0], [1, 1, 1, 1])
    assert result["permutation_p"] == pytest.approx(2 / 16)
    assert result["note"].startswith("only 4 non-zero")
    with pytest.raises(ValueError, match="same length"):
        paired_tests([1, 2], [1])


def test_significance_tests_cover_every_pair_and_metric() -> None:
    evs = evaluations()
    rows = significance_tests(evs, compared_metrics(KS))
    assert compared_metrics(KS) == ["ndcg@10", "mrr@10", "recall@10"]
    assert {(r["a"], r["b"]) for r in rows} == {("good", "mixed"), ("good", "same-as-good"), ("mixed", "same-as-good")}
    identical = [r for r in rows if r["a"] == "good" and r["b"] == "same-as-good"]
    assert all(r["wilcoxon_p"] == 1.0 and r["note"] == "all differences are zero" for r in identical)
    worse = next(r for r in rows if (r["a"], r["b"], r["metric"]) == ("good", "mixed", "mrr@10"))
    assert worse["mean_diff"] == pytest.approx((4 * (1 / 3 - 1)) / 8) and worse["losses"] == 4 and worse["n"] == 8


def test_tables_bold_every_best_value() -> None:
    evs = evaluations()
    assert best_configs(evs, "ndcg@10") == ["good", "same-as-good"]
    table = comparison_table(evs, ["ndcg@10", "recall@10"], bold=["ndcg@10"])
    lines = table.splitlines()
    assert lines[0] == "| config | ndcg@10 | recall@10 |"
    # Every query returned 6 documents: at k = 10 the values are marked depth-capped.
    assert lines[2] == "| good | **1.0000** † | 1.0000 † |"
    assert lines[3].startswith("| mixed | 0.7500 † |")
    assert main_k((1, 5, 10, 100)) == 10 and main_k((1, 3)) == 3 and main_k((20, 50)) == 20
    assert safe_name("my config/v2 (x)") == "my_config_v2_x"


def test_per_query_rows_mark_no_answer_questions() -> None:
    rows = per_query_rows(evaluations())
    assert len(rows) == 3 * 9
    none = [r for r in rows if r["query_id"] == "none"]
    assert all(r["answerable"] is False and r["scored"] is False and r["ndcg@10"] == "" for r in none)
    assert all(r["num_retrieved"] == 5 for r in none)
    scored = [r for r in rows if r["config"] == "good" and r["scored"]]
    assert len(scored) == 8 and all(r["ndcg@10"] == 1.0 for r in scored)


def test_plots_have_the_documented_size(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    evs = evaluations()
    grid = plot_metrics_vs_k(evs, tmp_path / "grid.png")
    delta = plot_deltas(evs["good"], evs["mixed"], "ndcg@10", ("good", "mixed"), tmp_path / "delta.png")
    for path, size in ((grid, METRICS_PLOT_SIZE), (delta, DELTA_PLOT_SIZE)):
        image = mpimg.imread(path)
        assert (image.shape[1], image.shape[0]) == size
        assert image[..., :3].std() > 0.01  # something was drawn
