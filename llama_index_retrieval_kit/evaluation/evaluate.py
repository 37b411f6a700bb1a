"""Run any LlamaIndex retriever over a labelled dataset and score it.

:func:`evaluate_retriever` = :func:`retrieve_all` (run the queries, time each one, keep the
ranked node ids and scores) + :func:`score_retrievals` (turn them into rankings and metrics).
Keeping the two apart lets a stored run be re-scored, e.g. under another relevance mode.

Order: the IR metrics score each query's results *ordered by relevance*: when every result
has a score they are stably sorted by it, highest first (:func:`ranked_by_score`), so a
presentation order such as a context assembler's ``bookends`` is not scored as a ranking;
results without scores keep the order returned. ``Retrieval.reordered`` records where that
changed the order.

Relevance modes (what counts as a relevant retrieved item):

* ``"doc"``: each retrieved chunk stands for its document (``metadata["doc_id"]``, else
  ``node.ref_doc_id``); the chunk ranking becomes a document ranking with max-score
  aggregation (:func:`~.relevance.doc_level_run`) and is scored against the doc-level qrels.
  ``k`` counts documents. Survives re-chunking.
* ``"node"``: the ranked node ids are scored against qrels whose keys are node ids. Only
  meaningful for the chunking the labels were made with.
* ``"text"``: the query's reference passages (``reference_contexts``) are the relevant items.
  A retrieved chunk holds passage ``j`` when ``text_match(reference_j, chunk_text)``; each
  passage is found once, at rank ``r_j``: the rank of the best-ranked chunk holding it (a chunk
  may find several passages; a chunk that finds none not found before is a non-relevant
  item, as a repeated document would be). ``k`` counts chunks. See :func:`passage_metrics`
  for the formulas: recall@k = passages found in the top k / P; nDCG and MAP credit each
  passage at ``r_j``; precision@k, MRR and hit rate look at the chunks that find a passage.
  With at most one passage per chunk they are exactly the trec_eval values of
  :func:`passage_ranking` against :func:`passage_qrels`. Alongside, ``coverage@k`` (mean over
  the passages of :func:`~.relevance.coverage_at_k`) and ``chars@k`` (characters in the top-k
  chunks) are reported: they do not depend on where the chunker cut, so configurations are
  comparable when their chars@k are similar.
* ``"auto"``: ``"text"`` when the dataset has reference passages, else ``"doc"``.

Queries: a *no-answer* query (no relevant doc and no reference passage) is kept in
``per_query`` (``answerable=False``, no IR metrics) but left out of the means; an answerable
query without labels of the chosen mode (e.g. only doc ids under ``"text"``) is left out too
and listed in ``unlabelled``. An empty retrieval is a miss (every metric 0.0).

Depth: a metric@k where a configuration returned fewer than ``k`` items (documents under
``"doc"``, chunks otherwise) for most scored queries measures how many it returned, not how
it ranked (:meth:`RetrieverEvaluation.capped_ks`). Abstention: an empty result counts as the
retriever abstaining (e.g. a no-answer gate); :meth:`RetrieverEvaluation.abstention` scores
that on the no-answer questions.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from .datasets import RetrievalDataset
from .relevance import RELEVANCE_MODES
from .metrics import DEFAULT_KS, METRIC_NAMES, EvalResult, _check_ks, evaluate_run
from .relevance import chars_at_k, coverage_at_k, doc_level_run, text_match

logger = logging.getLogger(__name__)

#: How many ids an error or warning about unmatched reference doc ids shows.
SHOWN_IDS = 5
#: Extra per-query figures computed under ``relevance="text"`` (keys ``coverage@k``, ``chars@k``).
TEXT_FIGURES: tuple[str, ...] = ("coverage", "chars")


# --------------------------------------------------------------------------------------------
# Retrieval
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retrieval:
    """What a retriever returned for one query, in relevance order (see :func:`ranked_by_score`).

    ``node_ids``/``scores``/``doc_ids`` have one entry per retrieved chunk (a node returned
    twice is kept once, at its best rank). ``doc_ids`` hold ``metadata["doc_id"]``, else
    ``ref_doc_id``, else None. ``texts`` holds the raw text of the first ``text_depth`` chunks
    only (what text relevance needs). ``latency_s``: wall time of the ``retrieve`` call.
    ``reordered``: the retriever returned the results in another order than by score (e.g. a
    context assembler's presentation order); they are held sorted by score.
    """

    query_id: str
    node_ids: tuple[str, ...]
    scores: tuple[float | None, ...]
    doc_ids: tuple[str | None, ...]
    texts: tuple[str, ...]
    latency_s: float
    reordered: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (without texts): query id, node ids, scores, doc ids, latency, reordered."""
        return {
            "query_id": self.query_id,
            "node_ids": list(self.node_ids),
            "scores": list(self.scores),
            "doc_ids": list(self.doc_ids),
            "latency_ms": round(self.latency_s * 1000.0, 3),
            "reordered": self.reordered,
        }


def score_order(scores: Sequence[float | None]) -> list[int] | None:
    """Positions of ``scores`` sorted by score, highest first, ties in given order (a stable
    sort); None when some score is None (the given order is kept then)."""
    if any(score is None for score in scores):
        return None
    return sorted(range(len(scores)), key=lambda position: -float(scores[position]))  # type: ignore[arg-type]


def ranked_by_score(retrieval: Retrieval) -> Retrieval:
    """``retrieval`` with its chunks in relevance order: stably sorted by score, highest first,
    when every chunk has a score (unchanged otherwise, or when already in that order).

    ``texts`` follow their chunks and are kept for the longest leading run of chunks whose text
    was kept. A reordered result has ``reordered=True``.
    """
    order = score_order(retrieval.scores)
    if order is None or order == list(range(len(order))):
        return retrieval
    texts: list[str] = []
    for position in order:
        if position >= len(retrieval.texts):
            break
        texts.append(retrieval.texts[position])
    return replace(
        retrieval,
        node_ids=tuple(retrieval.node_ids[p] for p in order),
        scores=tuple(retrieval.scores[p] for p in order),
        doc_ids=tuple(retrieval.doc_ids[p] for p in order),
        texts=tuple(texts),
        reordered=True,
    )


def node_doc_id(node: Any) -> str | None:
    """The document a chunk belongs to: ``metadata["doc_id"]``, else ``ref_doc_id``, else None."""
    doc_id = (node.metadata or {}).get("doc_id")
    if isinstance(doc_id, str) and doc_id:
        return doc_id
    return node.ref_doc_id


def _as_retrieval(query_id: str, results: Sequence[NodeWithScore], latency_s: float, text_depth: int) -> Retrieval:
    seen: set[str] = set()
    kept: list[NodeWithScore] = []
    for result in results:
        if result.node.node_id in seen:
            continue
        seen.add(result.node.node_id)
        kept.append(result)
    if len(kept) < len(results):
        logger.debug("query %r: dropped %d repeated node ids", query_id, len(results) - len(kept))
    order = score_order([r.score for r in kept])
    reordered = order is not None and order != list(range(len(kept)))
    if order is not None:
        kept = [kept[position] for position in order]
    return Retrieval(
        query_id=query_id,
        node_ids=tuple(r.node.node_id for r in kept),
        scores=tuple(None if r.score is None else float(r.score) for r in kept),
        doc_ids=tuple(node_doc_id(r.node) for r in kept),
        texts=tuple(r.node.get_content(metadata_mode=MetadataMode.NONE) for r in kept[:text_depth]),
        latency_s=latency_s,
        reordered=reordered,
    )


def retrieve_all(
    retriever: BaseRetriever,
    queries: Mapping[str, str],
    text_depth: int = max(DEFAULT_KS),
    show_progress: bool = False,
) -> dict[str, Retrieval]:
    """Run ``retriever.retrieve`` on every query (in order), timing each call.

    The retriever is used as configured (its own top-k); it is not modified. Each result is
    kept in relevance order (see :func:`ranked_by_score`); ``text_depth`` texts are kept. Raises
    RuntimeError naming the query when the retriever fails (ValueError when it refuses the query).
    """
    if not isinstance(retriever, BaseRetriever):
        raise ValueError(f"retriever must be a LlamaIndex BaseRetriever, got {type(retriever).__name__}")
    if isinstance(text_depth, bool) or not isinstance(text_depth, int) or text_depth < 0:
        raise ValueError(f"text_depth must be an int >= 0, got {text_depth!r}")
    items: Any = list(queries.items())
    if show_progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="Retrieving", unit="query")
    out: dict[str, Retrieval] = {}
    for query_id, text in items:
        start = time.perf_counter()
        try:
            results = retriever.retrieve(QueryBundle(query_str=text))
        except ValueError as exc:  # bad input stays a ValueError (rkit: a usage error, not a crash)
            raise ValueError(f"{type(retriever).__name__} refused query {query_id!r} ({text[:80]!r}): {exc}") from exc
        except Exception as exc:
            raise RuntimeError(f"{type(retriever).__name__} failed on query {query_id!r} ({text[:80]!r}): {exc}") from exc
        out[query_id] = _as_retrieval(query_id, results, time.perf_counter() - start, text_depth)
    return out


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    """p50/p95/mean per-query latency in milliseconds and the total in seconds (0 when empty)."""
    if not latencies_s:
        return {"p50_ms": 0.0, "p95_ms": 0.0, "mean_ms": 0.0, "total_s": 0.0}
    values = np.asarray(latencies_s, dtype=float)
    return {
        "p50_ms": float(np.percentile(values, 50) * 1000.0),
        "p95_ms": float(np.percentile(values, 95) * 1000.0),
        "mean_ms": float(values.mean() * 1000.0),
        "total_s": float(values.sum()),
    }


# --------------------------------------------------------------------------------------------
# Rankings per relevance mode (pure)
# --------------------------------------------------------------------------------------------


def doc_ranking(retrieval: Retrieval) -> list[str] | list[tuple[str, float]]:
    """The chunk ranking as a document ranking (max-score aggregation, first-chunk rank order)."""
    missing = [node_id for node_id, doc_id in zip(retrieval.node_ids, retrieval.doc_ids) if doc_id is None]
    if missing:
        raise ValueError(
            f"query {retrieval.query_id!r}: retrieved node {missing[0]!r} has no metadata['doc_id'] and no source "
            "document (ref_doc_id), so doc-level relevance cannot map it to a document; give nodes a doc_id "
            "or use relevance='node'"
        )
    chunk_to_doc = dict(zip(retrieval.node_ids, retrieval.doc_ids))
    if any(score is None for score in retrieval.scores):
        return doc_level_run(list(retrieval.node_ids), chunk_to_doc)  # type: ignore[arg-type]
    pairs = [(node_id, float(score)) for node_id, score in zip(retrieval.node_ids, retrieval.scores)]  # type: ignore[arg-type]
    return doc_level_run(pairs, chunk_to_doc)


def passage_first_ranks(chunk_texts: Sequence[str], references: Sequence[str]) -> list[int | None]:
    """For each reference passage ``j``: the rank (from 1) of the best-ranked chunk holding it
    (``text_match``), or None when no chunk does. Several passages may share a rank."""
    ranks: list[int | None] = []
    for reference in references:
        ranks.append(next((rank for rank, text in enumerate(chunk_texts, start=1) if text_match(reference, text)), None))
    return ranks


def passage_ranking(chunk_texts: Sequence[str], references: Sequence[str]) -> list[str]:
    """Chunks in rank order as item ids: ``"ref{j}"`` where a chunk first finds passage j.

    A chunk that is the best-ranked holder of passages ``j < l`` gets ``"ref{j}+ref{l}"``; a chunk
    that finds no passage a better-ranked chunk did not find is a non-relevant item ``"chunk{rank}"``.
    """
    return _passage_items(passage_first_ranks(chunk_texts, references), len(chunk_texts))


def _passage_items(first_ranks: Sequence[int | None], num_chunks: int) -> list[str]:
    found_at: dict[int, list[int]] = {}
    for j, rank in enumerate(first_ranks):
        if rank is not None:
            found_at.setdefault(rank, []).append(j)
    return [
        "+".join(f"ref{j}" for j in found_at[rank]) if rank in found_at else f"chunk{rank}"
        for rank in range(1, num_chunks + 1)
    ]


def passage_qrels(references: Sequence[str]) -> dict[str, int]:
    """Judgments matching :func:`passage_ranking` when no chunk holds two passages: each
    reference passage is one relevant item (``evaluate_run(run, qrels)`` then equals
    :func:`passage_metrics`)."""
    return {f"ref{j}": 1 for j in range(len(references))}


def _check_first_ranks(first_ranks: Sequence[int | None]) -> list[int | None]:
    if isinstance(first_ranks, (str, bytes)) or not isinstance(first_ranks, Sequence) or not first_ranks:
        raise ValueError(f"first_ranks must be a non-empty list (one rank or None per passage), got {first_ranks!r}")
    for position, rank in enumerate(first_ranks):
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"first_ranks[{position}] must be a rank >= 1 or None (not found), got {rank!r}")
    return list(first_ranks)


def passage_metrics(first_ranks: Sequence[int | None], ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """Every ``metric@k`` of :data:`~.metrics.METRIC_NAMES` for one query under text relevance.

    ``first_ranks[j]`` is the rank ``r_j`` of the best-ranked chunk holding passage ``j`` (None:
    not retrieved; see :func:`passage_first_ranks`); ``P = len(first_ranks)``; ``H`` is the set of
    ranks of chunks that find at least one passage (``{r_j}``). ``k`` counts chunks:

    * ``recall@k`` = |{j : r_j <= k}| / P (a chunk holding several passages finds each of them);
    * ``precision@k`` = |{h in H : h <= k}| / k (relevant chunks in the top k, trec_eval ``P_k``);
    * ``mrr@k`` = 1 / min(H) when min(H) <= k, else 0; ``hit_rate@k`` = 1 when min(H) <= k;
    * ``map@k`` = (1/P) * sum over j with r_j <= k of prec(r_j), prec(r) = |{h in H : h <= r}| / r:
      each passage credited with the precision of the chunk ranking where it was found
      (trec_eval ``map_cut_k`` with R = P);
    * ``ndcg@k`` = min(1, DCG@k / IDCG@k), DCG@k = sum over j with r_j <= k of 1 / log2(r_j + 1)
      (each passage a hit at r_j, linear binary gains), IDCG@k = sum for i = 1..min(P, k) of
      1 / log2(i + 1) (one passage per rank, trec_eval ``ndcg_cut_k``); a chunk holding several
      passages can exceed that ideal, hence the cap.

    When no two passages share a rank these are exactly the trec_eval (ranx) values of
    :func:`passage_ranking` against :func:`passage_qrels`.
    """
    ranks = _check_first_ranks(first_ranks)
    cutoffs = _check_ks(ks)
    num_passages = len(ranks)
    found = sorted(rank for rank in ranks if rank is not None)
    hit_ranks = sorted(set(found))
    values: dict[str, float] = {}
    for name in METRIC_NAMES:
        for k in cutoffs:
            in_top = [rank for rank in found if rank <= k]
            if name == "recall":
                value = len(in_top) / num_passages
            elif name == "precision":
                value = sum(1 for h in hit_ranks if h <= k) / k
            elif name == "mrr":
                value = 1.0 / hit_ranks[0] if hit_ranks and hit_ranks[0] <= k else 0.0
            elif name == "hit_rate":
                value = 1.0 if in_top else 0.0
            elif name == "map":
                value = math.fsum(sum(1 for h in hit_ranks if h <= r) / r for r in in_top) / num_passages
            else:  # ndcg
                ideal = math.fsum(1.0 / math.log2(i + 1) for i in range(1, min(num_passages, k) + 1))
                value = min(1.0, math.fsum(1.0 / math.log2(r + 1) for r in in_top) / ideal)
            values[f"{name}@{k}"] = value
    return values


def text_figures(chunk_texts: Sequence[str], references: Sequence[str], ks: Sequence[int]) -> dict[str, float]:
    """``coverage@k`` (mean coverage of the passages by the top-k chunks) and ``chars@k``."""
    figures: dict[str, float] = {}
    for k in ks:
        top = list(chunk_texts[:k])
        if references:
            figures[f"coverage@{k}"] = math.fsum(coverage_at_k(ref, top) for ref in references) / len(references)
        figures[f"chars@{k}"] = float(chars_at_k(top))
    return figures


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueryEvaluation:
    """One query's result: flags, metric values (``"ndcg@10"``...) and what was retrieved.

    ``metrics`` is empty for queries left out of the means (no-answer or unlabelled), except
    ``chars@k`` under text relevance. ``ranking`` is the scored item list (doc ids, node ids
    or passage item ids).
    """

    query_id: str
    answerable: bool
    labelled: bool
    metrics: dict[str, float]
    ranking: tuple[str, ...]
    retrieval: Retrieval


@dataclass(frozen=True)
class RetrieverEvaluation:
    """Metrics of one retriever on one dataset.

    ``mean`` averages over the labelled answerable queries (``num_scored``): IR metrics
    ``metric@k`` for every metric of
    :data:`~.metrics.METRIC_NAMES` and k in ``ks``, plus ``coverage@k``/``chars@k`` under text
    relevance. ``per_query`` holds every query in dataset order. ``latency``: per-query
    retrieval latency (see :func:`latency_summary`).
    """

    relevance: str
    ks: tuple[int, ...]
    mean: dict[str, float]
    per_query: dict[str, QueryEvaluation]
    no_answer_ids: tuple[str, ...]
    unlabelled_ids: tuple[str, ...]
    latency: dict[str, float]
    dataset_name: str = ""

    @property
    def num_scored(self) -> int:
        """How many queries the means average over."""
        return sum(1 for q in self.per_query.values() if q.answerable and q.labelled)

    def scored_ids(self) -> list[str]:
        """Ids of the queries in the means, in dataset order."""
        return [qid for qid, q in self.per_query.items() if q.answerable and q.labelled]

    def values(self, key: str) -> dict[str, float]:
        """``key`` (e.g. ``"ndcg@10"``) for every scored query."""
        if key not in self.mean:
            raise ValueError(f"unknown metric {key!r}; available: {sorted(self.mean)}")
        return {qid: self.per_query[qid].metrics[key] for qid in self.scored_ids()}

    # ---------------------------------------------------------------- depth: how much came back

    @property
    def item_unit(self) -> str:
        """What ``k`` counts: ``"documents"`` under doc relevance, else ``"chunks"``."""
        return "documents" if self.relevance == "doc" else "chunks"

    def returned_items(self) -> dict[str, int]:
        """For every scored query: how many items (see :attr:`item_unit`) its result holds."""
        if self.relevance == "doc":
            return {qid: len(self.per_query[qid].ranking) for qid in self.scored_ids()}
        return {qid: len(self.per_query[qid].retrieval.node_ids) for qid in self.scored_ids()}

    def short_of_k(self) -> dict[int, int]:
        """For every k: how many scored queries returned fewer than ``k`` items."""
        counts = list(self.returned_items().values())
        return {k: sum(1 for count in counts if count < k) for k in self.ks}

    def capped_ks(self) -> list[int]:
        """The cutoffs where most scored queries (more than half) returned fewer than ``k`` items.

        There every ``metric@k`` mostly measures how many items the retriever returned (its
        top-k, a gate, a token budget), not how it ranked them: compare such values with care.
        """
        short = self.short_of_k()
        return [k for k in self.ks if 2 * short[k] > self.num_scored]

    def is_capped(self, key: str) -> bool:
        """Whether ``key`` (``"ndcg@10"``...) is at a cutoff in :meth:`capped_ks`."""
        _, _, k = key.rpartition("@")
        return k.isdigit() and int(k) in self.capped_ks()

    def returned(self) -> dict[str, Any]:
        """JSON-ready depth facts over the scored queries: mean chunks and documents returned per
        query (distinct doc ids; a chunk without one counts as its own document), the unit k
        counts, per k how many queries returned fewer than k items, and :meth:`capped_ks`."""
        scored = [self.per_query[qid].retrieval for qid in self.scored_ids()]
        chunks = [len(r.node_ids) for r in scored]
        docs = [
            len({d for d in r.doc_ids if d is not None}) + sum(1 for d in r.doc_ids if d is None) for r in scored
        ]
        return {
            "unit": self.item_unit,
            "num_queries": len(scored),
            "mean_chunks": math.fsum(chunks) / len(chunks) if chunks else 0.0,
            "mean_docs": math.fsum(docs) / len(docs) if docs else 0.0,
            "short_of_k": {str(k): n for k, n in self.short_of_k().items()},
            "capped_ks": self.capped_ks(),
            "reordered_queries": sum(1 for q in self.per_query.values() if q.retrieval.reordered),
        }

    # ---------------------------------------------------------------- abstention (no-answer)

    def abstention(self) -> dict[str, Any] | None:
        """How the empty results (abstentions, e.g. a no-answer gate's) match the no-answer
        questions; None when the dataset has none.

        ``recall`` = no-answer questions with an empty result / no-answer questions;
        ``precision`` = no-answer questions with an empty result / questions with an empty
        result (None when no result is empty); ``answerable_kept`` = answerable questions with
        a non-empty result / answerable questions (None when there are none); with the counts.
        """
        if not self.no_answer_ids:
            return None
        empty = {qid for qid, q in self.per_query.items() if not q.retrieval.node_ids}
        answerable = [qid for qid, q in self.per_query.items() if q.answerable]
        right = sum(1 for qid in self.no_answer_ids if qid in empty)
        wrong = sum(1 for qid in answerable if qid in empty)
        return {
            "num_no_answer": len(self.no_answer_ids),
            "num_answerable": len(answerable),
            "abstained": len(empty),
            "abstained_no_answer": right,
            "abstained_answerable": wrong,
            "recall": right / len(self.no_answer_ids),
            "precision": right / len(empty) if empty else None,
            "answerable_kept": (len(answerable) - wrong) / len(answerable) if answerable else None,
        }

    def summary(self) -> dict[str, Any]:
        """JSON-ready means, counts, depth (:meth:`returned`), abstention (when the dataset has
        no-answer questions) and latency (no per-query data)."""
        summary: dict[str, Any] = {
            "dataset": self.dataset_name,
            "relevance": self.relevance,
            "ks": list(self.ks),
            "num_queries": len(self.per_query),
            "num_scored": self.num_scored,
            "num_no_answer": len(self.no_answer_ids),
        }
        abstention = self.abstention()
        if abstention is not None:
            summary["abstention"] = abstention
        summary.update(
            {
                "num_unlabelled": len(self.unlabelled_ids),
                "mean": dict(self.mean),
                "returned": self.returned(),
                "latency": dict(self.latency),
            }
        )
        return summary


# --------------------------------------------------------------------------------------------
# Do the reference doc ids name the indexed documents?
# --------------------------------------------------------------------------------------------


class UnmatchedReferencesError(ValueError):
    """None of a dataset's reference doc ids names an indexed document (every doc metric would be 0)."""

    def __init__(self, message: str, unmatched: Sequence[str]) -> None:
        self.unmatched = list(unmatched)
        super().__init__(message)


def reference_doc_ids(dataset: RetrievalDataset) -> set[str]:
    """The doc ids judged relevant (> 0) for some answerable question of ``dataset``."""
    return {doc_id for judged in dataset.qrels.values() for doc_id, value in judged.items() if value > 0}


def unmatched_reference_doc_ids(dataset: RetrievalDataset, indexed_doc_ids: Collection[str]) -> list[str]:
    """The reference doc ids (see :func:`reference_doc_ids`) that name no indexed document, sorted."""
    known = set(indexed_doc_ids)
    return sorted(doc_id for doc_id in reference_doc_ids(dataset) if doc_id not in known)


def check_reference_doc_ids(
    dataset: RetrievalDataset,
    indexed_doc_ids: Iterable[str],
    allow_unmatched_references: bool = False,
    hint: str = "check that the retriever searches the documents the dataset is about",
    opt_out: str = "allow_unmatched_references=True",
) -> list[str]:
    """The reference doc ids of ``dataset`` that name no indexed document (sorted).

    When *none* matches (and there is at least one), every doc-level metric would be 0: that
    raises :class:`UnmatchedReferencesError` naming the count and the first ids, with ``hint``
    (what to check) and ``opt_out`` (how to score anyway), unless
    ``allow_unmatched_references``. When only some do not match, a warning with the count is
    logged. ``indexed_doc_ids`` holds the ids of the documents the retriever searches.
    """
    known = {doc_id for doc_id in indexed_doc_ids if isinstance(doc_id, str)}
    references = reference_doc_ids(dataset)
    unmatched = unmatched_reference_doc_ids(dataset, known)
    if not unmatched:
        return unmatched
    missing = set(unmatched)
    questions = [qid for qid, judged in dataset.qrels.items() if any(v > 0 and d in missing for d, v in judged.items())]
    counts = f"{len(unmatched)} of {len(references)} reference doc ids (in {len(questions)} questions)"
    examples = f"e.g. {unmatched[:SHOWN_IDS]!r}; indexed doc ids look like {sorted(known)[:SHOWN_IDS]!r}"
    if len(unmatched) == len(references) and not allow_unmatched_references:
        raise UnmatchedReferencesError(
            f"none of the reference doc ids of {dataset.name or 'the dataset'!r} names an indexed document: {counts} "
            f"match none of the {len(known)} indexed documents ({examples}), so the documents searched are not the "
            f"ones the dataset is about and every score would be 0. {hint[:1].upper()}{hint[1:]}, and that "
            f"reference_doc_ids use those documents' ids; or pass {opt_out} to score anyway",
            unmatched,
        )
    logger.warning("%s match no indexed document (%s); those count as never retrieved", counts, examples)
    return unmatched


def _warn_if_nothing_relevant_retrieved(dataset: RetrievalDataset, retrievals: Mapping[str, Retrieval]) -> None:
    """Warn when not one retrieved chunk of any query comes from any reference document."""
    references = reference_doc_ids(dataset)
    retrieved = {doc_id for r in retrievals.values() for doc_id in r.doc_ids if doc_id is not None}
    if references and retrieved and not references & retrieved:
        logger.warning(
            "no retrieved chunk of any query comes from a reference document (reference ids e.g. %r, retrieved doc "
            "ids e.g. %r): if the dataset's reference_doc_ids do not name the indexed documents, every doc-level "
            "score is 0; pass indexed_doc_ids= to evaluate_retriever to check",
            sorted(references)[:SHOWN_IDS],
            sorted(retrieved)[:SHOWN_IDS],
        )


def resolve_relevance(relevance: str, dataset: RetrievalDataset) -> str:
    """The relevance mode to use: ``relevance`` checked, ``"auto"`` resolved (see module doc)."""
    if relevance not in RELEVANCE_MODES:
        raise ValueError(f"relevance must be one of {RELEVANCE_MODES}, got {relevance!r}")
    if relevance != "auto":
        return relevance
    return "text" if any(dataset.reference_contexts.get(qid) for qid in dataset.queries) else "doc"


def _is_labelled(dataset: RetrievalDataset, query_id: str, relevance: str) -> bool:
    if relevance == "text":
        return bool(dataset.reference_contexts.get(query_id))
    return any(value > 0 for value in dataset.qrels.get(query_id, {}).values())


def _ranking_of(retrieval: Retrieval, relevance: str) -> list[str]:
    if relevance == "doc":
        return [item if isinstance(item, str) else item[0] for item in doc_ranking(retrieval)]
    return list(retrieval.node_ids)


def score_retrievals(
    retrievals: Mapping[str, Retrieval],
    dataset: RetrievalDataset,
    ks: Sequence[int] = DEFAULT_KS,
    relevance: str = "auto",
) -> RetrieverEvaluation:
    """Score stored retrievals against ``dataset`` (see the module doc for the modes).

    Each retrieval is scored in relevance order (:func:`ranked_by_score`). A dataset query
    missing from ``retrievals`` is scored as an empty retrieval (a miss). Raises ValueError
    when no query has labels for the chosen mode.
    """
    cutoffs = tuple(_check_ks(ks))
    mode = resolve_relevance(relevance, dataset)
    retrievals = {qid: ranked_by_score(r) for qid, r in retrievals.items()}
    if mode == "text":
        short = [r.query_id for r in retrievals.values() if len(r.texts) < min(len(r.node_ids), max(cutoffs))]
        if short:
            logger.warning(
                "text relevance: %d queries kept fewer chunk texts than max(ks)=%d (retrieve_all text_depth); "
                "their deeper chunks count as misses: %s", len(short), max(cutoffs), short[:5]
            )

    run: dict[str, list[str]] = {}
    qrels: dict[str, dict[str, int]] = {}
    text_metrics: dict[str, dict[str, float]] = {}
    rankings: dict[str, tuple[str, ...]] = {}
    extra: dict[str, dict[str, float]] = {}
    no_answer: list[str] = []
    unlabelled: list[str] = []
    for query_id in dataset.queries:
        retrieval = retrievals.get(query_id) or Retrieval(query_id, (), (), (), (), 0.0)
        answerable = dataset.is_answerable(query_id)
        labelled = _is_labelled(dataset, query_id, mode)
        references = dataset.reference_contexts.get(query_id, []) if mode == "text" else []
        if not answerable:
            no_answer.append(query_id)
        elif not labelled:
            unlabelled.append(query_id)
        if mode == "text":
            extra[query_id] = text_figures(retrieval.texts, references, cutoffs)
        if not (answerable and labelled):
            rankings[query_id] = ()
            continue
        if mode == "text":
            first_ranks = passage_first_ranks(retrieval.texts, references)
            rankings[query_id] = tuple(_passage_items(first_ranks, len(retrieval.texts)))
            text_metrics[query_id] = passage_metrics(first_ranks, cutoffs)
            continue
        ranking = _ranking_of(retrieval, mode)
        rankings[query_id] = tuple(ranking)
        run[query_id] = ranking
        qrels[query_id] = dict(dataset.qrels[query_id])
    if not qrels and not text_metrics:
        raise ValueError(
            f"no query of {dataset.name or 'the dataset'!r} has labels for relevance={mode!r} "
            f"({len(no_answer)} no-answer, {len(unlabelled)} without {mode}-level labels); "
            "choose another relevance mode"
        )
    if unlabelled:
        logger.warning("%d answerable queries have no %s-level labels and are not scored: %s", len(unlabelled), mode, unlabelled[:5])

    if mode == "text":
        keys = [f"{name}@{k}" for name in METRIC_NAMES for k in cutoffs]
        text_mean = {key: math.fsum(m[key] for m in text_metrics.values()) / len(text_metrics) for key in keys}
        result = EvalResult(per_query=text_metrics, mean=text_mean)
    else:
        result = evaluate_run(run, qrels, ks=cutoffs)
    per_query: dict[str, QueryEvaluation] = {}
    for query_id in dataset.queries:
        retrieval = retrievals.get(query_id) or Retrieval(query_id, (), (), (), (), 0.0)
        metrics = dict(result.per_query.get(query_id, {}))
        scored = query_id in result.per_query
        figures = extra.get(query_id, {})
        metrics.update(figures if scored else {key: value for key, value in figures.items() if key.startswith("chars@")})
        per_query[query_id] = QueryEvaluation(
            query_id=query_id,
            answerable=dataset.is_answerable(query_id),
            labelled=_is_labelled(dataset, query_id, mode),
            metrics=metrics,
            ranking=rankings[query_id],
            retrieval=retrieval,
        )
    mean = dict(result.mean)
    if mode == "text":
        scored_ids = list(result.per_query)
        for key in [f"{name}@{k}" for name in TEXT_FIGURES for k in cutoffs]:
            mean[key] = math.fsum(per_query[qid].metrics[key] for qid in scored_ids) / len(scored_ids)
    latencies = [retrievals[qid].latency_s for qid in dataset.queries if qid in retrievals]
    return RetrieverEvaluation(
        relevance=mode,
        ks=cutoffs,
        mean=mean,
        per_query=per_query,
        no_answer_ids=tuple(no_answer),
        unlabelled_ids=tuple(unlabelled),
        latency=latency_summary(latencies),
        dataset_name=dataset.name,
    )


def evaluate_retriever(
    retriever: BaseRetriever,
    dataset: RetrievalDataset,
    ks: Sequence[int] = DEFAULT_KS,
    relevance: str = "auto",
    show_progress: bool = False,
    indexed_doc_ids: Iterable[str] | None = None,
    allow_unmatched_references: bool = False,
) -> RetrieverEvaluation:
    """Retrieve for every query of ``dataset`` and score the results.

    ``retriever`` is any LlamaIndex ``BaseRetriever`` (ours or LlamaIndex's own), used as
    configured: set its top-k to at least ``max(ks)`` chunks (for doc relevance, enough chunks
    to fill ``max(ks)`` documents). See the module doc for ``relevance``.

    ``indexed_doc_ids``: the ids of the documents the retriever searches. Given, the dataset's
    reference doc ids are checked against them before retrieving (:func:`check_reference_doc_ids`):
    an :class:`UnmatchedReferencesError` when none matches, unless
    ``allow_unmatched_references=True``; a warning when some do not. Not given (and not under
    node relevance), a warning is logged when no retrieved chunk comes from any reference document.
    """
    cutoffs = tuple(_check_ks(ks))
    if not isinstance(dataset, RetrievalDataset):
        raise ValueError(f"dataset must be a RetrievalDataset (load_beir / load_jsonl), got {type(dataset).__name__}")
    if not isinstance(allow_unmatched_references, bool):
        raise ValueError(f"allow_unmatched_references must be True or False, got {allow_unmatched_references!r}")
    mode = resolve_relevance(relevance, dataset)  # fail before retrieving
    if indexed_doc_ids is not None:
        if isinstance(indexed_doc_ids, str) or not isinstance(indexed_doc_ids, Iterable):
            raise ValueError(f"indexed_doc_ids must be a collection of doc ids, got {type(indexed_doc_ids).__name__}")
        if mode != "node":
            check_reference_doc_ids(dataset, indexed_doc_ids, allow_unmatched_references)
    retrievals = retrieve_all(retriever, dataset.queries, text_depth=max(cutoffs), show_progress=show_progress)
    if indexed_doc_ids is None and mode != "node" and not allow_unmatched_references:
        _warn_if_nothing_relevant_retrieved(dataset, retrievals)
    return score_retrievals(retrievals, dataset, ks=cutoffs, relevance=relevance)
