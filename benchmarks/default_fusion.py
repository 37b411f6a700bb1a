"""Choosing the fusion rule of the default ``hybrid`` mode on train/dev splits only (issue 11).

    python benchmarks/default_fusion.py scores            # exact leg scores of every query, cached once
    python benchmarks/default_fusion.py sweep             # rule families on train/dev, select one rule
    python benchmarks/default_fusion.py report --splits scifact/test nfcorpus/test   # once, at the end

The defaults are ``HybridIndex.from_documents(docs, storage_dir=...)`` (SectionWindowNodeParser
200/40, BM25 k1 1.2 / b 0.75 with English stopwords and stemmer, the packaged MiniLM) and
``as_retriever("hybrid")``, which before this sweep was min-max score fusion of the BM25 and dense
legs, 100 candidates each, weights 0.5/0.5 (now ``"hybrid_score"``; ``"hybrid"`` runs round 2's
selection, ``IndexFusion.FEEDBACK``). ``scores`` computes, for every query of every split of SciFact and NFCorpus, the
exact BM25 score of every chunk (bm25s, as the package's ``BM25Retriever``) and keeps the query
vectors; dense scores are cosines over the cached chunk vectors. ``sweep`` fuses those in numpy
under two families of rules and selects one rule for both datasets by

    objective = 0.5 * nDCG@10(SciFact train) + 0.25 * nDCG@10(NFCorpus dev) + 0.25 * nDCG@10(NFCorpus train)

(declared before the sweep; test is never read by ``sweep``):

* ``today``: what the package's options can express now (min-max score fusion or RRF; weights,
  leg depth, RRF k), each leg's missing candidates counting 0 as in ``fusion.fuse_positions``;
* ``feedback``: candidates = the union of the legs' top ``depth``, every candidate scored exactly
  by both legs, each leg normalised over the candidates (min-max or z-score), fused as
  ``w_bm25 * n(bm25) + w_dense * n(dense)``; then a third leg, the cosine to the mean vector of the
  first pass's top ``m`` chunks (Rocchio pseudo-relevance feedback in embedding space), adds its
  own top ``depth`` (``new``) or only rescores the candidates; final score
  ``(1 - wf) * (wb * n(bm25) + (1 - wb) * n(dense)) + wf * n(feedback)``.

Round 2 (``sweep --families rocchio rrf3 depth --include results/default_fusion_sweep.json --out
results/default_fusion_sweep2.json``; families declared before the sweep, same objective, one rule
selected over round 1's rows and these, test reported once):

* ``rocchio``: round 1's z-scored rule with new feedback candidates, the feedback centroid keeping
  the query, ``unit(alpha * q + mean(top m))``: alpha 0 / 0.5 / 1, m 1 / 2 / 3, wf 0.3 / 0.4 / 0.5;
* ``rrf3``: three-leg weighted RRF (BM25, dense and feedback top 100 each; the feedback centroid
  from the two-leg RRF's top m): k 10 / 60, m 1 / 3, feedback weight 1/3, 0.4, 0.5;
* ``depth``: round 1's selected rule at a depth of 200 and 300.

Evaluation as ``benchmarks/edge_modes.py``: the fused list is cut at 100 chunks
(``similarity_top_k=100``), a document takes its best chunk's score, nDCG@10 and R@100 at document
level (the package's ``evaluate_run`` in ``report``; the same definitions in numpy in ``sweep``,
checked equal in ``report``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

CACHE = C.CACHE_DIR / "default_fusion"
RESULTS = Path(__file__).resolve().parent / "results" / "default_fusion_sweep.json"
DATASETS = ("scifact", "nfcorpus")
OUT_CHUNKS = 100  # similarity_top_k of the evaluated retriever (as edge_modes.py)
BM25_SPEC = {"k1": 1.2, "b": 0.75, "stopwords": "en", "stemmer_language": "english"}  # the package defaults
SELECT = (("scifact", "train", 0.5), ("nfcorpus", "dev", 0.25), ("nfcorpus", "train", 0.25))
TODAY = {"family": "today", "method": "minmax", "depth": 100, "wb": 0.5}  # as_retriever("hybrid") today


def splits_of(name: str) -> List[str]:
    return [*C.tuning_splits(C.DEFAULT_BEIR / name), "test"]


# ------------------------------------------------------------------------------------------ scores
def compute_scores(name: str) -> None:
    """Chunk vectors, doc of each chunk, and per split: query vectors and the full BM25 score matrix."""
    import hybrid_beir as HB
    from llama_index_retrieval_kit.retrievers.bm25 import BM25Params, build_snapshot, build_tokenizer

    folder = C.DEFAULT_BEIR / name
    corpus = C.read_corpus(folder)
    t0 = time.perf_counter()
    table = HB.build_chunk_table(corpus, C.DEFAULT_CHUNK_SIZE, C.DEFAULT_CHUNK_OVERLAP)
    CACHE.mkdir(parents=True, exist_ok=True)
    vectors = table.vectors / np.linalg.norm(table.vectors, axis=1, keepdims=True)
    np.save(CACHE / f"{name}_vectors.npy", vectors.astype(np.float32))
    np.save(CACHE / f"{name}_doc_of.npy", table.doc_of)
    (CACHE / f"{name}_doc_ids.json").write_text(json.dumps(table.doc_ids))
    tokenize = build_tokenizer(HB.tokenizer_config(BM25_SPEC))
    snapshot = build_snapshot(table.nodes, [tokenize(t) for t in table.texts], BM25Params(BM25_SPEC["k1"], BM25_SPEC["b"], "lucene"))
    print(f"[{name}] {len(table.nodes)} chunks ({time.perf_counter() - t0:.0f}s)", flush=True)
    for split in splits_of(name):
        data = C.load_split(folder, split, corpus)
        texts = list(data.queries.values())
        queries = C.cached_embeddings(texts)
        bm25 = np.zeros((len(texts), len(table.nodes)), np.float32)
        for i, text in enumerate(texts):
            ids = [snapshot.bm25.vocab_dict[t] for t in tokenize(text) if t in snapshot.bm25.vocab_dict]
            if ids:
                bm25[i] = snapshot.bm25.get_scores_from_ids(ids)
        np.savez_compressed(
            CACHE / f"{name}_{split}.npz",
            queries=(queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32),
            bm25=bm25,
        )
        (CACHE / f"{name}_{split}_qids.json").write_text(json.dumps(list(data.queries)))
        print(f"[{name}/{split}] {len(texts)} queries ({time.perf_counter() - t0:.0f}s)", flush=True)


class Split:
    """One split's cached scores, plus each leg's top ``depth`` per query (computed once)."""

    def __init__(self, name: str, split: str) -> None:
        self.name, self.split = name, split
        self.vectors = np.load(CACHE / f"{name}_vectors.npy")
        self.doc_of = np.load(CACHE / f"{name}_doc_of.npy")
        self.doc_ids = json.loads((CACHE / f"{name}_doc_ids.json").read_text())
        arrays = np.load(CACHE / f"{name}_{split}.npz")
        self.queries, self.bm25 = arrays["queries"], arrays["bm25"]
        self.dense = self.queries @ self.vectors.T
        self.qids = json.loads((CACHE / f"{name}_{split}_qids.json").read_text())
        self.qrels = C.load_split(C.DEFAULT_BEIR / name, split, corpus={}).qrels
        self._tops: Dict[Tuple[str, int], List[np.ndarray]] = {}

    def top(self, leg: str, depth: int) -> List[np.ndarray]:
        """Per query, the leg's best ``depth`` chunk positions, best first (BM25: score > 0 only)."""
        key = (leg, depth)
        if key not in self._tops:
            matrix = self.bm25 if leg == "bm25" else self.dense
            self._tops[key] = [top_positions(row, depth, positive=leg == "bm25") for row in matrix]
        return self._tops[key]


def top_positions(row: np.ndarray, k: int, positive: bool = False) -> np.ndarray:
    """Positions of the ``k`` highest values of ``row``, best first (stable on ties)."""
    cand = np.flatnonzero(row > 0) if positive else np.arange(row.size)
    if cand.size > k:
        cand = cand[np.argpartition(-row[cand], k - 1)[:k]]
    return cand[np.argsort(-row[cand], kind="stable")]


# ------------------------------------------------------------------------------------------ rules
def normalise(s: np.ndarray, how: str) -> np.ndarray:
    """``minmax``: (s - min) / (max - min), all-equal -> 1; ``zscore``: (s - mean) / std, all-equal -> 0."""
    s = s.astype(np.float64)
    if s.size == 0:
        return s
    if how == "minmax":
        lo, hi = s.min(), s.max()
        return np.ones_like(s) if hi == lo else (s - lo) / (hi - lo)
    sd = s.std()
    return np.zeros_like(s) if sd == 0 else (s - s.mean()) / sd


def fuse_today(sp: Split, qi: int, rule: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray]:
    """The package's fusion: each leg's own top ``depth``; a leg that missed a candidate adds 0."""
    depth, wb = rule["depth"], rule["wb"]
    legs = [(sp.top("bm25", depth)[qi], sp.bm25[qi], wb), (sp.top("dense", depth)[qi], sp.dense[qi], 1 - wb)]
    cand = np.unique(np.concatenate([t for t, _, _ in legs]))
    fused = np.zeros(cand.size)
    best_rank = np.full(cand.size, np.inf)
    for top, row, w in legs:
        at = np.searchsorted(cand, top)
        ranks = np.arange(1, top.size + 1)
        fused[at] += w / (rule["k"] + ranks) if rule["method"] == "rrf" else w * normalise(row[top], "minmax")
        best_rank[at] = np.minimum(best_rank[at], ranks)
    order = np.lexsort((best_rank, -fused))[:OUT_CHUNKS]
    return cand[order], fused[order]


def fuse_feedback(sp: Split, qi: int, rule: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray]:
    """Exact scores over the union of candidates, then a Rocchio feedback leg (module doc)."""
    depth, how, wb, wf = rule["depth"], rule["method"], rule["wb"], rule["wf"]
    bm25, dense = sp.bm25[qi], sp.dense[qi]
    cand = np.union1d(sp.top("bm25", depth)[qi], sp.top("dense", depth)[qi])
    first = wb * normalise(bm25[cand], how) + (1 - wb) * normalise(dense[cand], how)
    centroid = sp.vectors[cand[np.argsort(-first, kind="stable")[: rule["m"]]]].mean(axis=0)
    centroid /= np.linalg.norm(centroid)
    if rule["new"]:
        feedback_row = sp.vectors @ centroid
        cand = np.union1d(cand, top_positions(feedback_row, depth))
        feedback = feedback_row[cand]
    else:
        feedback = sp.vectors[cand] @ centroid
    fused = (1 - wf) * (wb * normalise(bm25[cand], how) + (1 - wb) * normalise(dense[cand], how)) + wf * normalise(feedback, how)
    order = np.argsort(-fused, kind="stable")[:OUT_CHUNKS]
    return cand[order], fused[order]


def fuse_rocchio(sp: Split, qi: int, rule: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray]:
    """``feedback`` (z-score or min-max, new candidates) with a Rocchio centroid that keeps the query:
    ``c = unit(alpha * q + mean(top m chunk vectors of the first pass))``."""
    depth, how, wb, wf, alpha = rule["depth"], rule["method"], rule["wb"], rule["wf"], rule["alpha"]
    bm25, dense = sp.bm25[qi], sp.dense[qi]
    cand = np.union1d(sp.top("bm25", depth)[qi], sp.top("dense", depth)[qi])
    first = wb * normalise(bm25[cand], how) + (1 - wb) * normalise(dense[cand], how)
    centroid = sp.vectors[cand[np.argsort(-first, kind="stable")[: rule["m"]]]].mean(axis=0) + alpha * sp.queries[qi]
    centroid /= np.linalg.norm(centroid)
    feedback_row = sp.vectors @ centroid
    cand = np.union1d(cand, top_positions(feedback_row, depth))
    fused = (1 - wf) * (wb * normalise(bm25[cand], how) + (1 - wb) * normalise(dense[cand], how)) + wf * normalise(feedback_row[cand], how)
    order = np.argsort(-fused, kind="stable")[:OUT_CHUNKS]
    return cand[order], fused[order]


def rrf_scores(cand: np.ndarray, tops: Sequence[np.ndarray], weights: Sequence[float], k: float) -> np.ndarray:
    """Weighted RRF of ranked position lists over ``cand``: sum w / (k + rank), rank from 1; absent adds 0."""
    fused = np.zeros(cand.size)
    for top, w in zip(tops, weights):
        at = np.searchsorted(cand, top)
        fused[at] += w / (k + np.arange(1, top.size + 1))
    return fused


def fuse_rrf3(sp: Split, qi: int, rule: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray]:
    """Three-leg weighted RRF: BM25 and dense top ``depth``, and the feedback leg's top ``depth``
    (cosine to the mean of the two-leg RRF's top ``m`` chunks); weights ((1-wf)/2, (1-wf)/2, wf)."""
    depth, k, wf = rule["depth"], rule["k"], rule["wf"]
    tops = [sp.top("bm25", depth)[qi], sp.top("dense", depth)[qi]]
    cand = np.union1d(*tops)
    first = rrf_scores(cand, tops, (0.5, 0.5), k)
    centroid = sp.vectors[cand[np.argsort(-first, kind="stable")[: rule["m"]]]].mean(axis=0)
    tops.append(top_positions(sp.vectors @ centroid, depth))
    cand = np.union1d(cand, tops[2])
    fused = rrf_scores(cand, tops, ((1 - wf) / 2, (1 - wf) / 2, wf), k)
    order = np.argsort(-fused, kind="stable")[:OUT_CHUNKS]
    return cand[order], fused[order]


FUSE: Dict[str, Callable[[Split, int, Dict[str, Any]], Tuple[np.ndarray, np.ndarray]]] = {
    "today": fuse_today,
    "feedback": fuse_feedback,
    "rocchio": fuse_rocchio,
    "rrf3": fuse_rrf3,
}


def family_today() -> List[Dict[str, Any]]:
    rules = []
    for depth, wb in itertools.product([100, 200, 300], [0.4, 0.5, 0.6]):
        rules.append({"family": "today", "method": "minmax", "depth": depth, "wb": wb})
        rules += [{"family": "today", "method": "rrf", "depth": depth, "wb": wb, "k": k} for k in (1, 10, 60)]
    return rules


def family_feedback() -> List[Dict[str, Any]]:
    return [
        {"family": "feedback", "method": how, "depth": 100, "new": new, "m": m, "wf": wf, "wb": wb}
        for how, new, m, wf, wb in itertools.product(("minmax", "zscore"), (False, True), (1, 2, 3), (0.2, 0.3, 0.4, 0.5), (0.4, 0.5))
    ]


def family_rocchio() -> List[Dict[str, Any]]:
    return [
        {"family": "rocchio", "method": "zscore", "depth": 100, "alpha": alpha, "m": m, "wf": wf, "wb": 0.5}
        for alpha, m, wf in itertools.product((0.0, 0.5, 1.0), (1, 2, 3), (0.3, 0.4, 0.5))
    ]


def family_rrf3() -> List[Dict[str, Any]]:
    return [
        {"family": "rrf3", "depth": 100, "k": k, "m": m, "wf": wf}
        for k, m, wf in itertools.product((10, 60), (1, 3), (1 / 3, 0.4, 0.5))
    ]


def family_depth() -> List[Dict[str, Any]]:
    return [
        {"family": "feedback", "method": "zscore", "depth": depth, "new": True, "m": 1, "wf": 0.4, "wb": 0.5}
        for depth in (200, 300)
    ]


FAMILIES: Dict[str, Callable[[], List[Dict[str, Any]]]] = {
    "today": family_today,
    "feedback": family_feedback,
    "rocchio": family_rocchio,
    "rrf3": family_rrf3,
    "depth": family_depth,
}
ROUND_1 = ("today", "feedback")
ROUND_2 = ("rocchio", "rrf3", "depth")


# ------------------------------------------------------------------------------------------ evaluation
def doc_run(sp: Split, rule: Dict[str, Any]) -> Dict[str, List[Tuple[str, float]]]:
    """Per query: documents best first (a document's score is its best chunk's), from OUT_CHUNKS chunks."""
    fuse = FUSE[rule["family"]]
    run = {}
    for qi, qid in enumerate(sp.qids):
        positions, fused = fuse(sp, qi, rule)
        docs = sp.doc_of[positions]
        _, first = np.unique(docs, return_index=True)
        first.sort()
        run[qid] = [(sp.doc_ids[docs[i]], float(fused[i])) for i in first]
    return run


def fast_metrics(run: Dict[str, List[Tuple[str, float]]], qrels: Dict[str, Dict[str, int]]) -> Dict[str, float]:
    """nDCG@10 (linear gains, trec_eval) and R@100, as ``_common.evaluate`` computes them."""
    disc = 1.0 / np.log2(np.arange(2, 12))
    ndcg, recall = [], []
    for qid, docs in run.items():
        judged = qrels.get(qid, {})
        gains = np.array([judged.get(d, 0) for d, _ in docs[:10]], float)
        ideal = np.array(sorted(judged.values(), reverse=True)[:10], float)
        idcg = float(np.sum(ideal * disc[: ideal.size]))
        ndcg.append(float(np.sum(gains * disc[: gains.size])) / idcg if idcg > 0 else 0.0)
        relevant = {d for d, g in judged.items() if g > 0}
        recall.append(len(relevant & {d for d, _ in docs[:100]}) / len(relevant) if relevant else 0.0)
    return {"ndcg@10": float(np.mean(ndcg)), "recall@100": float(np.mean(recall))}


def sweep(out: Path, families: Sequence[str] = ROUND_1, include: Optional[Path] = None) -> Dict[str, Any]:
    """Score every rule of ``families`` on the selection splits; select the best by the objective
    over these rows and, with ``include``, the rows of an earlier sweep (same objective)."""
    splits = {(n, s): Split(n, s) for n, s, _ in SELECT}
    rows = json.loads(include.read_text())["rows"] if include else []
    t0 = time.perf_counter()
    for rule in [r for f in families for r in FAMILIES[f]()]:
        row: Dict[str, Any] = {"rule": rule, "objective": 0.0}
        for n, s, share in SELECT:
            m = fast_metrics(doc_run(splits[(n, s)], rule), splits[(n, s)].qrels)
            row[f"{n}/{s}"] = m
            row["objective"] += share * m["ndcg@10"]
        rows.append(row)
        print(f"{row['objective']:.4f} {json.dumps(rule)} ({time.perf_counter() - t0:.0f}s)", flush=True)
    best = max(rows, key=lambda r: r["objective"])
    if not any(r["rule"] == TODAY for r in rows):
        rows.append({"rule": TODAY, "objective": 0.0})
        for n, s, share in SELECT:
            rows[-1][f"{n}/{s}"] = fast_metrics(doc_run(splits[(n, s)], TODAY), splits[(n, s)].qrels)
            rows[-1]["objective"] += share * rows[-1][f"{n}/{s}"]["ndcg@10"]
    today = next(r for r in rows if r["rule"] == TODAY)
    best_today = max((r for r in rows if r["rule"]["family"] == "today"), key=lambda r: r["objective"])
    result = {"objective": "0.5 scifact/train + 0.25 nfcorpus/dev + 0.25 nfcorpus/train (nDCG@10)",
              "today": today, "best_today_family": best_today, "selected": best, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\n| rule | objective | " + " | ".join(f"{n}/{s} nDCG@10 / R@100" for n, s, _ in SELECT) + " |")
    print("|---|---|" + "---|" * len(SELECT))
    best_of = [(f"best of family {f}", max(r, key=lambda x: x["objective"]))
               for f in dict.fromkeys(x["rule"]["family"] for x in rows)
               if (r := [x for x in rows if x["rule"]["family"] == f])]
    for label, row in (("today's default", today), ("best of today's options", best_today), *best_of, ("selected", best)):
        cells = " | ".join(f"{row[f'{n}/{s}']['ndcg@10']:.4f} / {row[f'{n}/{s}']['recall@100']:.3f}" for n, s, _ in SELECT)
        print(f"| {label}: {json.dumps(row['rule'])} | {row['objective']:.4f} | {cells} |")
    return result


def report(rules: Sequence[Tuple[str, Dict[str, Any]]], splits: Sequence[Tuple[str, str]]) -> None:
    print("| dataset | split | setting | nDCG@10 | R@100 |\n|---|---|---|---|---|")
    for n, s in splits:
        sp = Split(n, s)
        for label, rule in rules:
            run = doc_run(sp, rule)
            m = C.evaluate(run, sp.qrels)
            fast = fast_metrics(run, sp.qrels)
            if not math.isclose(m["ndcg@10"], fast["ndcg@10"], abs_tol=1e-9):
                raise RuntimeError(f"numpy metrics disagree with evaluate_run: {fast} vs {m}")
            print(f"| {n} | {s} | {label}: {json.dumps(rule)} | {m['ndcg@10']:.4f} | {m['recall@100']:.4f} |", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["scores", "sweep", "report"])
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--families", nargs="+", default=list(ROUND_1), choices=list(FAMILIES), help="sweep: rule families")
    ap.add_argument("--include", type=Path, default=None, help="sweep: an earlier sweep's JSON whose rows compete too")
    ap.add_argument("--rule", default=None, help="report: a rule as JSON (default: today's and the sweep's selection)")
    ap.add_argument("--splits", nargs="+", default=None, help="report: NAME/SPLIT ... (default: the selection splits)")
    args = ap.parse_args(argv)
    if args.command == "scores":
        for name in args.datasets:
            compute_scores(name)
    elif args.command == "sweep":
        sweep(args.out, args.families, args.include)
    else:
        if args.rule:
            rules = [("rule", json.loads(args.rule))]
        else:
            rules = [("today", TODAY), ("selected", json.loads(args.out.read_text())["selected"]["rule"])]
        splits = [tuple(x.split("/")) for x in (args.splits or [f"{n}/{s}" for n, s, _ in SELECT])]
        report(rules, splits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
