"""Ranking metrics at a cutoff k, computed the way trec_eval computes them.

Inputs
------
* A *ranking* is one query's result list, best first: doc ids (``["d3", "d1"]``) or
  ``(doc_id, score)`` pairs (``[("d3", 0.9), ("d1", 0.4)]``). The order given **is** the rank
  (first item = rank 1); scores are never used to re-sort, so ties keep the order given.
  trec_eval instead re-sorts by score and breaks ties by doc id (descending), so give distinct,
  decreasing scores when you compare with trec_eval or ranx. A doc id may appear only once per
  ranking (trec_eval refuses duplicates too); turn chunk rankings into doc rankings with
  :func:`~llama_index_retrieval_kit.evaluation.relevance.doc_level_run` first.
* A *run* maps query id -> ranking.
* *Judgments* (one query's qrels) map doc id -> graded relevance, an int >= 0. Relevance > 0
  means relevant; 0 and unjudged docs are not relevant. *Qrels* map query id -> judgments.

Metrics (``R`` = number of relevant docs of the query, ranks from 1)
-------------------------------------------------------------------
* ``recall@k``: relevant docs in the top k / R  (trec_eval ``recall_k``; not capped at k).
* ``precision@k``: relevant docs in the top k / k, also when fewer than k were retrieved
  (trec_eval ``P_k``).
* ``mrr@k``: 1 / rank of the first relevant doc within the top k, else 0 (trec_eval
  ``recip_rank`` has no cutoff; this is its truncated form, as ranx ``mrr@k``).
* ``ndcg@k``: DCG@k / ideal DCG@k with linear gains (gain = relevance value) and discount
  log2(rank + 1); the ideal ranking sorts the query's relevance values, so relevant docs that
  were not retrieved still count (trec_eval ``ndcg_cut_k``; not the exponential 2^rel - 1 gains).
* ``hit_rate@k``: 1 if any relevant doc is in the top k, else 0 (trec_eval ``success_k``).
* ``map@k``: sum of precision@rank at each relevant doc in the top k / R (trec_eval
  ``map_cut_k``; the denominator is R, not min(R, k)).

An empty ranking is a miss: every metric is 0.0. For a query with no relevant doc every
per-query function returns 0.0 (as trec_eval); :func:`evaluate_run` leaves such queries out
of the means by default (see there).
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

logger = logging.getLogger(__name__)

RankedItem = str | tuple[str, float]
Ranking = Sequence[RankedItem]
Run = Mapping[str, Ranking]
Judgments = Mapping[str, int]
Qrels = Mapping[str, Judgments]

#: Metric names understood by :func:`evaluate_run`, in report order.
METRIC_NAMES: tuple[str, ...] = ("ndcg", "recall", "precision", "mrr", "hit_rate", "map")
DEFAULT_KS: tuple[int, ...] = (1, 5, 10, 100)
#: What :func:`evaluate_run` does with judged queries that have no relevant doc.
NO_RELEVANT_POLICIES: tuple[str, ...] = ("skip", "zero")


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_k(k: object) -> int:
    """``k`` as an int; it must be a whole number >= 1."""
    if not _is_int(k) or int(k) < 1:  # type: ignore[call-overload]
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    return int(k)  # type: ignore[call-overload]


def parse_ranking(ranking: Ranking, where: str = "ranking") -> tuple[list[str], list[float] | None]:
    """Doc ids in rank order, and their scores (None when the ranking holds bare doc ids).

    Accepts a list/tuple of doc ids or of ``(doc_id, score)`` pairs, not a mix. Rejects dicts
    and sets (no rank order), non-string ids and non-numeric scores. ``where`` names the ranking
    in error messages. Duplicates are *not* checked here (see :func:`ranked_doc_ids`).
    """
    if isinstance(ranking, (str, bytes, Mapping)) or not isinstance(ranking, Sequence):
        hint = " (a dict has no rank order: pass sorted(d.items(), key=lambda x: -x[1]))"
        raise ValueError(
            f"{where} must be a list of doc ids or of (doc_id, score) pairs in rank order, "
            f"got {type(ranking).__name__}" + (hint if isinstance(ranking, Mapping) else "")
        )
    ids: list[str] = []
    scores: list[float] = []
    for position, item in enumerate(ranking):
        if isinstance(item, str):
            ids.append(item)
            continue
        if (
            isinstance(item, (tuple, list))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], numbers.Real)
            and not isinstance(item[1], bool)
        ):
            ids.append(item[0])
            scores.append(float(item[1]))
            continue
        raise ValueError(
            f"{where}[{position}] must be a doc id (str) or a (doc_id: str, score: number) pair, got {item!r}"
        )
    if scores and len(scores) != len(ids):
        raise ValueError(f"{where} mixes bare doc ids and (doc_id, score) pairs; use one form")
    return ids, (scores if scores else None)


def ranked_doc_ids(ranking: Ranking, where: str = "ranking") -> list[str]:
    """Doc ids of ``ranking`` in rank order; raises ValueError on a doc id given twice."""
    ids, _ = parse_ranking(ranking, where)
    seen: dict[str, int] = {}
    for rank, doc_id in enumerate(ids, start=1):
        if doc_id in seen:
            raise ValueError(
                f"{where} lists doc id {doc_id!r} twice (ranks {seen[doc_id]} and {rank}); "
                "a ranking must hold each doc once (aggregate chunk rankings with doc_level_run)"
            )
        seen[doc_id] = rank
    return ids


def check_judgments(judgments: Judgments, where: str = "judgments") -> dict[str, int]:
    """A plain ``{doc_id: relevance}`` copy of ``judgments``; relevance must be an int >= 0."""
    if not isinstance(judgments, Mapping):
        raise ValueError(f"{where} must be a dict doc_id -> relevance (int >= 0), got {type(judgments).__name__}")
    checked: dict[str, int] = {}
    for doc_id, relevance in judgments.items():
        if not isinstance(doc_id, str):
            raise ValueError(f"{where} has a non-string doc id {doc_id!r}; doc ids must be str")
        if not _is_int(relevance) or int(relevance) < 0:
            raise ValueError(f"{where}[{doc_id!r}] must be an int >= 0 (0 = not relevant), got {relevance!r}")
        checked[doc_id] = int(relevance)
    return checked


def _check_metrics(metrics: str | Sequence[str]) -> list[str]:
    names = [metrics] if isinstance(metrics, str) else list(metrics)
    if not names:
        raise ValueError(f"metrics is empty; choose from {METRIC_NAMES}")
    for name in names:
        if name not in METRIC_NAMES:
            raise ValueError(f"unknown metric {name!r}; choose from {METRIC_NAMES}")
    return list(dict.fromkeys(names))


def _check_ks(ks: int | Sequence[int]) -> list[int]:
    values = [ks] if _is_int(ks) else list(ks)  # type: ignore[arg-type]
    if not values:
        raise ValueError("ks is empty; give at least one cutoff k >= 1")
    return list(dict.fromkeys(_check_k(k) for k in values))


# --------------------------------------------------------------------------------------------
# Core metrics on checked input: ids in rank order, relevance dict, k >= 1
# --------------------------------------------------------------------------------------------


def _num_relevant(relevance: Mapping[str, int]) -> int:
    return sum(1 for value in relevance.values() if value > 0)


def _hits(ids: Sequence[str], relevance: Mapping[str, int], k: int) -> int:
    return sum(1 for doc_id in ids[:k] if relevance.get(doc_id, 0) > 0)


def _recall(ids: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    num_relevant = _num_relevant(relevance)
    return _hits(ids, relevance, k) / num_relevant if num_relevant else 0.0


def _precision(ids: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    return _hits(ids, relevance, k) / k


def _reciprocal_rank(ids: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    for rank, doc_id in enumerate(ids[:k], start=1):
        if relevance.get(doc_id, 0) > 0:
            return 1.0 / rank
    return 0.0


def _hit_rate(ids: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    return 1.0 if _hits(ids, relevance, k) > 0 else 0.0


def _average_precision(ids: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    num_relevant = _num_relevant(relevance)
    if not num_relevant:
        return 0.0
    hits = 0
    precisions: list[float] = []
    for rank, doc_id in enumerate(ids[:k], start=1):
        if relevance.get(doc_id, 0) > 0:
            hits += 1
            precisions.append(hits / rank)
    return math.fsum(precisions) / num_relevant


def _dcg(gains: Sequence[int]) -> float:
    """Discounted cumulative gain: sum of gain / log2(rank + 1), ranks from 1."""
    return math.fsum(gain / math.log2(rank + 1) for rank, gain in enumerate(gains, start=1) if gain > 0)


def _ndcg(ids: Sequence[str], relevance: Mapping[str, int], k: int) -> float:
    ideal = _dcg(sorted((value for value in relevance.values() if value > 0), reverse=True)[:k])
    if ideal == 0.0:
        return 0.0
    return _dcg([relevance.get(doc_id, 0) for doc_id in ids[:k]]) / ideal


_METRICS: dict[str, Callable[[Sequence[str], Mapping[str, int], int], float]] = {
    "ndcg": _ndcg,
    "recall": _recall,
    "precision": _precision,
    "mrr": _reciprocal_rank,
    "hit_rate": _hit_rate,
    "map": _average_precision,
}


# --------------------------------------------------------------------------------------------
# Public per-query metrics
# --------------------------------------------------------------------------------------------


def _checked_call(name: str, ranking: Ranking, judgments: Judgments, k: int) -> float:
    return _METRICS[name](ranked_doc_ids(ranking), check_judgments(judgments), _check_k(k))


def recall_at_k(ranking: Ranking, judgments: Judgments, k: int) -> float:
    """Share of the query's relevant docs found in the top ``k`` (0.0 when it has none)."""
    return _checked_call("recall", ranking, judgments, k)


def precision_at_k(ranking: Ranking, judgments: Judgments, k: int) -> float:
    """Relevant docs in the top ``k`` divided by ``k`` (even when fewer were retrieved)."""
    return _checked_call("precision", ranking, judgments, k)


def reciprocal_rank_at_k(ranking: Ranking, judgments: Judgments, k: int) -> float:
    """1 / rank of the first relevant doc in the top ``k``, 0.0 when none; its mean is MRR@k."""
    return _checked_call("mrr", ranking, judgments, k)


def ndcg_at_k(ranking: Ranking, judgments: Judgments, k: int) -> float:
    """nDCG@k with linear gains (trec_eval ``ndcg_cut``); 0.0 when the query has no relevant doc."""
    return _checked_call("ndcg", ranking, judgments, k)


def hit_rate_at_k(ranking: Ranking, judgments: Judgments, k: int) -> float:
    """1.0 when a relevant doc is in the top ``k``, else 0.0 (trec_eval ``success_k``)."""
    return _checked_call("hit_rate", ranking, judgments, k)


def average_precision_at_k(ranking: Ranking, judgments: Judgments, k: int) -> float:
    """Average precision cut at ``k``, divided by all relevant docs (trec_eval ``map_cut``)."""
    return _checked_call("map", ranking, judgments, k)


# --------------------------------------------------------------------------------------------
# Whole runs
# --------------------------------------------------------------------------------------------


def metric_key(metric: str, k: int) -> str:
    """The result key of ``metric`` at cutoff ``k``, e.g. ``"ndcg@10"``."""
    return f"{metric}@{k}"


@dataclass(frozen=True)
class EvalResult:
    """Metric values of one run.

    ``per_query[query_id][key]`` and ``mean[key]`` with keys like ``"ndcg@10"``; ``mean`` is the
    arithmetic mean over the queries in ``per_query``. ``skipped``: judged queries left out
    because they have no relevant doc. ``missing``: evaluated queries absent from the run,
    scored as empty rankings (0.0).
    """

    per_query: dict[str, dict[str, float]]
    mean: dict[str, float]
    skipped: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    @property
    def num_queries(self) -> int:
        """How many queries the means average over."""
        return len(self.per_query)


def evaluate_run(
    run: Run,
    qrels: Qrels,
    metrics: str | Sequence[str] = METRIC_NAMES,
    ks: int | Sequence[int] = DEFAULT_KS,
    *,
    no_relevant: str = "skip",
) -> EvalResult:
    """Every ``metric@k`` for each judged query of ``run``, and their means.

    Which queries count:

    * only queries in ``qrels`` are evaluated; run queries without judgments are ignored
      (as trec_eval);
    * a judged query missing from ``run`` is scored as an empty ranking, i.e. 0.0
      (as ``trec_eval -c`` and ranx ``make_comparable=True``; plain trec_eval drops it);
    * a judged query with no relevant doc (all judgments 0, or none) cannot be answered by
      ranking: with ``no_relevant="skip"`` (default) it is left out of ``per_query`` and the
      means and listed in ``EvalResult.skipped``; with ``no_relevant="zero"`` it scores 0.0
      on every metric and counts in the means, which is what trec_eval (since version 8) and
      ranx do for queries that have judgments but no relevant doc.

    Raises ValueError on malformed input, and when no query is left to evaluate.
    Neither ``run`` nor ``qrels`` is modified.
    """
    metric_names = _check_metrics(metrics)
    cutoffs = _check_ks(ks)
    if no_relevant not in NO_RELEVANT_POLICIES:
        raise ValueError(f"no_relevant must be one of {NO_RELEVANT_POLICIES}, got {no_relevant!r}")
    if not isinstance(run, Mapping):
        raise ValueError(f"run must be a dict query_id -> ranking, got {type(run).__name__}")
    if not isinstance(qrels, Mapping):
        raise ValueError(f"qrels must be a dict query_id -> {{doc_id: relevance}}, got {type(qrels).__name__}")

    rankings = {query_id: ranked_doc_ids(ranking, f"run[{query_id!r}]") for query_id, ranking in run.items()}
    judgments = {query_id: check_judgments(judged, f"qrels[{query_id!r}]") for query_id, judged in qrels.items()}

    per_query: dict[str, dict[str, float]] = {}
    skipped: list[str] = []
    missing: list[str] = []
    for query_id, relevance in judgments.items():
        if no_relevant == "skip" and _num_relevant(relevance) == 0:
            skipped.append(query_id)
            continue
        if query_id not in rankings:
            missing.append(query_id)
        ids = rankings.get(query_id, [])
        per_query[query_id] = {
            metric_key(name, k): _METRICS[name](ids, relevance, k) for name in metric_names for k in cutoffs
        }

    if not per_query:
        raise ValueError(
            f"nothing to evaluate: none of the {len(judgments)} judged queries has a relevant doc "
            f"(no_relevant={no_relevant!r}); score no-answer questions separately or pass no_relevant='zero'"
        )
    keys = [metric_key(name, k) for name in metric_names for k in cutoffs]
    mean = {key: math.fsum(values[key] for values in per_query.values()) / len(per_query) for key in keys}

    unjudged = sum(1 for query_id in rankings if query_id not in judgments)
    if missing:
        logger.warning("%d judged queries are missing from the run and score 0.0: %s", len(missing), missing[:5])
    logger.info(
        "evaluated %d queries (%d skipped: no relevant doc; %d missing from run; %d run queries unjudged)",
        len(per_query),
        len(skipped),
        len(missing),
        unjudged,
    )
    return EvalResult(per_query=per_query, mean=mean, skipped=tuple(skipped), missing=tuple(missing))
