"""Reciprocal rank fusion and score fusion: known answers, properties, validation, no mutation."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index_retrieval_kit.retrievers import FusedNodeWithScore, reciprocal_rank_fusion, score_fusion
from llama_index_retrieval_kit.retrievers.fusion import fuse_positions

POOL = {name: TextNode(id_=name, text=f"text of {name}") for name in "abcdefghij"}


def leg(*ids: str, scores: Optional[Sequence[float]] = None) -> List[NodeWithScore]:
    """A ranked list over the shared node pool (scores default to a descending ramp)."""
    scores = scores if scores is not None else [float(len(ids) - i) for i in range(len(ids))]
    return [NodeWithScore(node=POOL[i], score=s) for i, s in zip(ids, scores)]


def summary(results: List[NodeWithScore]) -> List[Tuple[str, float, Dict[str, int]]]:
    return [(r.node.node_id, r.score, dict(r.leg_ranks)) for r in results]  # type: ignore[attr-defined]


# ----- known answers -----------------------------------------------------------------------------


def test_rrf_known_answer() -> None:
    fused = reciprocal_rank_fusion([leg("a", "b", "c"), leg("c", "a", "d")], k=60)
    expected = {
        "a": 1 / 61 + 1 / 62,
        "b": 1 / 62,
        "c": 1 / 63 + 1 / 61,
        "d": 1 / 63,
    }
    assert [r.node.node_id for r in fused] == ["a", "c", "b", "d"]
    for r in fused:
        assert r.score == pytest.approx(expected[r.node.node_id], rel=1e-15)
    a = fused[0]
    assert isinstance(a, FusedNodeWithScore)
    assert a.leg_ranks == {"leg0": 1, "leg1": 2}
    assert a.leg_scores == {"leg0": 3.0, "leg1": 2.0}
    assert fused[2].leg_ranks == {"leg0": 2}


def test_rrf_weights_k_names_and_top_k() -> None:
    fused = reciprocal_rank_fusion(
        [leg("a", "b"), leg("b", "a")], k=0, weights=[1.0, 3.0], names=["bm25", "dense"], top_k=1
    )
    # a: 1/1 + 3/2 = 2.5; b: 1/2 + 3/1 = 3.5
    assert [(r.node.node_id, r.score) for r in fused] == [("b", 3.5)]
    assert fused[0].leg_ranks == {"bm25": 2, "dense": 1}


def test_rrf_ties_broken_by_best_rank_then_node_id() -> None:
    fused = reciprocal_rank_fusion([leg("c", "b"), leg("b", "c")])
    assert [r.node.node_id for r in fused] == ["b", "c"]  # equal score, equal best rank -> node id
    # k=0: e = 2/1, d = 1/1 (rank 1), c = 2/2 (rank 2): d and c tie on score, d has the better rank.
    fused = reciprocal_rank_fusion([leg("d"), leg("e", "c")], k=0, weights=[1, 2])
    assert [(r.node.node_id, r.score) for r in fused] == [("e", 2.0), ("d", 1.0), ("c", 1.0)]


def test_qdrant_offset() -> None:
    # Qdrant (positions from 0, default k=2) scores a single top hit 1/(0+2) = 0.5: that is k=1 here.
    assert reciprocal_rank_fusion([leg("a")], k=1)[0].score == 0.5


def test_duplicate_in_one_leg_keeps_best_rank() -> None:
    fused = reciprocal_rank_fusion([leg("a", "b", "a", "c")])
    assert [(r.node.node_id, r.leg_ranks["leg0"]) for r in fused] == [("a", 1), ("b", 2), ("c", 3)]


def test_score_fusion_known_answer() -> None:
    fused = score_fusion([leg("a", "b", "c", scores=[10, 5, 0]), leg("c", "a", scores=[0.9, 0.1])])
    # leg0 normalised: a 1, b .5, c 0; leg1: c 1, a 0; equal weights -> a .5, b .25, c .5
    assert [(r.node.node_id, r.score) for r in fused] == [("a", 0.5), ("c", 0.5), ("b", 0.25)]
    weighted = score_fusion([leg("a", "b", "c", scores=[10, 5, 0]), leg("c", "a", scores=[0.9, 0.1])], weights=[1, 3])
    assert [(r.node.node_id, r.score) for r in weighted] == [("c", 0.75), ("a", 0.25), ("b", 0.125)]


def test_score_fusion_constant_leg_and_missing_scores() -> None:
    fused = score_fusion([leg("a", "b", scores=[2, 2]), leg("b", scores=[7])])
    assert [(r.node.node_id, r.score) for r in fused] == [("b", 1.0), ("a", 0.5)]
    with pytest.raises(ValueError, match="finite score"):
        score_fusion([[NodeWithScore(node=POOL["a"], score=None)]])


def test_empty_inputs() -> None:
    assert reciprocal_rank_fusion([]) == []
    assert reciprocal_rank_fusion([[], []]) == []
    assert score_fusion([[], leg("a")])[0].score == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"k": -1}, "k must be"),
        ({"k": float("nan")}, "k must be"),
        ({"weights": [1.0]}, "weights has 1"),
        ({"weights": [1.0, -0.5]}, "weights must be"),
        ({"weights": [1.0, float("inf")]}, "weights must be"),
        ({"top_k": 0}, "top_k"),
        ({"names": ["x", "x"]}, "unique"),
        ({"names": ["x"]}, "names has 1"),
    ],
)
def test_rrf_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        reciprocal_rank_fusion([leg("a"), leg("b")], **kwargs)


def test_inputs_not_mutated_and_nodes_shared() -> None:
    legs = [leg("a", "b"), leg("b", "c")]
    before = [[(r.score, r.node.to_dict()) for r in lst] for lst in legs]
    for fuse in (reciprocal_rank_fusion, score_fusion):
        fused = fuse(legs)
        assert all(r.node is POOL[r.node.node_id] for r in fused)
        assert not any(r is x for r in fused for lst in legs for x in lst)
    assert [[(r.score, r.node.to_dict()) for r in lst] for lst in legs] == before


# ----- properties --------------------------------------------------------------------------------

IDS = list(POOL)
leg_st = st.lists(st.sampled_from(IDS), unique=True, max_size=6)
weight_st = st.one_of(st.just(0.0), st.floats(min_value=0.01, max_value=5.0))


@st.composite
def legs_and_weights(draw: st.DrawFn, min_legs: int = 1) -> Tuple[List[List[str]], List[float]]:
    legs = draw(st.lists(leg_st, min_size=min_legs, max_size=4))
    weights = draw(st.lists(weight_st, min_size=len(legs), max_size=len(legs)))
    return legs, weights


def build(legs: List[List[str]]) -> List[List[NodeWithScore]]:
    return [leg(*ids) for ids in legs]


@settings(max_examples=200, deadline=None)
@given(lw=legs_and_weights(), k=st.floats(min_value=0, max_value=200), data=st.data())
def test_rrf_is_independent_of_leg_order(lw: Tuple[List[List[str]], List[float]], k: float, data: st.DataObject) -> None:
    legs, weights = lw
    names = [f"L{i}" for i in range(len(legs))]
    perm = data.draw(st.permutations(range(len(legs))))
    original = reciprocal_rank_fusion(build(legs), k=k, weights=weights, names=names)
    permuted = reciprocal_rank_fusion(
        build([legs[i] for i in perm]), k=k, weights=[weights[i] for i in perm], names=[names[i] for i in perm]
    )
    assert summary(original) == summary(permuted)
    s_original = score_fusion(build(legs), weights=weights, names=names)
    s_permuted = score_fusion(build([legs[i] for i in perm]), weights=[weights[i] for i in perm], names=[names[i] for i in perm])
    assert summary(s_original) == summary(s_permuted)


@settings(max_examples=200, deadline=None)
@given(lw=legs_and_weights(), k=st.floats(min_value=0, max_value=200), top=st.sampled_from(IDS))
def test_document_first_in_every_leg_is_first(lw: Tuple[List[List[str]], List[float]], k: float, top: str) -> None:
    legs, weights = lw
    assume(any(w > 0 for w in weights))
    legs = [[top] + [i for i in ids if i != top] for ids in legs]
    assert reciprocal_rank_fusion(build(legs), k=k, weights=weights)[0].node.node_id == top
    assert score_fusion(build(legs), weights=weights)[0].node.node_id == top


@settings(max_examples=200, deadline=None)
@given(lw=legs_and_weights(min_legs=2), k=st.floats(min_value=0, max_value=200), data=st.data())
def test_zero_weight_removes_a_leg(lw: Tuple[List[List[str]], List[float]], k: float, data: st.DataObject) -> None:
    """Zero weight == leg absent, except documents only that leg returned: score 0, ranked last."""
    legs, weights = lw
    j = data.draw(st.integers(min_value=0, max_value=len(legs) - 1))
    weights = [0.0 if i == j else w for i, w in enumerate(weights)]
    names = [f"L{i}" for i in range(len(legs))]
    rest = [i for i in range(len(legs)) if i != j]
    for fuse, kwargs in ((reciprocal_rank_fusion, {"k": k}), (score_fusion, {})):
        with_zero = fuse(build(legs), weights=weights, names=names, **kwargs)
        without = fuse(build([legs[i] for i in rest]), weights=[weights[i] for i in rest], names=[names[i] for i in rest], **kwargs)
        in_rest = {node_id for i in rest for node_id in legs[i]}
        kept = [(r.node.node_id, r.score) for r in with_zero if r.node.node_id in in_rest]
        assert kept == [(r.node.node_id, r.score) for r in without]
        only_j = [pos for pos, r in enumerate(with_zero) if r.node.node_id not in in_rest]
        assert {with_zero[pos].node.node_id for pos in only_j} == set(legs[j]) - in_rest
        assert all(with_zero[pos].score == 0.0 for pos in only_j)
        weighted = {node_id for i in rest if weights[i] > 0 for node_id in legs[i]}
        last_weighted = max((pos for pos, r in enumerate(with_zero) if r.node.node_id in weighted), default=-1)
        assert all(pos > last_weighted for pos in only_j)


@settings(max_examples=200, deadline=None)
@given(lw=legs_and_weights(), k=st.floats(min_value=0, max_value=200), top_k=st.none() | st.integers(1, 12))
def test_rrf_scores_follow_the_formula(lw: Tuple[List[List[str]], List[float]], k: float, top_k: Optional[int]) -> None:
    legs, weights = lw
    fused = reciprocal_rank_fusion(build(legs), k=k, weights=weights, top_k=top_k)
    expected = {}
    for node_id in {i for ids in legs for i in ids}:
        expected[node_id] = math.fsum(w / (k + (ids.index(node_id) + 1)) for ids, w in zip(legs, weights) if node_id in ids)
    assert len(fused) == min(len(expected), top_k or len(expected))
    for r in fused:
        assert r.score == expected[r.node.node_id]
        assert r.leg_ranks == {f"leg{n}": ids.index(r.node.node_id) + 1 for n, ids in enumerate(legs) if r.node.node_id in ids}
    assert [r.score for r in fused] == sorted(expected.values(), reverse=True)[: len(fused)]


# ----- array form ---------------------------------------------------------------------------------

score_st = st.floats(min_value=-50, max_value=50, allow_nan=False).map(lambda x: round(x, 2))  # ties likely


@settings(max_examples=300, deadline=None)
@given(
    legs=st.lists(leg_st, min_size=2, max_size=2),
    weights=st.lists(weight_st, min_size=2, max_size=2),
    k=st.floats(min_value=0, max_value=200),
    top_k=st.none() | st.integers(1, 12),
    mode=st.sampled_from(["rrf", "score"]),
    data=st.data(),
)
def test_fuse_positions_equals_the_object_functions(legs, weights, k, top_k, mode, data) -> None:
    """Two legs over one index: the array form gives the same ids, order, scores and traces."""
    scored = [sorted(data.draw(st.lists(score_st, min_size=len(ids), max_size=len(ids))), reverse=True) for ids in legs]
    objects = [leg(*ids, scores=s) for ids, s in zip(legs, scored)]
    if mode == "rrf":
        want = reciprocal_rank_fusion(objects, k=k, weights=weights, top_k=top_k, names=["a", "b"])
    else:
        want = score_fusion(objects, weights=weights, top_k=top_k, names=["a", "b"])
    id_order = np.arange(len(IDS))  # IDS are sorted, so position order is node-id order
    arrays = [(np.array([IDS.index(i) for i in ids], dtype=np.int64), np.array(s, dtype=np.float64)) for ids, s in zip(legs, scored)]
    positions, fused, ranks, raw = fuse_positions(arrays, id_order, mode=mode, k=k, weights=weights, top_k=top_k)
    assert [IDS[p] for p in positions] == [r.node.node_id for r in want]
    assert fused.tolist() == [r.score for r in want]
    for j, r in enumerate(want):
        assert {name: int(ranks[i, j]) for i, name in enumerate("ab") if ranks[i, j] > 0} == r.leg_ranks
        assert {name: float(raw[i, j]) for i, name in enumerate("ab") if ranks[i, j] > 0} == r.leg_scores


def test_fuse_positions_rejects_bad_legs() -> None:
    order = np.arange(4)
    with pytest.raises(ValueError, match="position twice"):
        fuse_positions([(np.array([1, 1]), np.array([2.0, 1.0])), (np.array([0]), np.array([1.0]))], order)
    with pytest.raises(ValueError, match="same length"):
        fuse_positions([(np.array([1, 2]), np.array([2.0])), (np.array([0]), np.array([1.0]))], order)
    with pytest.raises(ValueError, match="finite scores"):
        fuse_positions([(np.array([1]), np.array([np.inf])), (np.array([0]), np.array([1.0]))], order, mode="score")
    with pytest.raises(ValueError, match="mode 'max'"):
        fuse_positions([(np.array([1]), np.array([1.0]))], order, mode="max")
    empty = fuse_positions([(np.zeros(0, np.int64), np.zeros(0)), (np.zeros(0, np.int64), np.zeros(0))], order)
    assert all(len(a) == 0 or a.shape[-1] == 0 for a in empty)


# ----- z-scored exact-score fusion (IndexFusion.FEEDBACK) ------------------------------------------

from llama_index_retrieval_kit.retrievers.fusion import IndexFusion, fuse_exact_scores, zscore  # noqa: E402


def test_zscore_known_answer_and_constant() -> None:
    assert zscore(np.array([1.0, 2.0, 3.0])) == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)])
    assert zscore(np.array([4.0, 4.0])).tolist() == [0.0, 0.0]
    assert zscore(np.zeros(0)).size == 0


def test_fuse_exact_scores_known_answer() -> None:
    # 5 positions; leg A returned [0, 1], leg B returned [3, 1]: candidates {0, 1, 3}, each scored
    # exactly by both legs (position 3 by A too, although A did not return it)
    a = np.array([3.0, 2.0, 9.0, 0.0, 9.0])
    b = np.array([0.1, 0.5, 9.0, 0.9, 9.0])
    ids = np.arange(5)
    positions, fused, ranks, raw = fuse_exact_scores([(np.array([0, 1]), a), (np.array([3, 1]), b)], ids, [1.0, 3.0], None)
    za, zb = zscore(a[[0, 1, 3]]), zscore(b[[0, 1, 3]])
    want = {p: 0.25 * x + 0.75 * y for p, x, y in zip((0, 1, 3), za, zb)}
    assert sorted(positions.tolist()) == [0, 1, 3]
    assert dict(zip(positions.tolist(), fused.tolist())) == pytest.approx(want)
    assert fused.tolist() == sorted(fused.tolist(), reverse=True)
    by_pos = {p: (ranks[:, i].tolist(), raw[:, i].tolist()) for i, p in enumerate(positions.tolist())}
    assert by_pos[1] == ([2, 2], [2.0, 0.5])
    assert by_pos[0][0] == [1, 0] and by_pos[0][1][0] == 3.0 and math.isnan(by_pos[0][1][1])
    assert by_pos[3][0] == [0, 1] and math.isnan(by_pos[3][1][0]) and by_pos[3][1][1] == 0.9


def test_index_fusion_names_its_values() -> None:
    assert IndexFusion.from_str("feedback") is IndexFusion.FEEDBACK
    with pytest.raises(ValueError, match=r"unknown index fusion 'minmax'; allowed: 'feedback', 'score', 'rrf'"):
        IndexFusion.from_str("minmax")


@st.composite
def exact_legs(draw: st.DrawFn) -> Tuple[List[Tuple[np.ndarray, np.ndarray]], List[float], np.ndarray]:
    """2-3 legs over ``n`` positions: a distinct top list each, exact scores of every position."""
    n = draw(st.integers(1, 12))
    n_legs = draw(st.integers(2, 3))
    finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
    legs = []
    for _ in range(n_legs):
        top = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
        scores = np.array(draw(st.lists(finite, min_size=n, max_size=n)))
        legs.append((np.array(top, dtype=np.int64), scores))
    weights = draw(st.lists(st.floats(0, 5, allow_nan=False), min_size=n_legs, max_size=n_legs))
    id_order = np.array(draw(st.permutations(range(n))), dtype=np.int64)
    return legs, weights, id_order


@settings(max_examples=300, deadline=None)
@given(case=exact_legs(), top_k=st.none() | st.integers(1, 12), data=st.data())
def test_fuse_exact_scores_follows_the_formula(case, top_k: Optional[int], data: st.DataObject) -> None:
    legs, weights, id_order = case
    positions, fused, ranks, raw = fuse_exact_scores(legs, id_order, weights, top_k)
    union = sorted({int(p) for top, _ in legs for p in top})
    assert len(positions) == (len(union) if top_k is None else min(top_k, len(union)))
    assert set(positions.tolist()) <= set(union) and len(set(positions.tolist())) == len(positions)
    total = math.fsum(weights)
    # the formula, leg by leg over the candidate set, independently of the implementation
    z = [dict(zip(union, zscore(scores[union]))) if union else {} for _, scores in legs]
    for p, f in zip(positions.tolist(), fused.tolist()):
        want = math.fsum(w / total * z_leg[p] for w, z_leg in zip(weights, z)) if total > 0 else 0.0
        assert f == pytest.approx(want, abs=1e-9)
    for i, (top, scores) in enumerate(legs):  # rank and raw score where the leg returned it
        where = {int(p): r for r, p in enumerate(top.tolist(), 1)}
        for j, p in enumerate(positions.tolist()):
            assert ranks[i, j] == where.get(p, 0)
            assert (math.isnan(raw[i, j]) if p not in where else raw[i, j] == scores[p])
    assert all(a >= b - 1e-12 for a, b in zip(fused, fused[1:]))  # best first
    # every candidate left out scores at most the last one kept
    if top_k is not None and len(positions) == top_k and len(union) > top_k:
        everything, all_fused, _, _ = fuse_exact_scores(legs, id_order, weights, None)
        assert everything[:top_k].tolist() == positions.tolist()
        assert all_fused[top_k:].max() <= fused[-1] + 1e-12


@settings(max_examples=200, deadline=None)
@given(case=exact_legs(), data=st.data())
def test_fuse_exact_scores_is_independent_of_leg_order_and_scale(case, data: st.DataObject) -> None:
    legs, weights, id_order = case
    legs = [(top, np.round(scores)) for top, scores in legs]  # integer scores: the affine change below stays exact enough
    base = fuse_exact_scores(legs, id_order, weights, None)
    order = data.draw(st.permutations(range(len(legs))))
    shuffled = fuse_exact_scores([legs[i] for i in order], id_order, [weights[i] for i in order], None)
    assert shuffled[1] == pytest.approx(base[1], abs=1e-9)
    # an affine change of one leg's scores (positive scale) leaves its z-scores and the fusion alone
    scale = data.draw(st.floats(0.01, 100))
    shift = data.draw(st.floats(-100, 100))
    moved = [(legs[0][0], legs[0][1] * scale + shift), *legs[1:]]
    assert fuse_exact_scores(moved, id_order, weights, None)[1] == pytest.approx(base[1], abs=1e-6)


def test_zscore_of_values_equal_up_to_rounding_is_zero() -> None:
    # hypothesis found it: 0 * 1.0 + 0.95 three times; their float mean is not exactly 0.95, so the
    # sd was ~1e-16 and the z-scores +-1 instead of 0
    tied = np.zeros(3) * 1.0 + 0.95
    assert zscore(tied).tolist() == [0.0, 0.0, 0.0]
    assert zscore(np.array([1e6, 1e6, 1e6 * (1 + 1e-15)])).tolist() == [0.0, 0.0, 0.0]
    assert zscore(np.array([1.0, 2.0, 3.0])) == pytest.approx([-1.224744871, 0.0, 1.224744871])
    legs = [(np.array([], dtype=np.int64), tied), (np.array([0, 1, 2]), np.zeros(3))]
    assert fuse_exact_scores(legs, np.arange(3), [1.0, 0.0], None)[1].tolist() == [0.0, 0.0, 0.0]


def test_fuse_exact_scores_inputs_not_mutated() -> None:
    top, scores = np.array([2, 0]), np.array([1.0, 2.0, 3.0])
    fuse_exact_scores([(top, scores), (np.array([1]), scores.copy())], np.arange(3), [1.0, 1.0], 2)
    assert top.tolist() == [2, 0] and scores.tolist() == [1.0, 2.0, 3.0]


def test_fuse_exact_scores_validation() -> None:
    leg = (np.array([0]), np.array([1.0]))
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        fuse_exact_scores([leg, leg], np.arange(1), [1.0, -1.0], None)
    with pytest.raises(ValueError, match="expected one per leg"):
        fuse_exact_scores([leg, leg], np.arange(1), [1.0], None)
    with pytest.raises(ValueError, match="top_k must be None or an int >= 1"):
        fuse_exact_scores([leg, leg], np.arange(1), [1.0, 1.0], 0)
