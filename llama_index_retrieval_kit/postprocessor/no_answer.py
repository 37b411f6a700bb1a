"""``NoAnswerPostprocessor``: a calibrated gate that returns no nodes when nothing relevant was found.

Fused RRF or min-max scores are not comparable across queries (a min-max top-1 is ~1 for every
query), so the gate reads what the retrievers keep on each result instead: each leg's raw score
and rank (dense cosine, BM25) on fused results, the node score of single-leg results, and the
reranker's probability when a reranker ran before it. From those it computes a few features per
query (:func:`retrieval_features`) and a probability that the answer is among the nodes:

    confidence = sigmoid(w . z + b),  z = (features - mean) / scale

a logistic regression on standardised features with a small L2 penalty (ridge), fitted by
Newton's method (:func:`fit_logistic`). Why logistic: its loss is a proper scoring rule, so the
output is a calibrated probability on data like the calibration set (Platt scaling is the
one-feature case of the same fit), it needs a few hundred labelled questions, not thousands,
and its weights say which signal it uses. The threshold is then chosen on the calibration
answerable questions so that ``target_answerable_recall`` of them pass
(:func:`threshold_for_recall`). The probability reflects the calibration mix of answerable and
unanswerable questions; the threshold does not depend on it.

When the gate closes inside a LlamaIndex query engine, the engine's synthesizer gets no nodes, so
the LLM is never called; :class:`NoAnswerPostprocessor` then turns LlamaIndex's bare
"Empty Response" into its ``no_answer_text`` with ``response.metadata["no_answer"] = True``, the
confidence, the threshold and the best rejected candidate (through LlamaIndex's instrumentation:
it handles the ``SynthesizeEndEvent`` of that query). Streaming and async engines behave the same.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from .._options import StrictOptions
from .._files import check_replaceable, write_text_atomic
from ..tracing import trace_gate, tracing_enabled
from .._enums import ChoiceEnum

logger = logging.getLogger(__name__)

DEFAULT_NO_ANSWER_TEXT = "I could not find the answer to this question in the indexed documents."
LEGS = ("dense", "bm25")
FORMAT = "llama_index_retrieval_kit.NoAnswerPostprocessor/1"


class FeatureSet(ChoiceEnum):
    """Which signals a gate reads; chosen by :meth:`NoAnswerPostprocessor.fit` from the results."""

    LEGS = "legs"  # fused results: each leg's raw score and rank (dense cosine, BM25)
    SCORE = "score"  # single-leg results: the node score (e.g. a dense or BM25 retriever)
    RERANK = "rerank"  # reranked results: the reranker's probability, plus the legs when present

# ------------------------------------------------------------------------------ features
#: Words too common to say whether a passage is about the question (for ``coverage_max3``).
STOPWORDS = frozenset(
    "the a an of in on and or to for with by is are was were be been what which who whom how does do did that "
    "this these those from as at it its their there than then into can may might not no my your our i you we "
    "they he she when where why will would should could has have had about".split()
)


def _query_terms(query_str: str) -> int:
    return max(1, len(set(re.findall(r"\w+", query_str.lower()))))


def content_words(text: str) -> set:
    """Lower-cased words of 3+ characters that are not stopwords."""
    return {w for w in re.findall(r"\w+", text.lower()) if len(w) > 2 and w not in STOPWORDS}


def _doc_level(values: Sequence[Tuple[float, int, str, str]]) -> List[float]:
    """Best score per document, best first (chunks of one document count once)."""
    best: Dict[str, float] = {}
    for score, _, _, doc in values:
        best.setdefault(doc, score)
    return list(best.values())


def _leg_values(nodes: Sequence[NodeWithScore], leg: str) -> List[Tuple[float, int, str, str]]:
    """(score, rank, node id, document id) of every result the leg returned, best first."""
    out = []
    for n in nodes:
        scores = getattr(n, "leg_scores", None) or {}
        ranks = getattr(n, "leg_ranks", None) or {}
        if scores.get(leg) is not None and leg in ranks:
            doc = (n.node.metadata or {}).get("doc_id") or n.node.ref_doc_id or n.node.node_id
            out.append((float(scores[leg]), int(ranks[leg]), n.node.node_id, str(doc)))
    out.sort(key=lambda t: t[1])
    return out


def _top_stats(values: Sequence[float], prefix: str) -> Dict[str, float]:
    """top-1, top-1 minus top-2 and top-1 minus top-5 of a best-first list (0 when empty)."""
    if not values:
        return {f"{prefix}_top1": 0.0, f"{prefix}_margin": 0.0, f"{prefix}_gap5": 0.0}
    top = values[0]
    return {
        f"{prefix}_top1": top,
        f"{prefix}_margin": top - (values[1] if len(values) > 1 else values[0]),
        f"{prefix}_gap5": top - values[min(4, len(values) - 1)],
    }


def rerank_probability(result: NodeWithScore) -> Optional[float]:
    """The reranker's probability of a reranked result (its score), or None if not reranked.

    A result is reranked when it carries the score it had before reranking
    (``pre_rerank_score``, as this package's reranker keeps it).
    """
    if getattr(result, "pre_rerank_score", None) is None and getattr(result, "pre_rerank_rank", None) is None:
        return None
    return None if result.score is None else float(result.score)


def score_order(nodes: Sequence[NodeWithScore]) -> List[NodeWithScore]:
    """The results best first by score (stable; results without a score last), as a retriever or a
    reranker returns them: what the gate reads, whatever order a postprocessor before it chose for
    presentation (LlamaIndex's ``LongContextReorder`` puts the second best last)."""
    return sorted(nodes, key=lambda n: (n.score is None, -(n.score or 0.0)))


def detect_feature_set(nodes: Sequence[NodeWithScore]) -> FeatureSet:
    """The richest feature set the results support."""
    if nodes and all(rerank_probability(n) is not None for n in nodes):
        return FeatureSet.RERANK
    if nodes and any(getattr(n, "leg_ranks", None) for n in nodes):
        return FeatureSet.LEGS
    return FeatureSet.SCORE


def feature_set_mismatch(fitted: FeatureSet, found: FeatureSet) -> Optional[str]:
    """Why a gate fitted on ``fitted`` results cannot read results of kind ``found`` (None: it can).

    Only results like the calibration ones give calibrated decisions: a gate fitted on a
    single-leg retriever's scores would read a fused score (not comparable across queries) or a
    reranker's probability as that score, and a gate fitted on retrieval results would read the
    reranker's top_n in its order instead of the first results it was calibrated on; either
    would pass or close silently at the wrong rate.
    """
    if fitted is found:
        return None
    if found is FeatureSet.SCORE:
        return (
            f"this gate was fitted on {fitted.value!r} results (leg scores"
            f"{' and reranker probabilities' if fitted is FeatureSet.RERANK else ''}), but these results carry "
            "none: put the gate after the same retriever (and reranker) it was calibrated with, before any "
            "ContextAssembler (its nodes carry no leg scores)"
        )
    if fitted is FeatureSet.RERANK:
        return "this gate was fitted after a reranker, but these results were not reranked: put it after the reranker"
    if fitted is FeatureSet.SCORE:
        kind = (
            "reranked (their score is the reranker's probability)"
            if found is FeatureSet.RERANK
            else "fused (their score is a fusion score, not comparable across queries)"
        )
        return (
            f"this gate was fitted on a single-leg retriever's scores ('score' results), but these results are {kind}: "
            "put the gate right after the retriever it was calibrated with (e.g. as_retriever('dense')), or "
            "calibrate it on these results"
        )
    return (
        "this gate was fitted on retrieval results ('legs'), but these results were reranked: the reranker returns "
        "its top_n in its own order, not the first results the gate was calibrated on; put the gate before the "
        "reranker (node_postprocessors=[gate, reranker, ...]), or calibrate it on reranked results"
    )


def feature_names(feature_set: FeatureSet) -> List[str]:
    """The features of a feature set, in model order."""
    legs = [f"{leg}_{s}" for leg in LEGS for s in ("top1", "margin", "gap5")] + [
        "agreement",
        "overlap10",
        "dense_of_bm25_top1",
        "dense_docmargin",
        "dense_docgap3",
        "bm25_docgap3",
        "coverage_max3",
    ]
    if feature_set is FeatureSet.LEGS:
        return legs
    if feature_set is FeatureSet.SCORE:
        return ["score_top1", "score_margin", "score_gap5"]
    return ["rerank_top1", "rerank_margin", "rerank_gap5", "rerank_mean3"] + legs


def retrieval_features(nodes: Sequence[NodeWithScore], query_str: str, feature_set: FeatureSet) -> Dict[str, float]:
    """The features of one query's results (see :func:`feature_names`).

    Per leg: top-1 score, top-1 minus top-2, top-1 minus top-5 (over the results that leg
    returned, ordered by its rank), and the same gaps between documents (a document's best
    chunk; ``docmargin``, ``docgap3``): an answer document stands out from the next documents,
    not only from its own other chunks; BM25 top-1 per distinct query term (BM25 grows with
    query length); ``agreement`` 1 when both legs rank the same chunk first; ``overlap10`` the
    share of the legs' top-10 they have in common; ``dense_of_bm25_top1`` the dense score of
    BM25's best; ``coverage_max3`` the largest share of the question's content words found in one
    of the first three results.
    """
    feats: Dict[str, float] = {}
    if feature_set is FeatureSet.SCORE:
        scores = sorted((float(n.score) for n in nodes if n.score is not None), reverse=True)
        feats.update(_top_stats(scores, "score"))
        return feats
    if feature_set is FeatureSet.RERANK:
        probs = sorted((p for p in (rerank_probability(n) for n in nodes) if p is not None), reverse=True)
        feats.update(_top_stats(probs, "rerank"))
        feats["rerank_mean3"] = float(np.mean(probs[:3])) if probs else 0.0
    per_leg = {leg: _leg_values(nodes, leg) for leg in LEGS}
    terms = _query_terms(query_str)
    # BM25 grows with the number of query terms: per term, it compares across questions
    per_leg["bm25"] = [(score / terms, rank, node_id, doc) for score, rank, node_id, doc in per_leg["bm25"]]
    for leg, values in per_leg.items():
        feats.update(_top_stats([v[0] for v in values], leg))
    dense_first = per_leg["dense"][0][2] if per_leg["dense"] and per_leg["dense"][0][1] == 1 else None
    bm25_first = per_leg["bm25"][0][2] if per_leg["bm25"] and per_leg["bm25"][0][1] == 1 else None
    feats["agreement"] = float(dense_first is not None and dense_first == bm25_first)
    top10 = [{v[2] for v in per_leg[leg] if v[1] <= 10} for leg in LEGS]
    feats["overlap10"] = len(top10[0] & top10[1]) / 10.0
    dense_by_id = {v[2]: v[0] for v in per_leg["dense"]}
    dense_floor = min(dense_by_id.values()) if dense_by_id else 0.0
    feats["dense_of_bm25_top1"] = dense_by_id.get(bm25_first, dense_floor) if bm25_first else dense_floor
    for leg, names in (("dense", ("docmargin", "docgap3")), ("bm25", ("docgap3",))):
        docs = _doc_level(per_leg[leg])
        if "docmargin" in names:
            feats[f"{leg}_docmargin"] = docs[0] - docs[1] if len(docs) > 1 else 0.0
        feats[f"{leg}_docgap3"] = docs[0] - docs[min(2, len(docs) - 1)] if docs else 0.0
    words = content_words(query_str)
    feats["coverage_max3"] = (
        max((len(words & content_words(n.node.get_content())) / len(words) for n in nodes[:3]), default=0.0) if words else 0.0
    )
    return feats


def feature_matrix(
    queries: Sequence[Tuple[str, Sequence[NodeWithScore]]], feature_set: FeatureSet
) -> np.ndarray:
    """One row of :func:`retrieval_features` per (query, results), in :func:`feature_names` order."""
    names = feature_names(feature_set)
    rows = [retrieval_features(nodes, q, feature_set) for q, nodes in queries]
    return np.array([[row[name] for name in names] for row in rows], dtype=np.float64).reshape(len(rows), len(names))


# ------------------------------------------------------------------------------ the model
def sigmoid(x: np.ndarray | float) -> np.ndarray | float:
    """1 / (1 + exp(-x)), computed without overflow."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out if out.ndim else float(out)


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = 1.0, iterations: int = 100) -> Tuple[np.ndarray, float]:
    """(weights, intercept) minimising logistic loss + ``l2``/2 * |w|^2 (intercept unpenalised).

    Newton's method (IRLS) on the full data; converges in a handful of steps for the few
    standardised features used here.
    """
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n, d = X.shape
    A = np.hstack([X, np.ones((n, 1))])
    theta = np.zeros(d + 1)
    penalty = np.full(d + 1, float(l2))
    penalty[-1] = 0.0
    for _ in range(iterations):
        p = sigmoid(A @ theta)
        grad = A.T @ (p - y) + penalty * theta
        hess = (A * (p * (1 - p))[:, None]).T @ A + np.diag(penalty) + 1e-9 * np.eye(d + 1)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    return theta[:-1], float(theta[-1])


def auroc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """Area under the ROC curve: P(positive score > negative score), ties counting 1/2
    (the Mann-Whitney U statistic divided by n_pos * n_neg)."""
    pos, neg = np.asarray(positive, dtype=np.float64), np.asarray(negative, dtype=np.float64)
    if not len(pos) or not len(neg):
        raise ValueError(f"AUROC needs both classes, got {len(pos)} positive and {len(neg)} negative scores")
    scores = np.concatenate([pos, neg])
    order = scores.argsort(kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2.0
    return float(u / (len(pos) * len(neg)))


def threshold_for_recall(answerable_confidences: Sequence[float], target: float) -> float:
    """The largest threshold t with share(confidence >= t) >= ``target`` over the answerable ones."""
    conf = np.sort(np.asarray(answerable_confidences, dtype=np.float64))
    if not len(conf):
        raise ValueError("threshold_for_recall needs at least one answerable confidence")
    allowed_below = int(math.floor((1.0 - target) * len(conf) + 1e-9))
    return float(conf[min(allowed_below, len(conf) - 1)])


def abstention_report(answerable: Sequence[float], unanswerable: Sequence[float], threshold: float) -> Dict[str, float]:
    """What a threshold does on labelled confidences: answerable kept, unanswerable abstained,
    abstention precision (share of abstentions that were right) and AUROC."""
    ans, una = np.asarray(answerable, dtype=np.float64), np.asarray(unanswerable, dtype=np.float64)
    abstained_ans = int((ans < threshold).sum())
    abstained_una = int((una < threshold).sum())
    abstained = abstained_ans + abstained_una
    return {
        "threshold": float(threshold),
        "auroc": auroc(ans, una) if len(ans) and len(una) else float("nan"),
        "answerable": int(len(ans)),
        "unanswerable": int(len(una)),
        "answerable_kept": float(1 - abstained_ans / len(ans)) if len(ans) else float("nan"),
        "abstention_recall": float(abstained_una / len(una)) if len(una) else float("nan"),
        "abstention_precision": float(abstained_una / abstained) if abstained else float("nan"),
    }


def _check_labelled(name: str, items: Any) -> List[Tuple[str, List[NodeWithScore]]]:
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{name} must be a list of (query_str, List[NodeWithScore]) pairs, got {type(items).__name__}")
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"{name}[{i}] must be a (query_str, List[NodeWithScore]) pair, got {item!r:.80}")
        nodes = list(item[1])
        if any(not isinstance(n, NodeWithScore) for n in nodes):
            raise ValueError(f"{name}[{i}]: results must be NodeWithScore objects as a retriever returns them")
        out.append((item[0], nodes))
    return out


# ------------------------------------------------------------------------------ abstention in query engines
@dataclass(frozen=True)
class GateDecision:
    """A closed gate: what the response of that query reports."""

    query_str: str
    text: str
    confidence: float
    threshold: float
    best_rejected: Optional[Dict[str, Any]]
    retrieval_since: bool = False  # a retrieval started after the gate closed (another query's)

    def metadata(self) -> Dict[str, Any]:
        return {
            "no_answer": True,
            "no_answer_confidence": self.confidence,
            "no_answer_threshold": self.threshold,
            "best_rejected": self.best_rejected,
        }


_CLOSED: contextvars.ContextVar[Optional[GateDecision]] = contextvars.ContextVar("rkit_no_answer", default=None)
# The metadata of a decision applied to a synthesis in this request, for the chat response that wraps it.
_APPLIED: contextvars.ContextVar[Optional[Dict[str, Any]]] = contextvars.ContextVar("rkit_no_answer_applied", default=None)
_HANDLER_LOCK = threading.Lock()
_HANDLER_INSTALLED = False


def _query_text(query: Any) -> str:
    return query.query_str if isinstance(query, QueryBundle) else str(query)


def _install_response_handler() -> None:
    """Register (once per process) the instrumentation handler that turns an empty synthesis
    after a closed gate into the gate's no-answer response."""
    global _HANDLER_INSTALLED
    with _HANDLER_LOCK:
        if _HANDLER_INSTALLED:
            return
        from llama_index.core.instrumentation import get_dispatcher
        from llama_index.core.instrumentation.event_handlers import BaseEventHandler
        from llama_index.core.instrumentation.events.retrieval import RetrievalStartEvent
        from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent

        class NoAnswerResponseHandler(BaseEventHandler):
            """Fills the response of a query whose no-answer gate closed (see no_answer.py)."""

            @classmethod
            def class_name(cls) -> str:
                return "NoAnswerResponseHandler"

            def handle(self, event: Any, **kwargs: Any) -> Any:
                if isinstance(event, SynthesizeEndEvent):
                    apply_decision(event.query, event.response)
                elif isinstance(event, RetrievalStartEvent):
                    _mark_retrieval_started()

        from llama_index.core.base.base_query_engine import BaseQueryEngine
        from llama_index.core.base.base_retriever import BaseRetriever
        from llama_index.core.chat_engine.types import BaseChatEngine
        from llama_index.core.instrumentation.span_handlers import BaseSpanHandler

        request_starts = (BaseRetriever, BaseQueryEngine, BaseChatEngine)

        class NoAnswerScopeHandler(BaseSpanHandler):
            """Ends a closed gate's decision with its request: a new top-level retrieval, query or
            chat (a span without a parent) discards it (see :func:`_discard_at_new_request`)."""

            @classmethod
            def class_name(cls) -> str:
                return "NoAnswerScopeHandler"

            def new_span(self, id_: str, bound_args: Any, instance: Any = None, parent_span_id: Optional[str] = None, tags: Any = None, **kwargs: Any) -> None:
                if parent_span_id is None and isinstance(instance, request_starts):
                    _discard_at_new_request()
                return None

            def prepare_to_exit_span(self, id_: str, bound_args: Any, instance: Any = None, result: Any = None, **kwargs: Any) -> None:
                if isinstance(instance, BaseChatEngine):
                    mark_chat_response(result)
                return None

            def prepare_to_drop_span(self, id_: str, bound_args: Any, instance: Any = None, err: Any = None, **kwargs: Any) -> None:
                return None

        dispatcher = get_dispatcher()
        dispatcher.add_event_handler(NoAnswerResponseHandler())
        dispatcher.add_span_handler(NoAnswerScopeHandler())
        _HANDLER_INSTALLED = True


def _discard_at_new_request() -> None:
    """A top-level retrieval, query or chat started (a span without a parent): a new request.

    A closed gate's decision lives in the caller's context (a ContextVar), which a server's
    worker thread keeps from one request to the next. It is meant for the synthesis that follows
    the gate in the same request: inside a query engine that synthesis is a child of the query's
    span; a chat engine (``CondensePlusContextChatEngine``) calls its retriever, postprocessors
    and synthesizer one after another, each at the top level, the retrieval before the gate. So
    a top-level retrieval, query or chat starts another request, and the decision is discarded:
    it never answers (nor shows its best rejected text to) another request, whatever its question.
    """
    if _CLOSED.get() is not None:
        _CLOSED.set(None)
    if _APPLIED.get() is not None:
        _APPLIED.set(None)


def _mark_retrieval_started() -> None:
    """A retrieval started: a closed gate's decision now answers only a synthesis of its own question."""
    decision = _CLOSED.get()
    if decision is not None and not decision.retrieval_since:
        _CLOSED.set(dataclasses.replace(decision, retrieval_since=True))


def apply_decision(query: Any, response: Any) -> bool:
    """Turn ``response`` (an empty synthesis of ``query``) into the closed gate's answer.

    The synthesis belongs to the gate's query when it asks the same question, or when no
    retrieval started since the gate closed: chat engines (``CondensePlusContextChatEngine``)
    retrieve with a rewritten question and then synthesize the user's message. Returns True when
    it did; a response with source nodes, or of another query, is left alone.
    """
    decision = _CLOSED.get()
    if decision is None or getattr(response, "source_nodes", None):
        return False
    if decision.query_str != _query_text(query) and decision.retrieval_since:
        return False
    _CLOSED.set(None)
    _APPLIED.set(decision.metadata())
    response.metadata = {**(getattr(response, "metadata", None) or {}), **decision.metadata()}
    if hasattr(response, "response_gen") and response.response_gen is not None:
        text = decision.text
        if hasattr(response.response_gen, "__anext__"):

            async def agen() -> Any:
                yield text

            response.response_gen = agen()
        else:
            response.response_gen = iter([text])
        if hasattr(response, "response_txt"):
            response.response_txt = None
    else:
        response.response = decision.text
    return True


def mark_chat_response(response: Any) -> bool:
    """Give a chat engine's response (``AgentChatResponse``) the no-answer metadata of the gate
    decision its synthesis answered with in this request (the query engine's ``Response`` gets it
    from :func:`apply_decision`; a chat engine builds its own response from the synthesis' text).
    True when it did; a response without ``metadata`` (streaming chat) is left alone."""
    applied = _APPLIED.get()
    if applied is None or not hasattr(response, "metadata"):
        return False
    _APPLIED.set(None)
    response.metadata = {**(response.metadata or {}), **applied}
    return True


def _describe(result: NodeWithScore) -> Dict[str, Any]:
    meta = result.node.metadata or {}
    return {
        "node_id": result.node.node_id,
        "doc_id": meta.get("doc_id") or result.node.ref_doc_id,
        "section": meta.get("section_header"),
        "score": None if result.score is None else float(result.score),
        "text": result.node.get_content()[:300],
    }


# ------------------------------------------------------------------------------ the postprocessor
class NoAnswerPostprocessor(StrictOptions, BaseNodePostprocessor):
    """Return no nodes when the answer is probably not among them (calibrated on labelled data).

    Build one with :meth:`fit` (labelled results) or :meth:`calibrate` (a retriever and a
    labelled dataset), or :meth:`load` a saved one. ``confidence(nodes, query_str)`` is the
    probability that the answer is among ``nodes``; ``postprocess_nodes`` returns ``[]`` below
    ``threshold`` and the nodes unchanged otherwise. ``similarity_cutoff`` additionally drops
    single nodes scoring below it (LlamaIndex ``SimilarityPostprocessor``'s behaviour); a gate
    with a cutoff and no fitted model does only that.
    """

    threshold: float = Field(default=0.5, ge=0.0, le=1.0, description="Abstain when confidence < threshold.")
    feature_set: Optional[str] = Field(default=None, description="Signals the model reads: legs, score or rerank (set by fit).")
    feature_names: List[str] = Field(default_factory=list, description="Feature order of the model (set by fit).")
    coefficients: List[float] = Field(default_factory=list, description="Logistic weights on standardised features.")
    intercept: float = Field(default=0.0, description="Logistic intercept.")
    feature_means: List[float] = Field(default_factory=list, description="Standardisation: feature means on the fit data.")
    feature_scales: List[float] = Field(default_factory=list, description="Standardisation: feature standard deviations.")
    min_top_score: Optional[float] = Field(
        default=None,
        description="Out-of-range guard: below this top-1 evidence score (dense top-1 for fused results, the "
        "score or reranker probability otherwise) the confidence is 0. Set by fit to a low quantile of the "
        "answerable questions' scores: questions unlike anything calibrated (off-topic) never pass on the model's "
        "extrapolation.",
    )
    similarity_cutoff: Optional[float] = Field(
        default=None, description="Optional per-node cutoff on node.score (LlamaIndex SimilarityPostprocessor behaviour)."
    )
    feature_top_k: Optional[int] = Field(
        default=None,
        ge=1,
        description="The model reads the best this many results of a query by score (set by fit: the most results a calibration "
        "query had); later ones pass through unread, so a larger similarity_top_k than at calibration leaves the "
        "confidence unchanged. None (gates saved before this field): every result given.",
    )
    no_answer_text: str = Field(default=DEFAULT_NO_ANSWER_TEXT, description="Response text when the gate closes in a query engine.")
    fit_report: Optional[Dict[str, Any]] = Field(default=None, description="Calibration report: AUROC, abstention precision/recall, threshold.")

    @classmethod
    def class_name(cls) -> str:
        return "NoAnswerPostprocessor"

    def model_post_init(self, __context: Any) -> None:
        super().model_post_init(__context)
        n = len(self.feature_names)
        if any(len(v) != n for v in (self.coefficients, self.feature_means, self.feature_scales)):
            raise ValueError(
                f"feature_names ({n}), coefficients ({len(self.coefficients)}), feature_means "
                f"({len(self.feature_means)}) and feature_scales ({len(self.feature_scales)}) must have the same length"
            )
        if n:
            expected = feature_names(FeatureSet.from_str(self.feature_set or ""))
            if list(self.feature_names) != expected:
                raise ValueError(f"feature_names {self.feature_names} do not match feature set {self.feature_set!r} ({expected})")
        _install_response_handler()

    # ----------------------------------------------------------------- fitting
    @classmethod
    def fit(
        cls,
        answerable: Sequence[Tuple[str, Sequence[NodeWithScore]]],
        unanswerable: Sequence[Tuple[str, Sequence[NodeWithScore]]],
        target_answerable_recall: float = 0.95,
        l2: float = 10.0,
        floor_quantile: float = 0.01,
        **kwargs: Any,
    ) -> "NoAnswerPostprocessor":
        """Fit the probability model and the threshold that keeps ``target_answerable_recall``.

        ``answerable``/``unanswerable``: ``(query_str, results)`` pairs, results as a retriever
        (or retriever + reranker) of this package returned them. Other keywords are fields
        (``no_answer_text``, ``similarity_cutoff``, ``feature_top_k``). The fit report is in ``fit_report``.

        The model reads the best ``feature_top_k`` results of a query by score (:func:`score_order`;
        default: the most results a calibration query had), here and when it gates: its features (score gaps down to rank 5,
        the legs' top-10 overlap, ...) depend on how many results it sees, and a gate calibrated on
        8 results per query and then given 30 kept 17 of the bundled 30 answerable questions
        instead of 29. Raising ``similarity_top_k`` later leaves its decisions unchanged.
        """
        if isinstance(target_answerable_recall, bool) or not 0.0 < float(target_answerable_recall) <= 1.0:
            raise ValueError(f"target_answerable_recall must be in (0, 1], got {target_answerable_recall!r}")
        if isinstance(l2, bool) or not float(l2) >= 0.0:
            raise ValueError(f"l2 must be >= 0, got {l2!r}")
        if isinstance(floor_quantile, bool) or not 0.0 <= float(floor_quantile) < 1.0 - float(target_answerable_recall) + 1e-9:
            raise ValueError(
                f"floor_quantile must be in [0, 1 - target_answerable_recall] = [0, {1 - float(target_answerable_recall):.3f}], "
                f"got {floor_quantile!r}"
            )
        ans = _check_labelled("answerable", answerable)
        una = _check_labelled("unanswerable", unanswerable)
        if len(ans) < 2 or len(una) < 2:
            raise ValueError(
                f"fit needs at least 2 answerable and 2 unanswerable questions, got {len(ans)} and {len(una)} "
                "(a few hundred of each give a stable threshold)"
            )
        top_k = kwargs.pop("feature_top_k", None)
        if top_k is None:
            top_k = max(1, max(len(nodes) for _, nodes in ans + una))
        elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"feature_top_k must be a positive int (results the model reads per query), got {top_k!r}")
        kwargs["feature_top_k"] = top_k
        ans = [(q, score_order(nodes)[:top_k]) for q, nodes in ans]
        una = [(q, score_order(nodes)[:top_k]) for q, nodes in una]
        feature_set = _common_feature_set([nodes for _, nodes in ans + una])
        X = feature_matrix(ans + una, feature_set)
        y = np.array([1.0] * len(ans) + [0.0] * len(una))
        means = X.mean(axis=0)
        scales = X.std(axis=0)
        scales[scales < 1e-12] = 1.0
        w, b = fit_logistic((X - means) / scales, y, l2=float(l2))
        gate = cls(
            feature_set=feature_set.value,
            feature_names=feature_names(feature_set),
            coefficients=[float(v) for v in w],
            intercept=b,
            feature_means=[float(v) for v in means],
            feature_scales=[float(v) for v in scales],
            **kwargs,
        )
        anchor = X[:, 0]  # the first feature is the top-1 evidence score of every feature set
        if float(floor_quantile) > 0:
            # An observed score (method="lower"), never one interpolated above the lowest answerable
            # question: on a small set that question would get confidence 0 and pull the threshold to 0.
            gate.min_top_score = float(np.quantile(anchor[: len(ans)], float(floor_quantile), method="lower"))
        conf = gate._confidences(X)
        threshold = threshold_for_recall(conf[: len(ans)], float(target_answerable_recall))
        gate.threshold = threshold
        report = abstention_report(conf[: len(ans)], conf[len(ans) :], threshold)
        report["target_answerable_recall"] = float(target_answerable_recall)
        report["model"] = "logistic regression on standardised retrieval features (L2, Newton), threshold by answerable recall"
        report["feature_weights"] = dict(zip(gate.feature_names, gate.coefficients))
        gate.fit_report = report
        logger.info(
            "no-answer gate fitted on %d answerable / %d unanswerable: AUROC %.3f, threshold %.3f, "
            "answerable kept %.3f, unanswerable abstained %.3f",
            len(ans), len(una), report["auroc"], threshold, report["answerable_kept"], report["abstention_recall"],
        )
        return gate

    @classmethod
    def calibrate(
        cls,
        retriever: Any,
        dataset: Any,
        target_answerable_recall: float = 0.95,
        exclusion_retriever: Optional[Callable[[Any], Any]] = None,
        doc_id_key: str = "doc_id",
        max_queries: Optional[int] = None,
        show_progress: bool = False,
        **kwargs: Any,
    ) -> "NoAnswerPostprocessor":
        """Run ``retriever`` over a labelled ``RetrievalDataset`` and :meth:`fit`.

        Questions with references are answerable, those without are unanswerable. With
        ``exclusion_retriever`` (filters -> retriever, e.g.
        ``lambda f: index.as_retriever("hybrid", filters=f)``) each answerable question is also
        asked with its relevant documents filtered out (``doc_id_key`` NIN the relevant ids, a
        filter every leg applies): in-domain, hard unanswerable questions for users who have only
        answerable ones.
        """
        from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters

        answerable_ids = dataset.answerable_ids()
        no_answer_ids = dataset.no_answer_ids()
        if max_queries is not None:
            answerable_ids, no_answer_ids = answerable_ids[:max_queries], no_answer_ids[:max_queries]
        ids = answerable_ids + no_answer_ids
        iterator: Iterable[str] = ids
        if show_progress:
            from tqdm.auto import tqdm

            iterator = tqdm(ids, desc="Calibrating (retrieving)", unit="query")
        results = {qid: retriever.retrieve(dataset.queries[qid]) for qid in iterator}
        answerable = [(dataset.queries[q], results[q]) for q in answerable_ids]
        unanswerable = [(dataset.queries[q], results[q]) for q in no_answer_ids]
        if exclusion_retriever is not None:
            for qid in answerable_ids:
                relevant = sorted(d for d, rel in dataset.qrels.get(qid, {}).items() if rel > 0)
                if not relevant:
                    continue
                exclude = MetadataFilters(filters=[MetadataFilter(key=doc_id_key, value=relevant, operator=FilterOperator.NIN)])
                unanswerable.append((dataset.queries[qid], exclusion_retriever(exclude).retrieve(dataset.queries[qid])))
        return cls.fit(answerable, unanswerable, target_answerable_recall=target_answerable_recall, **kwargs)

    # ----------------------------------------------------------------- inference
    @property
    def is_fitted(self) -> bool:
        return bool(self.feature_names)

    def _confidences(self, X: np.ndarray) -> np.ndarray:
        """Model probability per row, 0 where the top-1 evidence score is below ``min_top_score``."""
        z = (X - np.asarray(self.feature_means)) / np.asarray(self.feature_scales)
        conf = np.asarray(sigmoid(z @ np.asarray(self.coefficients) + self.intercept), dtype=np.float64).reshape(-1)
        if self.min_top_score is not None:
            conf = np.where(X[:, 0] < self.min_top_score, 0.0, conf)
        return conf

    def confidence(self, nodes: Sequence[NodeWithScore], query_str: str) -> float:
        """Probability in [0, 1] that the answer is among ``nodes`` (0 for no nodes)."""
        if not self.is_fitted:
            raise ValueError(
                "this NoAnswerPostprocessor has no fitted model: build it with NoAnswerPostprocessor.fit(...), "
                ".calibrate(retriever, dataset) or .load(path)"
            )
        # the best feature_top_k by score, as calibrated (see fit); later ones unread, presentation order ignored
        nodes = score_order(nodes)[: self.feature_top_k]
        if not nodes:
            return 0.0
        feature_set = FeatureSet.from_str(self.feature_set or "")
        problem = feature_set_mismatch(feature_set, detect_feature_set(nodes))
        if problem is not None:
            raise ValueError(problem)
        return float(self._confidences(feature_matrix([(query_str, nodes)], feature_set))[0])

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        if not tracing_enabled():
            return self._gate(nodes, query_bundle)[0]
        started = time.perf_counter()
        kept, conf = self._gate(nodes, query_bundle)
        trace_gate(self, nodes, kept, query_bundle, started, confidence=conf)
        return kept

    def _gate(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> Tuple[List[NodeWithScore], Optional[float]]:
        """The gate's decision: ``[]`` when closed, else the nodes (minus those below
        ``similarity_cutoff``); and the confidence it read (None without a fitted model).

        The confidence is returned, never kept on the gate: one gate serves concurrent queries
        (a thread pool), and each query's trace must record its own."""
        query_str = query_bundle.query_str if query_bundle is not None else ""
        kept = list(nodes)
        if self.similarity_cutoff is not None:
            kept = [n for n in kept if n.score is not None and n.score >= self.similarity_cutoff]
        if not self.is_fitted:
            if self.similarity_cutoff is None:
                raise ValueError(
                    "this NoAnswerPostprocessor has neither a fitted model nor a similarity_cutoff: fit, calibrate or load it"
                )
            if nodes and not kept:
                self._close(query_str, None, nodes)
            return kept, None
        conf = self.confidence(nodes, query_str)
        if conf < self.threshold or (nodes and not kept):
            self._close(query_str, conf, nodes)
            logger.debug("no-answer gate closed for %r: confidence %.3f < %.3f", query_str[:80], conf, self.threshold)
            return [], conf
        _CLOSED.set(None)
        return kept, conf

    async def _apostprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        # In the caller's task, not a worker thread (LlamaIndex's default): the decision must be
        # visible to the synthesis step of the same query, and the features cost microseconds.
        return self._postprocess_nodes(nodes, query_bundle)

    def _close(self, query_str: str, conf: Optional[float], nodes: Sequence[NodeWithScore]) -> None:
        best = _describe(score_order(nodes)[0]) if nodes else None
        _CLOSED.set(GateDecision(query_str, self.no_answer_text, float(conf if conf is not None else 0.0), self.threshold, best))

    # ----------------------------------------------------------------- persistence
    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the gate as JSON (no pickle), replacing ``path`` whole (a crash leaves the earlier file).

        A gate saved there before is replaced (calibrating again); any other existing file (a
        dataset, a config, notes) is refused with a ValueError unless ``overwrite=True``."""
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
        path = Path(path)
        check_gate_target(path, overwrite)
        data = {"format": FORMAT, **self.to_dict()}
        return write_text_atomic(path, json.dumps(data, indent=2, allow_nan=True))

    @classmethod
    def load(cls, path: str | Path) -> "NoAnswerPostprocessor":
        """Read a gate written by :meth:`save`."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such gate file (write one with gate.save(path) or `rkit calibrate`)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a saved NoAnswerPostprocessor (invalid JSON: {exc})") from None
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            raise ValueError(f"{path}: not a saved NoAnswerPostprocessor (expected format {FORMAT!r})")
        gate = cls.from_dict(data)
        if gate.is_fitted and gate.feature_top_k is None:
            logger.warning(
                "%s was saved before gates recorded feature_top_k: it reads every result it is given, so it keeps its "
                "calibrated recall only at the similarity_top_k it was calibrated with; calibrate it again (or set "
                "gate.feature_top_k to that similarity_top_k)", path,
            )
        return gate


#: Bytes of a file read to tell whether it is a saved gate (a gate is a few KB).
_GATE_FILE_MAX_BYTES = 1 << 20


def is_saved_gate(path: str | Path) -> bool:
    """Whether ``path`` holds a gate written by :meth:`NoAnswerPostprocessor.save` (a JSON object
    naming :data:`FORMAT`); False for anything else, unreadable or larger than a gate can be."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_GATE_FILE_MAX_BYTES + 1)
        data = json.loads(head) if len(head) <= _GATE_FILE_MAX_BYTES else None
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_gate_target(path: str | Path, overwrite: bool = False) -> None:
    """Refuse (ValueError) a folder, or a gate file path holding something other than a saved
    gate unless ``overwrite``: :meth:`NoAnswerPostprocessor.save` would replace it."""
    check_replaceable(path, is_saved_gate, "a saved no-answer gate", "overwrite=True (rkit calibrate --overwrite)", overwrite)


def _common_feature_set(results: Sequence[Sequence[NodeWithScore]]) -> FeatureSet:
    """The feature set every non-empty result list supports (refuse a mix that cannot be compared)."""
    sets = {detect_feature_set(nodes) for nodes in results if nodes}
    if not sets:
        raise ValueError("every result list is empty: nothing to calibrate on")
    if len(sets) == 1:
        return sets.pop()
    if sets == {FeatureSet.RERANK, FeatureSet.LEGS} or FeatureSet.SCORE in sets:
        raise ValueError(
            f"results mix {sorted(s.value for s in sets)}: calibrate on results of one pipeline (same retriever, "
            "reranker or not)"
        )
    return sets.pop()  # pragma: no cover
