"""Rank fusion of several ranked result lists: reciprocal rank fusion, normalised score fusion,
and (over one index's arrays) z-scored exact-score fusion with a feedback leg.

Both functions are pure: they never change the ``NodeWithScore`` objects or nodes they are given.
They return new :class:`FusedNodeWithScore` objects that point at the same node objects and record,
per leg, the rank (from 1) and the raw score the node had there, so later stages (tracing, a
no-answer gate) can see why a node was ranked where it is.

Identity is the node id. Each input list is taken in the order given (best first); a node id that
appears twice in one list keeps its first (best) position. Sums use ``math.fsum``, which is
correctly rounded and therefore independent of the order of the legs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import BaseNode, NodeWithScore

from .._enums import ChoiceEnum
from .._models import assemble

logger = logging.getLogger(__name__)

DEFAULT_RRF_K = 60.0
FUSION_MODES = ("rrf", "score")

#: ``IndexFusion.FEEDBACK`` defaults (chosen on SciFact train + NFCorpus train/dev only,
#: benchmarks/default_fusion.py): legs ``[bm25, dense, feedback]``, each leg's depth, and how many
#: of the first pass's best chunks make the feedback query.
DEFAULT_FEEDBACK_WEIGHTS = (0.3, 0.3, 0.4)
DEFAULT_FEEDBACK_DEPTH = 200
FEEDBACK_TOP_M = 1


class IndexFusion(ChoiceEnum):
    """How ``FusedIndexRetriever`` fuses the legs of one index.

    * ``feedback`` (the default of ``mode="hybrid"``): candidates = the union of the BM25 and
      dense top ``depth``, every candidate scored exactly by both legs; the best chunk of a first
      z-scored fusion becomes a second dense query (pseudo-relevance feedback in embedding space),
      whose top ``depth`` join the candidates; final score :func:`fuse_exact_scores` of the three
      legs, weights ``[bm25, dense, feedback]`` (default 0.3 / 0.3 / 0.4);
    * ``score``: min-max score fusion of the two legs (:func:`score_fusion`; ``"hybrid_score"``);
    * ``rrf``: reciprocal rank fusion of the two legs (:func:`reciprocal_rank_fusion`).
    """

    FEEDBACK = "feedback"
    SCORE = "score"
    RRF = "rrf"


class FusedNodeWithScore(NodeWithScore):
    """A fused result: the node, its fused score, and the rank and score it had in each leg."""

    leg_ranks: Dict[str, int] = Field(
        default_factory=dict,
        description="Rank (1 = best) of the node in each leg that returned it, keyed by leg name.",
    )
    leg_scores: Dict[str, Optional[float]] = Field(
        default_factory=dict,
        description="Raw score the leg gave the node (None when the leg returned no score), keyed by leg name.",
    )

    @classmethod
    def class_name(cls) -> str:
        return "FusedNodeWithScore"

    @classmethod
    def trusted(
        cls, node: BaseNode, score: float, leg_ranks: Dict[str, int], leg_scores: Dict[str, Optional[float]]
    ) -> "FusedNodeWithScore":
        """A result built from values valid by construction (a node object, a float, the two
        dicts, which the result then owns), without pydantic's validation: the same object
        ``FusedNodeWithScore(node=..., score=..., ...)`` makes, in half the time."""
        values = {"node": node, "score": score, "leg_ranks": leg_ranks, "leg_scores": leg_scores}
        return assemble(cls, values, {"node", "score", "leg_ranks", "leg_scores"})


@dataclass
class _Candidate:
    """A node seen in at least one leg, with what each leg said about it."""

    node: BaseNode
    leg_ranks: Dict[str, int] = field(default_factory=dict)
    leg_scores: Dict[str, Optional[float]] = field(default_factory=dict)


def leg_names(n_legs: int, names: Optional[Sequence[str]] = None) -> List[str]:
    """The leg names: ``names`` checked (unique, one per leg) or ``leg0``, ``leg1``, ..."""
    if names is None:
        return [f"leg{i}" for i in range(n_legs)]
    names = list(names)
    if len(names) != n_legs:
        raise ValueError(f"names has {len(names)} entries ({names!r}); expected one per leg ({n_legs})")
    if any(not isinstance(name, str) or not name for name in names):
        raise ValueError(f"names must be non-empty strings, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"names must be unique, got {names!r}")
    return names


def check_weights(n_legs: int, weights: Optional[Sequence[float]]) -> List[float]:
    """The leg weights: ``weights`` checked (one per leg, finite, >= 0) or all 1.0."""
    if weights is None:
        return [1.0] * n_legs
    weights = [float(w) for w in weights]
    if len(weights) != n_legs:
        raise ValueError(f"weights has {len(weights)} entries ({weights!r}); expected one per leg ({n_legs})")
    bad = [w for w in weights if not math.isfinite(w) or w < 0]
    if bad:
        raise ValueError(f"weights must be finite and >= 0, got {weights!r}")
    return weights


def check_rrf_k(k: float) -> float:
    """The RRF offset ``k`` as a float, checked to be finite and >= 0."""
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 0:
        raise ValueError(f"RRF k must be a finite number >= 0, got {k!r}")
    return float(k)


def fusion_attributes(mode: str, similarity_top_k: int, weights: Sequence[float], rrf_k: float) -> Dict[str, Any]:
    """A fusion's settings as a trace records them: ``mode``, ``similarity_top_k``, ``weights``
    and, in ``"rrf"`` mode, ``rrf_k``."""
    attributes: Dict[str, Any] = {"mode": mode, "similarity_top_k": similarity_top_k, "weights": list(weights)}
    if mode == "rrf":
        attributes["rrf_k"] = rrf_k
    return attributes


def _check_top_k(top_k: Optional[int]) -> None:
    if top_k is None:
        return
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


def _collect(ranked_lists: Sequence[Sequence[NodeWithScore]], names: List[str]) -> Dict[str, _Candidate]:
    """Group the legs' results by node id; the node object comes from the first leg that has it."""
    candidates: Dict[str, _Candidate] = {}
    for name, results in zip(names, ranked_lists):
        rank = 0
        for result in results:
            if not isinstance(result, NodeWithScore):
                raise ValueError(f"leg {name!r} holds {type(result).__name__}; expected NodeWithScore objects")
            node_id = result.node.node_id
            candidate = candidates.get(node_id)
            if candidate is not None and name in candidate.leg_ranks:
                logger.debug("leg %s returned node %s twice; keeping its best rank", name, node_id)
                continue
            rank += 1
            if candidate is None:
                candidate = candidates[node_id] = _Candidate(node=result.node)
            candidate.leg_ranks[name] = rank
            candidate.leg_scores[name] = result.score
    return candidates


def _fuse(
    candidates: Dict[str, _Candidate],
    names: List[str],
    weights: List[float],
    top_k: Optional[int],
    score_fn: Callable[[str, _Candidate], float],
) -> List[NodeWithScore]:
    """Score every candidate with ``score_fn`` and sort deterministically.

    Order: fused score (high first), then the best rank in a positively weighted leg (documents
    only zero-weight legs returned come last), then node id. Zero-weight legs never influence the
    order, so a zero weight really removes a leg.
    """
    weight_of = dict(zip(names, weights))
    scored = []
    for node_id, candidate in candidates.items():
        weighted_ranks = [r for leg, r in candidate.leg_ranks.items() if weight_of[leg] > 0]
        best_weighted = min(weighted_ranks) if weighted_ranks else math.inf
        score = score_fn(node_id, candidate)
        scored.append(((-score, best_weighted, node_id), score, candidate))
    scored.sort(key=lambda item: item[0])
    if top_k is not None:
        scored = scored[:top_k]
    return [
        FusedNodeWithScore(
            node=candidate.node,
            score=score,
            leg_ranks=dict(candidate.leg_ranks),
            leg_scores=dict(candidate.leg_scores),
        )
        for _, score, candidate in scored
    ]


def reciprocal_rank_fusion(
    ranked_lists: Sequence[Sequence[NodeWithScore]],
    k: float = DEFAULT_RRF_K,
    weights: Optional[Sequence[float]] = None,
    top_k: Optional[int] = None,
    names: Optional[Sequence[str]] = None,
) -> List[NodeWithScore]:
    """Fuse ranked lists with weighted reciprocal rank fusion (Cormack, Clarke & Buettcher, 2009).

    ``score(d) = sum over legs of w_leg / (k + rank_leg(d))`` with ranks starting at 1; a leg that
    did not return ``d`` adds nothing. Only ranks matter, so legs with incomparable score scales
    (BM25 vs cosine) fuse without normalisation.

    Note: Qdrant's server-side RRF scores ``1 / (k_q + position)`` with positions counted from 0,
    i.e. ``1 / (k_q - 1 + rank)``; its ``k`` is offset by one from this convention: Qdrant
    ``k = 61`` equals ``k = 60`` here, and Qdrant's default ``k = 2`` equals ``k = 1`` here.

    A document returned only by zero-weight legs gets score 0.0 and is ranked after every document
    a weighted leg returned. Ties are broken by the best rank in a weighted leg, then node id.

    Args:
        ranked_lists: One list per leg, best first.
        k: Rank offset (>= 0); larger values flatten the difference between top ranks.
        weights: One weight (>= 0) per leg; default 1.0 each.
        top_k: Keep only the best ``top_k`` results (>= 1); default all.
        names: Leg names used in ``leg_ranks``/``leg_scores``; default ``leg0``, ``leg1``, ...

    Returns:
        New :class:`FusedNodeWithScore` objects, best first, pointing at the caller's node objects.
    """
    k = check_rrf_k(k)
    _check_top_k(top_k)
    legs = leg_names(len(ranked_lists), names)
    leg_weights = check_weights(len(ranked_lists), weights)
    weight_of = dict(zip(legs, leg_weights))

    def rrf_score(node_id: str, candidate: _Candidate) -> float:
        return math.fsum(weight_of[leg] / (k + rank) for leg, rank in candidate.leg_ranks.items())

    return _fuse(_collect(ranked_lists, legs), legs, leg_weights, top_k, rrf_score)


def min_max_normalise(scores: Sequence[float]) -> List[float]:
    """Scale scores to [0, 1] by ``(s - min) / (max - min)``; all-equal scores map to 1.0."""
    if not scores:
        return []
    low, high = min(scores), max(scores)
    if high == low:
        return [1.0] * len(scores)
    return [(s - low) / (high - low) for s in scores]


def score_fusion(
    ranked_lists: Sequence[Sequence[NodeWithScore]],
    weights: Optional[Sequence[float]] = None,
    top_k: Optional[int] = None,
    names: Optional[Sequence[str]] = None,
) -> List[NodeWithScore]:
    """Fuse ranked lists by a convex combination of per-leg min-max normalised scores.

    Each leg's scores are scaled to [0, 1] over the results that leg returned (a leg whose
    results all share one score gives them all 1.0). ``score(d) = sum over legs of
    (w_leg / sum(w)) * norm_leg(d)``, where a document the leg did not return counts 0 for that
    leg. Unlike RRF this keeps score gaps, but depends on each leg's result depth and outliers.

    Args:
        ranked_lists: One list per leg, best first; every result needs a finite score.
        weights: One weight (>= 0) per leg, normalised to sum to 1; default equal. All-zero weights
            give every document score 0.0.
        top_k: Keep only the best ``top_k`` results (>= 1); default all.
        names: Leg names used in ``leg_ranks``/``leg_scores``; default ``leg0``, ``leg1``, ...

    Returns:
        New :class:`FusedNodeWithScore` objects, best first, pointing at the caller's node objects.
    """
    _check_top_k(top_k)
    legs = leg_names(len(ranked_lists), names)
    leg_weights = check_weights(len(ranked_lists), weights)
    total = math.fsum(leg_weights)
    share = {leg: (w / total if total > 0 else 0.0) for leg, w in zip(legs, leg_weights)}

    candidates = _collect(ranked_lists, legs)
    normalised: Dict[str, Dict[str, float]] = {}
    for leg in legs:
        in_leg = [(node_id, c.leg_scores[leg]) for node_id, c in candidates.items() if leg in c.leg_ranks]
        bad = [(node_id, s) for node_id, s in in_leg if s is None or not math.isfinite(s)]
        if bad:
            raise ValueError(
                f"score_fusion needs a finite score for every result; leg {leg!r} gave {bad[:3]!r}. "
                "Use reciprocal_rank_fusion for legs without scores."
            )
        values = min_max_normalise([float(s) for _, s in in_leg])  # type: ignore[arg-type]
        normalised[leg] = {node_id: v for (node_id, _), v in zip(in_leg, values)}

    def convex_score(node_id: str, candidate: _Candidate) -> float:
        return math.fsum(share[leg] * normalised[leg][node_id] for leg in candidate.leg_ranks)

    return _fuse(candidates, legs, leg_weights, top_k, convex_score)


def fuse_positions(
    legs: Sequence[Tuple[np.ndarray, np.ndarray]],
    id_order: np.ndarray,
    mode: str = "rrf",
    k: float = DEFAULT_RRF_K,
    weights: Optional[Sequence[float]] = None,
    top_k: Optional[int] = None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Array form of :func:`reciprocal_rank_fusion` / :func:`score_fusion` for legs over one index.

    Each leg is ``(positions, scores)``: distinct integer positions of nodes in a shared index,
    best first, with their scores. ``id_order[p]`` is the rank of position ``p``'s node id among
    all node ids, so ties break exactly as the object functions break them (by node id). For two
    legs the fused scores are bit-identical to those functions (a sum of two terms is correctly
    rounded either way); no node objects are touched, which is what makes it fast.

    Returns ``(positions, fused_scores, ranks, scores)`` best first, cut to ``top_k``; ``ranks``
    and ``scores`` have one row per leg (rank 0 and score NaN where the leg did not return it).
    """
    if mode not in FUSION_MODES:
        raise ValueError(f"mode {mode!r} is not supported; use one of {FUSION_MODES}")
    k = check_rrf_k(k)
    _check_top_k(top_k)
    leg_weights = check_weights(len(legs), weights)
    pos_lists = [np.asarray(p, dtype=np.int64) for p, _ in legs]
    score_lists = [np.asarray(s, dtype=np.float64) for _, s in legs]
    for i, (p, s) in enumerate(zip(pos_lists, score_lists)):
        if p.shape != s.shape or p.ndim != 1:
            raise ValueError(f"leg {i}: positions {p.shape} and scores {s.shape} must be 1-D and the same length")
        if len(np.unique(p)) != len(p):
            raise ValueError(f"leg {i} returns a position twice; positions must be distinct")
        if mode == "score" and not np.all(np.isfinite(s)):
            raise ValueError(f"score fusion needs finite scores; leg {i} has {s[~np.isfinite(s)][:3].tolist()}")
    return fuse_checked_positions(list(zip(pos_lists, score_lists)), np.asarray(id_order), mode, k, leg_weights, top_k)


def fuse_checked_positions(
    legs: Sequence[Tuple[np.ndarray, np.ndarray]],
    id_order: np.ndarray,
    mode: str,
    k: float,
    leg_weights: Sequence[float],
    top_k: Optional[int],
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`fuse_positions` without argument checks, for callers whose legs are valid by
    construction (int64 distinct positions, float64 finite scores, checked weights and k)."""
    pos_lists = [p for p, _ in legs]
    score_lists = [s for _, s in legs]
    candidates = np.unique(np.concatenate(pos_lists)) if pos_lists else np.zeros(0, np.int64)
    n_legs, n = len(legs), len(candidates)
    ranks = np.zeros((n_legs, n), dtype=np.int64)
    raw = np.full((n_legs, n), np.nan)
    for i, (p, s) in enumerate(zip(pos_lists, score_lists)):
        at = np.searchsorted(candidates, p)
        ranks[i, at] = np.arange(1, len(p) + 1)
        raw[i, at] = s
    fused = np.zeros(n)
    if mode == "rrf":
        for i, w in enumerate(leg_weights):
            present = ranks[i] > 0
            fused[present] += w / (k + ranks[i, present])
    else:
        total = math.fsum(leg_weights)
        for i, w in enumerate(leg_weights):
            present = ranks[i] > 0
            if not present.any():
                continue
            values = raw[i, present]
            low, high = values.min(), values.max()
            norm = np.ones_like(values) if high == low else (values - low) / (high - low)
            fused[present] += (w / total if total > 0 else 0.0) * norm
    weighted = [i for i, w in enumerate(leg_weights) if w > 0]
    best_rank = np.full(n, np.inf)
    for i in weighted:
        present = ranks[i] > 0
        best_rank[present] = np.minimum(best_rank[present], ranks[i, present])
    order = np.lexsort((id_order[candidates], best_rank, -fused))
    if top_k is not None:
        order = order[:top_k]
    return candidates[order], fused[order], ranks[:, order], raw[:, order]


#: Spreads at most this fraction of the values' magnitude are rounding, not information: equal
#: values whose mean rounds (e.g. three times 0.95) have a standard deviation of ~1e-16.
ZSCORE_RELATIVE_TIE = 1e-12


def zscore(values: np.ndarray) -> np.ndarray:
    """``(s - mean(s)) / sd(s)`` (population sd) in float64; values equal up to rounding (sd at most
    ``ZSCORE_RELATIVE_TIE`` times their largest magnitude) map to 0."""
    wide = np.asarray(values, dtype=np.float64)
    if wide.size == 0:
        return wide
    sd = float(wide.std())
    if not math.isfinite(sd) or sd <= ZSCORE_RELATIVE_TIE * float(np.abs(wide).max()) or sd == 0:
        return np.zeros_like(wide)
    return (wide - wide.mean()) / sd


def fuse_exact_scores(
    legs: Sequence[Tuple[np.ndarray, np.ndarray]],
    id_order: np.ndarray,
    weights: Sequence[float],
    top_k: Optional[int],
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Z-scored fusion of exact leg scores over the union of the legs' top lists.

    Each leg is ``(top, scores)``: ``top`` the distinct positions the leg returned, best first,
    and ``scores`` the leg's exact score of *every* position of the index (one entry per
    position), so a candidate only one leg returned is still scored by all. Candidates =
    the union of the ``top`` lists; ``fused(c) = sum_leg w_leg * z_leg(c) / sum(w)`` with
    ``z_leg`` the leg's scores :func:`zscore`-d over the candidates (all-zero weights: 0).
    Order: fused score (high first), the best rank in a positively weighted leg, ``id_order``
    (the node id's rank), as :func:`fuse_checked_positions`.

    Returns ``(positions, fused_scores, ranks, scores)`` best first, cut to ``top_k``; ``ranks``
    and ``scores`` have one row per leg: the rank (from 1) and exact score where the leg's
    ``top`` holds the candidate, rank 0 and NaN where it does not.
    """
    leg_weights = check_weights(len(legs), weights)
    _check_top_k(top_k)
    tops = [np.asarray(top, dtype=np.int64) for top, _ in legs]
    candidates = np.unique(np.concatenate(tops)) if tops else np.zeros(0, np.int64)
    n_legs, n = len(legs), candidates.size
    total = math.fsum(leg_weights)
    fused = np.zeros(n)
    exact = []
    for (_, scores), w in zip(legs, leg_weights):
        leg_exact = np.asarray(scores)[candidates].astype(np.float64)  # indexed first: the array spans the index
        exact.append(leg_exact)
        if total > 0 and w > 0:
            fused += (w / total) * zscore(leg_exact)
    # Only candidates that can make the cut are ranked: those at least as good as the top_k-th
    # fused score (ties at the cut kept for the tie-breaks below).
    keep = np.arange(n)
    if top_k is not None and top_k < n:
        cut = np.partition(fused, n - top_k)[n - top_k]
        keep = np.flatnonzero(fused >= cut)
    ranks = np.zeros((n_legs, keep.size), dtype=np.int64)
    raw = np.full((n_legs, keep.size), np.nan)
    for i, top in enumerate(tops):
        leg_rank = np.zeros(n, dtype=np.int64)
        leg_rank[np.searchsorted(candidates, top)] = np.arange(1, top.size + 1)
        ranks[i] = leg_rank[keep]
        present = ranks[i] > 0
        raw[i, present] = exact[i][keep[present]]
    best_rank = np.full(keep.size, np.inf)
    for i, w in enumerate(leg_weights):
        if w > 0:
            present = ranks[i] > 0
            best_rank[present] = np.minimum(best_rank[present], ranks[i, present])
    kept = candidates[keep]
    order = np.lexsort((np.asarray(id_order)[kept], best_rank, -fused[keep]))
    if top_k is not None:
        order = order[:top_k]
    return kept[order], fused[keep][order], ranks[:, order], raw[:, order]
