"""Hybrid retrieval on BEIR (SciFact, NFCorpus): our HybridIndex vs LlamaIndex's built-ins.

    python benchmarks/hybrid_beir.py --dataset ../shared/datasets/beir/scifact --json PATH
    python benchmarks/hybrid_beir.py --dataset ../shared/datasets/beir/nfcorpus --json PATH
    python benchmarks/hybrid_beir.py --dataset ... --limit-queries 50        # quick run
    python benchmarks/hybrid_beir.py --dataset ... --tune                    # choose parameters (train/dev only)

Rows, all built and queried in the same process on the same Documents (title + "\\n\\n" + text):

* LlamaIndex ``BM25Retriever`` (llama-index-retrievers-bm25, defaults), over LlamaIndex's default
  ``SentenceSplitter`` nodes;
* LlamaIndex ``VectorStoreIndex`` on ``QdrantVectorStore`` (Qdrant local mode), same nodes;
* LlamaIndex ``QueryFusionRetriever(mode="reciprocal_rerank", num_queries=1)`` over those two
  (LlamaIndex defaults otherwise; ``use_async=False`` because a Qdrant local-mode store has no
  async client; ``llm=MockLLM()`` is never called with ``num_queries=1``);
* ours: ``HybridIndex.as_retriever`` modes ``sparse`` (BM25), ``dense``, ``hybrid_rrf`` (RRF),
  ``hybrid_score`` (normalised score fusion, the default of ``hybrid`` before its feedback fusion),
  ``hybrid`` with no other argument (the default: z-scored exact scores plus a feedback leg, see
  benchmarks/default_fusion.py) and ``qdrant_hybrid`` (fusion inside Qdrant). Our rows embed queries with the package default
  (``FastHuggingFaceEmbedding``: ONNX Runtime), LlamaIndex's rows with LlamaIndex's
  ``HuggingFaceEmbedding`` (PyTorch) and its defaults; both compute the same vectors.

Evaluation is at document level: a chunk counts for its ``doc_id``, a document takes its best
chunk's score (max-score aggregation), and every system retrieves enough chunks to fill 100
documents. Metrics: nDCG@10, Recall@100, MRR@10 (trec_eval definitions, the package's
``evaluate_run``). Latency: one query at a time, after a warm-up, in rounds of 50 queries that
each system answers back to back, the order of systems rotating per round (see ``measure``); the "floor" row is the query embedding
plus our BM25 leg measured on the same queries (the sum of two probes, each run back to back,
so each with hot caches), and the "pipeline floor" the same two steps run per query one after
the other, as every system runs its embedding and its retrieval. Build: wall time and docs/s of each index over the
whole corpus with vectors from the embedding cache, and a cold build (empty cache, embedding
included) of the first ``--subset-docs`` documents by LlamaIndex's VectorStoreIndex and by our
HybridIndex over the same chunks, whose vectors are compared. Memory: peak RSS growth of the
process during the build (psutil, sampled every 5 ms).

Parameters of our rows (chunking, BM25 k1/b/tokenizer, fusion) come from ``TUNED`` below,
chosen with ``--tune`` on the train split (SciFact) or dev split (NFCorpus), never on test.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

logger = logging.getLogger("hybrid_beir")

# Parameters of our rows, chosen with --tune on non-test splits (see docs/benchmarks.md).
TUNED: Dict[str, Dict[str, Any]] = {
    # `--tune --chunking whole --chunking 200/40`, then `--tune --chunking whole` (leg depths 130/200/300),
    # selected on SciFact train (809 queries) by `select()`: one node per abstract beat 200/40-token
    # windows for every hybrid (best 0.7319 vs 0.7303 at depth 130); BM25 = the package defaults.
    # Train nDCG@10: BM25 0.6966, dense 0.6602, RRF 0.7322, score fusion 0.7339.
    "scifact": {
        "chunk_size": 100_000,
        "chunk_overlap": 0,
        "bm25": {"k1": 1.2, "b": 0.75, "stopwords": "en", "stemmer_language": "english"},
        "rrf": {"rrf_k": 1, "weights": [0.5, 0.5], "candidate_top_k": 300},
        "score": {"weights": [0.6, 0.4], "candidate_top_k": 300},
        "qdrant": {"rrf_k": 1, "candidate_top_k": 300},
        "tuned_on": "train",
    },
    # Same search, selected on NFCorpus dev (324 queries); train (2,590) only reported.
    # Dev nDCG@10: BM25 0.2947, dense 0.3027, RRF 0.3330, score fusion 0.3337 (whole) vs 0.3274 (200/40).
    "nfcorpus": {
        "chunk_size": 100_000,
        "chunk_overlap": 0,
        "bm25": {"k1": 1.5, "b": 0.5, "stopwords": "en_plus", "stemmer_language": "english"},
        "rrf": {"rrf_k": 20, "weights": [0.5, 0.5], "candidate_top_k": 300},
        "score": {"weights": [0.5, 0.5], "candidate_top_k": 300},
        "qdrant": {"rrf_k": 20, "candidate_top_k": 300},
        "tuned_on": "dev",
    },
}


# =========================================================================================
# Shared pieces
# =========================================================================================
WHOLE = (100_000, 0)  # "chunking" that keeps each document (section) whole


def chunking_label(size: int, overlap: int) -> str:
    return "whole" if (size, overlap) == WHOLE else f"{size}/{overlap}"


def tokenizer_config(spec: Dict[str, Any]):
    from llama_index_retrieval_kit.retrievers import BM25TokenizerConfig

    return BM25TokenizerConfig(stopwords=spec.get("stopwords", "en"), stemmer_language=spec.get("stemmer_language", "english"))


def fill_depth(chunks_per_doc: float) -> int:
    """Chunks to ask for so that ~100 distinct documents come back (checked per query later)."""
    return max(110, int(math.ceil(100 * chunks_per_doc * 1.25 / 10.0)) * 10)


# =========================================================================================
# Tuning (train/dev splits only): exact re-implementation of the package's fusion on arrays
# =========================================================================================
@dataclass
class ChunkTable:
    label: str
    nodes: list
    texts: List[str]  # what BM25 indexes (metadata_mode NONE)
    doc_of: np.ndarray  # chunk position -> doc position
    doc_ids: List[str]
    vectors: np.ndarray


def build_chunk_table(corpus: Dict[str, Dict[str, str]], size: int, overlap: int) -> ChunkTable:
    from llama_index.core.schema import MetadataMode

    nodes = C.our_parser(size, overlap).get_nodes_from_documents(C.our_documents(corpus))
    doc_ids = list(corpus)
    pos = {d: i for i, d in enumerate(doc_ids)}
    texts_embed = [C.embed_text_of(n) for n in nodes]
    have = C.cache_has(texts_embed)
    if have < len(set(texts_embed)):
        print(f"  embedding {len(set(texts_embed)) - have} uncached chunk texts ({chunking_label(size, overlap)}) ...", flush=True)
    vectors = C.cached_embeddings(texts_embed)
    return ChunkTable(
        label=chunking_label(size, overlap),
        nodes=nodes,
        texts=[n.get_content(metadata_mode=MetadataMode.NONE) for n in nodes],
        doc_of=np.array([pos[C.node_doc_id(n)] for n in nodes], dtype=np.int64),
        doc_ids=doc_ids,
        vectors=vectors,
    )


@dataclass
class LegRun:
    """Per query: chunk positions best first and their scores (as the package's leg returns them)."""

    idx: List[np.ndarray]
    scores: List[np.ndarray]


def bm25_leg(table: ChunkTable, queries: Sequence[str], spec: Dict[str, Any], depth: int, token_cache: Dict) -> LegRun:
    """Our BM25Retriever's ranking (same tokenizer, bm25s index and tie order), via its internals."""
    from llama_index_retrieval_kit.retrievers.bm25 import BM25Params, build_snapshot, top_matches, build_tokenizer

    cfg = tokenizer_config(spec)
    key = (table.label, cfg.stopwords, cfg.stemmer_language)
    tok = build_tokenizer(cfg)
    if key not in token_cache:
        token_cache[key] = [tok(t) for t in table.texts]
    snap = build_snapshot(table.nodes, token_cache[key], BM25Params(k1=float(spec["k1"]), b=float(spec["b"]), method="lucene"))
    idx, scores = [], []
    for q in queries:
        m = top_matches(snap, tok(q), depth)
        idx.append(np.array([i for i, _ in m], dtype=np.int64))
        scores.append(np.array([s for _, s in m], dtype=np.float64))
    return LegRun(idx, scores)


def dense_leg(table: ChunkTable, qvecs: np.ndarray, depth: int) -> LegRun:
    """Cosine top-k (vectors are unit length, as Qdrant's cosine distance normalises them)."""
    V = table.vectors / np.linalg.norm(table.vectors, axis=1, keepdims=True)
    Q = qvecs / np.linalg.norm(qvecs, axis=1, keepdims=True)
    idx, scores = [], []
    for start in range(0, len(Q), 256):
        S = Q[start : start + 256] @ V.T
        for row in S:
            k = min(depth, row.size)
            top = np.argpartition(-row, k - 1)[:k]
            top = top[np.argsort(-row[top], kind="stable")]
            idx.append(top)
            scores.append(row[top].astype(np.float64))
    return LegRun(idx, scores)


def _to_docs(table: ChunkTable, chunk_idx: np.ndarray, chunk_scores: np.ndarray, limit: int = 100) -> List[Tuple[str, float]]:
    """Max-score aggregation of a chunk ranking (sorted best first) to the top ``limit`` docs."""
    docs = table.doc_of[chunk_idx]
    _, first = np.unique(docs, return_index=True)
    first.sort()
    first = first[:limit]
    return [(table.doc_ids[docs[i]], float(chunk_scores[i])) for i in first]


def single_leg_run(table: ChunkTable, leg: LegRun, qids: Sequence[str], depth: int) -> Dict[str, List[Tuple[str, float]]]:
    return {q: _to_docs(table, leg.idx[i][:depth], leg.scores[i][:depth]) for i, q in enumerate(qids)}


def fused_run(
    table: ChunkTable,
    legs: Sequence[LegRun],
    qids: Sequence[str],
    mode: str,
    depth: int,
    weights: Sequence[float],
    rrf_k: float = 60.0,
    leg_depth: Optional[int] = None,
) -> Tuple[Dict[str, List[Tuple[str, float]]], int]:
    """HybridRetriever(mode, rrf_k, weights) with legs ``leg_depth`` deep (default ``depth``) and
    the fused list cut at ``depth``, then doc-level max aggregation; also returns how many
    queries got fewer than 100 docs."""
    leg_depth = max(leg_depth or depth, depth)  # as HybridIndex.as_retriever: max(candidate_top_k, similarity_top_k)
    run: Dict[str, List[Tuple[str, float]]] = {}
    short = 0
    wsum = sum(weights)
    for qi, q in enumerate(qids):
        parts_idx, parts_val, parts_rank = [], [], []
        for leg, w in zip(legs, weights):
            idx = leg.idx[qi][:leg_depth]
            if idx.size == 0:
                continue
            ranks = np.arange(1, idx.size + 1, dtype=np.float64)
            if mode == "rrf":
                val = w / (rrf_k + ranks)
            else:
                s = leg.scores[qi][:leg_depth]
                lo, hi = s.min(), s.max()
                norm = np.ones_like(s) if hi == lo else (s - lo) / (hi - lo)
                val = (w / wsum if wsum > 0 else 0.0) * norm
            parts_idx.append(idx)
            parts_val.append(val)
            parts_rank.append(ranks if w > 0 else np.full(idx.size, np.inf))
        if not parts_idx:
            run[q] = []
            short += 1
            continue
        allidx = np.concatenate(parts_idx)
        uniq, inv = np.unique(allidx, return_inverse=True)
        fused = np.bincount(inv, weights=np.concatenate(parts_val), minlength=uniq.size)
        best_rank = np.full(uniq.size, np.inf)
        np.minimum.at(best_rank, inv, np.concatenate(parts_rank))
        # package order: fused score desc, best weighted rank asc (node id last: ignored here)
        order = np.lexsort((best_rank, -fused))[:depth]
        docs = _to_docs(table, uniq[order], fused[order])
        short += len(docs) < 100
        run[q] = docs
    return run, short


def _eval(run, qrels) -> Dict[str, float]:
    return C.evaluate(run, qrels)


def tune(folder: Path, chunkings: Sequence[Tuple[int, int]], out: Path, splits: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Grid search on the non-test splits; writes every result to ``out`` (JSON) and prints the best."""
    corpus = C.read_corpus(folder)
    splits = list(splits or C.tuning_splits(folder))
    select_split = splits[0]  # dev for NFCorpus, train for SciFact
    data = {s: C.load_split(folder, s, corpus) for s in splits}
    print(f"[tune {folder.name}] selecting on {select_split} ({len(data[select_split].queries)} queries); "
          f"also reported: {[s for s in splits if s != select_split]}", flush=True)
    results: List[Dict[str, Any]] = []
    qtexts = {s: list(d.queries.values()) for s, d in data.items()}
    qids = {s: list(d.queries) for s, d in data.items()}
    qvecs = {s: C.cached_embeddings(qtexts[s]) for s in splits}
    tok_grid = [
        {"stopwords": "en", "stemmer_language": "english"},
        {"stopwords": None, "stemmer_language": "english"},
        {"stopwords": "en", "stemmer_language": None},
        {"stopwords": "en_plus", "stemmer_language": "english"},
    ]
    k1_grid = [0.6, 0.9, 1.2, 1.5, 2.0]
    b_grid = [0.3, 0.5, 0.75, 0.9, 1.0]
    best_overall: Dict[str, Any] = {}
    for size, overlap in chunkings:
        t0 = time.perf_counter()
        table = build_chunk_table(corpus, size, overlap)
        cpd = len(table.nodes) / len(table.doc_ids)
        depths = sorted({fill_depth(cpd), fill_depth(cpd) + 100}) if (size, overlap) != WHOLE else [fill_depth(cpd)]
        # (fused output depth, leg depth): deeper legs only where one node is one document
        pairs = [(d, d) for d in depths] if (size, overlap) != WHOLE else [(depths[0], ld) for ld in sorted({depths[0], 200, 300})]
        maxd = max(ld for _, ld in pairs)
        print(f"[tune {folder.name}] chunking {table.label}: {len(table.nodes)} chunks ({cpd:.2f}/doc), depths {depths} "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        dense = {s: dense_leg(table, qvecs[s], maxd) for s in splits}
        for d in depths:
            r = _eval(single_leg_run(table, dense[select_split], qids[select_split], d), data[select_split].qrels)
            results.append({"chunking": table.label, "system": "dense", "depth": d, select_split: r})
            print(f"  dense depth {d}: {r}", flush=True)
        # ---- stage A: BM25 alone
        token_cache: Dict = {}
        bm25_scores = []
        for tk in tok_grid:
            for k1 in k1_grid:
                for b in b_grid:
                    spec = {**tk, "k1": k1, "b": b}
                    leg = bm25_leg(table, qtexts[select_split], spec, maxd, token_cache)
                    r = _eval(single_leg_run(table, leg, qids[select_split], depths[0]), data[select_split].qrels)
                    results.append({"chunking": table.label, "system": "bm25", "bm25": spec, select_split: r})
                    bm25_scores.append((r["ndcg@10"], spec))
            print(f"  bm25 {tk}: best so far {max(bm25_scores, key=lambda x: x[0])}", flush=True)
        bm25_scores.sort(key=lambda x: -x[0])
        # distinct top configs (plus the package default) go to stage B
        candidates = [spec for _, spec in bm25_scores[:3]]
        default = {"stopwords": "en", "stemmer_language": "english", "k1": 1.2, "b": 0.75}
        if default not in candidates:
            candidates.append(default)
        # ---- stage B: fusion
        for spec in candidates:
            legs = {select_split: [bm25_leg(table, qtexts[select_split], spec, maxd, token_cache), dense[select_split]]}
            for d, ld in pairs:
                for k in [1, 5, 10, 20, 40, 60, 100]:
                    for wd in [0.3, 0.4, 0.5, 0.6, 0.7]:
                        w = [round(1 - wd, 2), wd]
                        run, short = fused_run(table, legs[select_split], qids[select_split], "rrf", d, w, k, leg_depth=ld)
                        r = _eval(run, data[select_split].qrels)
                        results.append({"chunking": table.label, "system": "rrf", "bm25": spec, "depth": d, "leg_depth": ld,
                                        "rrf_k": k, "weights": w, "short": short, select_split: r})
                for wd in [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]:
                    w = [round(1 - wd, 2), wd]
                    run, short = fused_run(table, legs[select_split], qids[select_split], "score", d, w, leg_depth=ld)
                    r = _eval(run, data[select_split].qrels)
                    results.append({"chunking": table.label, "system": "score", "bm25": spec, "depth": d, "leg_depth": ld,
                                    "weights": w, "short": short, select_split: r})
            best_rrf = max((x for x in results if x["system"] == "rrf" and x["chunking"] == table.label and x["bm25"] == spec),
                           key=lambda x: x[select_split]["ndcg@10"])
            best_sc = max((x for x in results if x["system"] == "score" and x["chunking"] == table.label and x["bm25"] == spec),
                          key=lambda x: x[select_split]["ndcg@10"])
            print(f"  bm25 {spec}: best rrf {best_rrf['rrf_k']} {best_rrf['weights']} d={best_rrf['depth']} "
                  f"{best_rrf[select_split]}; best score {best_sc['weights']} d={best_sc['depth']} {best_sc[select_split]}", flush=True)
        # ---- the best of each kind, also on the other non-test splits (reported, not used to select)
        for system in ("bm25", "rrf", "score"):
            pool = [x for x in results if x["system"] == system and x["chunking"] == table.label]
            best = max(pool, key=lambda x: x[select_split]["ndcg@10"])
            best["selected"] = True
            for s in splits:
                if s == select_split:
                    continue
                leg = bm25_leg(table, qtexts[s], best["bm25"], maxd, token_cache)
                if system == "bm25":
                    run = single_leg_run(table, leg, qids[s], depths[0])
                else:
                    run, _ = fused_run(table, [leg, dense[s]], qids[s], system, best["depth"], best["weights"], best.get("rrf_k", 60),
                                       leg_depth=best.get("leg_depth"))
                best[s] = _eval(run, data[s].qrels)
            print(f"  selected {system}: " + json.dumps({k: v for k, v in best.items() if k not in ("chunking",)}), flush=True)
        for x in results:
            if x["system"] == "dense" and x["chunking"] == table.label:
                for s in splits:
                    if s != select_split:
                        x[s] = _eval(single_leg_run(table, dense[s], qids[s], x["depth"]), data[s].qrels)
        print(f"[tune {folder.name}] chunking {table.label} done ({time.perf_counter() - t0:.0f}s)", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"dataset": folder.name, "select_split": select_split, "splits": splits, "results": results}, indent=1))
    return {"results": results, "select_split": select_split}


def select(results: Sequence[Dict[str, Any]], select_split: str, chunking: str) -> Dict[str, Any]:
    """The parameters of our rows from a tuning run (selection split only).

    One HybridIndex serves all our rows, so it has one BM25 configuration: among the BM25
    configurations that went to the fusion grid, the one whose best RRF and best score-fusion
    nDCG@10 have the highest mean. Then, for that configuration: RRF (k, weights, leg depth) and
    score fusion (weights, leg depth) with the highest nDCG@10; Qdrant-native hybrid (which fuses
    with equal weights) takes the best equal-weight RRF (k, leg depth).
    """
    pool = [x for x in results if x["chunking"] == chunking]

    def best(items: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        return max(items, key=lambda x: (x[select_split]["ndcg@10"], x[select_split]["recall@100"]))

    specs = {json.dumps(x["bm25"], sort_keys=True) for x in pool if x["system"] == "rrf"}
    scored = []
    for spec in specs:
        sp = json.loads(spec)
        r = best([x for x in pool if x["system"] == "rrf" and x["bm25"] == sp])
        f = best([x for x in pool if x["system"] == "score" and x["bm25"] == sp])
        scored.append(((r[select_split]["ndcg@10"] + f[select_split]["ndcg@10"]) / 2, sp, r, f))
    _, spec, r, f = max(scored, key=lambda t: t[0])
    eq = best([x for x in pool if x["system"] == "rrf" and x["bm25"] == spec and x["weights"][0] == x["weights"][1]])
    size, overlap = WHOLE if chunking == "whole" else tuple(int(v) for v in chunking.split("/"))
    bm25_alone = next((x for x in pool if x["system"] == "bm25" and x["bm25"] == spec), None)
    return {
        "chunk_size": size,
        "chunk_overlap": overlap,
        "bm25": spec,
        "rrf": {"rrf_k": r["rrf_k"], "weights": r["weights"], "candidate_top_k": r.get("leg_depth", r["depth"])},
        "score": {"weights": f["weights"], "candidate_top_k": f.get("leg_depth", f["depth"])},
        "qdrant": {"rrf_k": eq["rrf_k"], "candidate_top_k": eq.get("leg_depth", eq["depth"])},
        "tuned_on": {
            "split": select_split,
            "bm25_ndcg@10": bm25_alone[select_split]["ndcg@10"] if bm25_alone else None,
            "rrf": r[select_split],
            "score": f[select_split],
            "equal_weight_rrf": eq[select_split],
        },
    }


# =========================================================================================
# Benchmark
# =========================================================================================
class RssPeak:
    """Peak growth of this process's resident memory (psutil RSS, sampled every 5 ms) in a block."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(0.005)

    def __enter__(self) -> "RssPeak":
        gc.collect()
        self.baseline = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.baseline) / 2**20


@dataclass
class Build:
    seconds: float
    docs: int
    chunks: int
    rss_mb: float
    note: str = ""

    @property
    def docs_per_s(self) -> float:
        return self.docs / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class System:
    name: str
    family: str  # "llamaindex" | "ours"
    retrieve: Callable[[str], list]
    build: Optional[Build]
    params: Dict[str, Any] = field(default_factory=dict)
    times: List[float] = field(default_factory=list)
    run: Dict[str, List[Tuple[str, float]]] = field(default_factory=dict)
    short: int = 0


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values) * 1000.0, q))


def seed_cache(storage: Path) -> None:
    """A fresh index folder (the build starts from the benchmark cache: ``embedding_cache=C.CACHE_FILE``)."""
    if storage.exists():
        shutil.rmtree(storage)


def build_llamaindex(corpus, storage: Path, depth: int, embed_model) -> Tuple[List[System], Dict[str, Any]]:
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.llms import MockLLM
    from llama_index.core.retrievers import QueryFusionRetriever
    from llama_index.retrievers.bm25 import BM25Retriever as LIBM25Retriever
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    docs = C.llama_documents(corpus)
    t0 = time.perf_counter()
    nodes = C.llama_parser().get_nodes_from_documents(docs)
    t_parse = time.perf_counter() - t0

    with RssPeak() as mem:
        t0 = time.perf_counter()
        bm25 = LIBM25Retriever.from_defaults(nodes=nodes, similarity_top_k=depth)
        t_bm25 = time.perf_counter() - t0
    b_bm25 = Build(t_parse + t_bm25, len(docs), len(nodes), mem.delta_mb, "SentenceSplitter + BM25Retriever.from_defaults")

    vecs = C.cached_embeddings([C.embed_text_of(n) for n in nodes])  # same vectors LlamaIndex would compute
    for n, v in zip(nodes, vecs):
        n.embedding = v.tolist()
    if storage.exists():
        shutil.rmtree(storage)
    client = QdrantClient(path=str(storage))
    with RssPeak() as mem:
        t0 = time.perf_counter()
        store = QdrantVectorStore(client=client, collection_name="llamaindex")
        index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=embed_model)
        t_vec = time.perf_counter() - t0
    b_vec = Build(t_parse + t_vec, len(docs), len(nodes), mem.delta_mb, "SentenceSplitter + VectorStoreIndex(QdrantVectorStore), vectors from cache")
    vret = index.as_retriever(similarity_top_k=depth)
    qfr = QueryFusionRetriever(
        [bm25, vret], llm=MockLLM(), mode="reciprocal_rerank", num_queries=1, use_async=False, similarity_top_k=depth
    )
    b_qfr = Build(t_parse + t_bm25 + t_vec, len(docs), len(nodes), float("nan"), "both indexes above")
    systems = [
        System("LlamaIndex BM25Retriever", "llamaindex", bm25.retrieve, b_bm25, {"similarity_top_k": depth}),
        System("LlamaIndex VectorStoreIndex (Qdrant, dense)", "llamaindex", vret.retrieve, b_vec, {"similarity_top_k": depth}),
        System(
            "LlamaIndex QueryFusionRetriever (RRF)",
            "llamaindex",
            qfr.retrieve,
            b_qfr,
            {"mode": "reciprocal_rerank", "num_queries": 1, "use_async": False, "similarity_top_k": depth},
        ),
    ]
    return systems, {"client": client, "nodes": len(nodes)}


def build_ours(corpus, storage: Path, params: Dict[str, Any], embed_model, depth: int):
    from llama_index_retrieval_kit.indices import HybridIndex

    docs = C.our_documents(corpus)
    parser = C.our_parser(params["chunk_size"], params["chunk_overlap"])
    seed_cache(storage)
    bm = params["bm25"]
    with RssPeak() as mem:
        t0 = time.perf_counter()
        index = HybridIndex.from_documents(
            docs,
            storage,
            node_parser=parser,
            embed_model=embed_model,
            tokenizer_config=tokenizer_config(bm),
            bm25_k1=bm["k1"],
            bm25_b=bm["b"],
            embedding_cache=C.CACHE_FILE,  # every vector is already computed
        )
        seconds = time.perf_counter() - t0
    build = Build(seconds, len(docs), len(index), mem.delta_mb, "HybridIndex.from_documents (parse, Qdrant dense+sparse, BM25, docstore), vectors from cache")
    rrf, sc, qd = params["rrf"], params["score"], params["qdrant"]
    r_sparse = index.as_retriever("sparse", similarity_top_k=depth)
    r_dense = index.as_retriever("dense", similarity_top_k=depth)
    r_rrf = index.as_retriever("hybrid_rrf", similarity_top_k=depth, candidate_top_k=rrf["candidate_top_k"], rrf_k=rrf["rrf_k"], weights=rrf["weights"])
    r_score = index.as_retriever("hybrid_score", similarity_top_k=depth, candidate_top_k=sc["candidate_top_k"], weights=sc["weights"])
    r_default = index.as_retriever("hybrid", similarity_top_k=depth)  # the default fusion, no other argument
    r_qd = index.as_retriever("qdrant_hybrid", similarity_top_k=depth, candidate_top_k=qd["candidate_top_k"], rrf_k=qd["rrf_k"])
    common = {"chunking": chunking_label(params["chunk_size"], params["chunk_overlap"]), "bm25": bm, "similarity_top_k": depth}
    systems = [
        System("ours BM25 (sparse)", "ours", r_sparse.retrieve, build, dict(common)),
        System("ours dense", "ours", r_dense.retrieve, build, dict(common)),
        System("ours hybrid RRF", "ours", r_rrf.retrieve, build, {**common, **rrf}),
        System("ours hybrid score fusion (mode 'hybrid_score')", "ours", r_score.retrieve, build, {**common, **sc}),
        System("ours hybrid default (mode 'hybrid': feedback fusion)", "ours", r_default.retrieve, build, dict(common)),
        System("ours Qdrant-native hybrid", "ours", r_qd.retrieve, build, {**common, **qd}),
    ]
    return index, systems


def cold_builds(
    corpus, n_docs: int, params: Dict[str, Any], embed_model, li_embed_model, workdir: Path, repeats: int
) -> List[Dict[str, Any]]:
    """Indexing throughput from scratch (embedding included) on the first ``n_docs`` documents.

    LlamaIndex's VectorStoreIndex.from_documents gets our node parser as its transformation, so
    both systems embed exactly the same chunk texts; the vectors are then read back from both
    Qdrant collections by node id and compared. LlamaIndex with its default SentenceSplitter is
    timed too, for reference (different chunks). LlamaIndex's rows embed with
    ``li_embed_model`` (its HuggingFaceEmbedding, defaults), ours with ``embed_model``.
    """
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from llama_index_retrieval_kit.indices import HybridIndex
    from qdrant_client import QdrantClient

    ids = list(corpus)[:n_docs]
    bm = params["bm25"]
    rows: Dict[str, Dict[str, Any]] = {}

    def record(name: str, seconds: float, chunks: int, rss: float, note: str) -> None:
        row = rows.setdefault(name, {"system": name, "docs": len(ids), "chunks": chunks, "times": [], "rss_mb": [], "note": note})
        row["times"].append(seconds)
        row["rss_mb"].append(rss)

    li_vectors: Dict[str, np.ndarray] = {}
    our_vectors: Dict[str, np.ndarray] = {}
    for rep in range(repeats):
        # LlamaIndex, our chunks
        path = workdir / "cold_li"
        shutil.rmtree(path, ignore_errors=True)
        client = QdrantClient(path=str(path))
        docs = C.our_documents(corpus, ids)
        with RssPeak() as mem:
            t0 = time.perf_counter()
            store = QdrantVectorStore(client=client, collection_name="li")
            VectorStoreIndex.from_documents(
                docs,
                storage_context=StorageContext.from_defaults(vector_store=store),
                embed_model=li_embed_model,
                transformations=[C.our_parser(params["chunk_size"], params["chunk_overlap"])],
            )
            seconds = time.perf_counter() - t0
        pts = client.scroll("li", limit=100_000, with_vectors=True, with_payload=False)[0]
        li_vectors = {str(p.id): np.asarray(p.vector, dtype=np.float32) for p in pts}
        client.close()
        record("LlamaIndex VectorStoreIndex.from_documents (our chunks)", seconds, len(li_vectors), mem.delta_mb,
               "transformations=[SectionWindowNodeParser], QdrantVectorStore local mode")
        # ours
        path = workdir / "cold_ours"
        shutil.rmtree(path, ignore_errors=True)
        docs = C.our_documents(corpus, ids)
        with RssPeak() as mem:
            t0 = time.perf_counter()
            index = HybridIndex.from_documents(
                docs, path, node_parser=C.our_parser(params["chunk_size"], params["chunk_overlap"]),
                embed_model=embed_model, tokenizer_config=tokenizer_config(bm), bm25_k1=bm["k1"], bm25_b=bm["b"],
            )
            seconds = time.perf_counter() - t0
        # Keyed by point id, which is the node id (our chunk ids are UUIDs), as in LlamaIndex's collection.
        our_vectors = {pid: np.asarray(vec, dtype=np.float32) for pid, vec in index.store.dense_vectors().items()}
        record("ours HybridIndex.from_documents", seconds, len(index), mem.delta_mb,
               "dense + sparse + BM25 + docstore, empty embedding cache")
        index.close()
        # LlamaIndex defaults (SentenceSplitter): reference only
        path = workdir / "cold_li_default"
        shutil.rmtree(path, ignore_errors=True)
        client = QdrantClient(path=str(path))
        docs = C.llama_documents(corpus, ids)
        with RssPeak() as mem:
            t0 = time.perf_counter()
            store = QdrantVectorStore(client=client, collection_name="li")
            VectorStoreIndex.from_documents(docs, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=li_embed_model)
            seconds = time.perf_counter() - t0
        n = client.count("li").count
        client.close()
        record("LlamaIndex VectorStoreIndex.from_documents (defaults)", seconds, n, mem.delta_mb,
               "default SentenceSplitter(1024/200): other chunks, for reference")
        # The floor: only the model's forward passes over the same chunk texts, longest first in
        # batches of 64 (sentence-transformers' encode, no index, no cache, no LlamaIndex).
        texts = [C.embed_text_of(n) for n in C.our_parser(params["chunk_size"], params["chunk_overlap"]).get_nodes_from_documents(C.our_documents(corpus, ids))]
        t0 = time.perf_counter()
        embed_model._model.encode(sorted(texts, key=len, reverse=True), batch_size=64, normalize_embeddings=True)
        record("embedding only (model forward passes, same chunks)", time.perf_counter() - t0, len(texts), float("nan"),
               "SentenceTransformer.encode, batch 64, length-sorted: the floor for any index build")
        print(f"  cold build repeat {rep + 1}/{repeats}: " + ", ".join(f"{r['system']}: {r['times'][-1]:.1f}s" for r in rows.values()), flush=True)

    common = sorted(set(li_vectors) & set(our_vectors))
    diff = max((float(np.max(np.abs(li_vectors[i] - our_vectors[i]))) for i in common), default=float("nan"))
    out = []
    li_best = min(rows["LlamaIndex VectorStoreIndex.from_documents (our chunks)"]["times"])
    for row in rows.values():
        best = min(row["times"])
        out.append({
            "kind": "cold_build",
            "system": row["system"],
            "docs": row["docs"],
            "chunks": row["chunks"],
            "seconds_best": best,
            "seconds_all": row["times"],
            "docs_per_s": row["docs"] / best,
            "speedup_vs_llamaindex_same_chunks": li_best / best,
            "peak_rss_delta_mb": max(row["rss_mb"]),
            "note": row["note"],
        })
    out.append({
        "kind": "vector_check",
        "same_node_ids": len(common),
        "llamaindex_only": len(set(li_vectors) - set(our_vectors)),
        "ours_only": len(set(our_vectors) - set(li_vectors)),
        "max_abs_diff": diff,
    })
    return out


def measure(
    systems: List[System], extra: Dict[str, Callable[[str], Any]], queries: Dict[str, str], warmup: int, round_size: int = 50
) -> Dict[str, List[float]]:
    """Every system answers every query, one query at a time, in rounds.

    In each round of ``round_size`` queries every system (and every timed-only probe in ``extra``:
    query embedding, BM25 leg, ...) answers the round's queries back to back, and the order of
    systems rotates from round to round. Back to back, as a user's process runs one retriever:
    interleaving systems query by query lets one engine's idle worker threads (PyTorch's OpenMP
    pool spins after each call) slow the next system down. Rotating rounds still spreads load
    from other processes evenly over the systems.
    """
    items: List[Tuple[str, Callable[[str], Any], Optional[System]]] = [(s.name, s.retrieve, s) for s in systems]
    items += [(name, fn, None) for name, fn in extra.items()]
    qlist = list(queries.items())
    for _, text in qlist[:warmup]:
        for _, fn, _ in items:
            fn(text)
    probe_times: Dict[str, List[float]] = {name: [] for name in extra}
    rounds = [qlist[i : i + round_size] for i in range(0, len(qlist), round_size)]
    done = 0
    for ri, chunk in enumerate(rounds):
        shift = ri % len(items)
        for name, fn, system in items[shift:] + items[:shift]:
            fn(chunk[0][1])  # one untimed call after switching systems
            for qid, text in chunk:
                t0 = time.perf_counter()
                out = fn(text)
                elapsed = time.perf_counter() - t0
                if system is None:
                    probe_times[name].append(elapsed)
                    continue
                system.times.append(elapsed)
                docs = C.docs_from_chunks(((C.node_doc_id(r.node), r.score) for r in out), 100)
                system.short += len(docs) < 100
                system.run[qid] = docs
        done += len(chunk)
        print(f"  {done}/{len(qlist)} queries", flush=True)
    return probe_times


def fmt_table(rows: List[Dict[str, Any]]) -> str:
    head = ["system", "nDCG@10", "R@100", "MRR@10", "p50 ms", "p95 ms", "build s", "docs/s", "peak RSS MB", "short"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['ndcg@10']:.4f} | {r['recall@100']:.4f} | {r['mrr@10']:.4f} | {r['latency_p50_ms']:.1f} | "
            f"{r['latency_p95_ms']:.1f} | {r['build_s']:.1f} | {r['build_docs_per_s']:.0f} | {r['build_peak_rss_delta_mb']:.0f} | {r['queries_short_of_100_docs']} |"
        )
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace) -> List[Dict[str, Any]]:
    import platform

    import torch

    folder = args.dataset.resolve()
    name = folder.name
    params = json.loads(json.dumps(TUNED.get(name, TUNED["scifact"])))
    if args.params:
        params.update(json.loads(args.params))
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    corpus = C.read_corpus(folder)
    if args.limit_docs:  # smoke tests only: metrics are meaningless on a partial corpus
        corpus = dict(list(corpus.items())[: args.limit_docs])
    data = C.load_split(folder, args.split, corpus)
    queries = dict(list(data.queries.items())[: args.limit_queries] if args.limit_queries else data.queries.items())
    print(f"[{name}] {len(corpus)} docs, {len(queries)} {args.split} queries; our parameters: {json.dumps(params)}", flush=True)

    embed_model = C.embed_model()  # ours: FastHuggingFaceEmbedding (ONNX Runtime queries)
    li_embed_model = C.llamaindex_embed_model()  # LlamaIndex's HuggingFaceEmbedding, its defaults
    embed_model.get_query_embedding("warm up")
    li_embed_model.get_query_embedding("warm up")
    work = C.CACHE_DIR / "bench" / name

    # ---- LlamaIndex
    li_depth = args.llama_depth
    li_systems, li_info = build_llamaindex(corpus, work / "llamaindex_qdrant", li_depth, li_embed_model)
    print(f"[{name}] LlamaIndex built: {li_info['nodes']} nodes ({time.perf_counter() - t_start:.0f}s)", flush=True)
    # ---- ours
    n_chunks_est = len(C.our_parser(params["chunk_size"], params["chunk_overlap"]).get_nodes_from_documents(C.our_documents(corpus, list(corpus)[:500])))
    our_depth = args.our_depth or fill_depth(n_chunks_est / min(500, len(corpus)))
    index, our_systems = build_ours(corpus, work / "ours", params, embed_model, our_depth)
    print(f"[{name}] HybridIndex built: {len(index)} chunks, depth {our_depth} ({time.perf_counter() - t_start:.0f}s)", flush=True)

    # ---- queries (interleaved), with the floor probes
    bm25_leg = index.as_retriever("sparse", similarity_top_k=max(params["rrf"]["candidate_top_k"], our_depth))
    from llama_index.core.schema import QueryBundle

    dense_leg = index.as_retriever("dense", similarity_top_k=max(params["rrf"]["candidate_top_k"], our_depth))
    qdrant_dense_leg = index.as_retriever(
        "dense", similarity_top_k=max(params["rrf"]["candidate_top_k"], our_depth), dense_search="qdrant"
    )
    qvec = {t: v for t, v in zip(queries.values(), C.cached_embeddings(list(queries.values())))}
    # the same chunk vectors as a plain in-memory matrix: what a bare exact dense search costs
    leaf_texts = [C.embed_text_of(n) for n in index.bm25.nodes]
    matrix = C.cached_embeddings(leaf_texts)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    leg_k = max(params["rrf"]["candidate_top_k"], our_depth)

    def numpy_dense(t: str) -> np.ndarray:
        scores = matrix @ qvec[t]
        top = np.argpartition(-scores, leg_k - 1)[:leg_k]
        return top[np.argsort(-scores[top])]

    probes = {
        "query embedding": embed_model.get_query_embedding,
        "LlamaIndex query embedding": li_embed_model.get_query_embedding,
        "our BM25 leg": bm25_leg.retrieve,
        # The floor as one pipeline, as the systems run: the BM25 leg right after the embedding
        # (caches as ONNX Runtime left them), not summed from two probes each run hot.
        "embedding then BM25 leg": lambda t: bm25_leg.retrieve(QueryBundle(t, embedding=embed_model.get_query_embedding(t))),
        "our dense leg, embedding given": lambda t: dense_leg.retrieve(QueryBundle(t, embedding=qvec[t].tolist())),
        "Qdrant Edge dense search, embedding given": lambda t: qdrant_dense_leg.retrieve(QueryBundle(t, embedding=qvec[t].tolist())),
        "numpy dense top-k, embedding given": numpy_dense,
    }
    systems = li_systems + our_systems
    probe_times = measure(systems, probes, queries, args.warmup, args.round_size)
    print(f"[{name}] queries done ({time.perf_counter() - t_start:.0f}s)", flush=True)

    rows: List[Dict[str, Any]] = []
    base = {"dataset": name, "split": args.split, "queries": len(queries)}
    for s in systems:
        m = C.evaluate(s.run, data.qrels)
        b = s.build
        rows.append({
            **base,
            "kind": "retrieval",
            "system": s.name,
            "family": s.family,
            **m,
            "latency_p50_ms": pct(s.times, 50),
            "latency_p95_ms": pct(s.times, 95),
            "build_s": b.seconds if b else float("nan"),
            "build_docs_per_s": b.docs_per_s if b else float("nan"),
            "build_chunks": b.chunks if b else None,
            "build_peak_rss_delta_mb": b.rss_mb if b else float("nan"),
            "build_note": b.note if b else "",
            "queries_short_of_100_docs": s.short,
            "params": s.params,
        })
    floor = [a + b for a, b in zip(probe_times["query embedding"], probe_times["our BM25 leg"])]
    li_floor = [a + b for a, b in zip(probe_times["LlamaIndex query embedding"], probe_times["our BM25 leg"])]
    floor_row = {
        **base,
        "kind": "latency_floor",
        "query_embedding_p50_ms": pct(probe_times["query embedding"], 50),
        "llamaindex_query_embedding_p50_ms": pct(probe_times["LlamaIndex query embedding"], 50),
        "qdrant_dense_given_embedding_p50_ms": pct(probe_times["Qdrant Edge dense search, embedding given"], 50),
        "floor_with_llamaindex_embedding_p50_ms": pct(li_floor, 50),
        "bm25_leg_p50_ms": pct(probe_times["our BM25 leg"], 50),
        "dense_leg_given_embedding_p50_ms": pct(probe_times["our dense leg, embedding given"], 50),
        "numpy_dense_given_embedding_p50_ms": pct(probe_times["numpy dense top-k, embedding given"], 50),
        "floor_p50_ms": pct(floor, 50),
        "floor_p95_ms": pct(floor, 95),
        "pipeline_floor_p50_ms": pct(probe_times["embedding then BM25 leg"], 50),
        "leg_depth": max(params["rrf"]["candidate_top_k"], our_depth),
    }
    rows.append(floor_row)
    index.close()
    li_info["client"].close()

    if args.subset_docs > 0:
        print(f"[{name}] cold builds on the first {args.subset_docs} docs ...", flush=True)
        rows += [{**base, **r} for r in cold_builds(corpus, args.subset_docs, params, embed_model, li_embed_model, work, args.build_repeats)]

    # ---- report
    ret = [r for r in rows if r["kind"] == "retrieval"]
    print()
    print(f"## {name} ({args.split}, {len(queries)} queries, {len(corpus)} docs)")
    print(fmt_table(ret))
    print()
    print(
        f"floor (query embedding + our BM25 leg at depth {floor_row['leg_depth']}): p50 {floor_row['floor_p50_ms']:.1f} ms "
        f"(embedding {floor_row['query_embedding_p50_ms']:.1f}, BM25 {floor_row['bm25_leg_p50_ms']:.1f}); "
        f"LlamaIndex's HuggingFaceEmbedding query embedding: {floor_row['llamaindex_query_embedding_p50_ms']:.1f} ms; "
        f"dense top-k with the embedding given: ours {floor_row['dense_leg_given_embedding_p50_ms']:.2f} ms, "
        f"ours in Qdrant Edge (dense_search=\"qdrant\") {floor_row['qdrant_dense_given_embedding_p50_ms']:.1f} ms, "
        f"bare numpy {floor_row['numpy_dense_given_embedding_p50_ms']:.2f} ms; "
        f"the same floor as one pipeline (embedding, then the BM25 leg, per query): p50 {floor_row['pipeline_floor_p50_ms']:.1f} ms"
    )
    qfr = next(r for r in ret if r["system"].startswith("LlamaIndex QueryFusion"))
    ours_h = [r for r in ret if r["family"] == "ours" and "hybrid" in r["system"]]
    best = max(ours_h, key=lambda r: r["ndcg@10"])
    for r in ours_h:
        print(
            f"  {r['system']}: p50 {r['latency_p50_ms']:.1f} ms = {r['latency_p50_ms'] / qfr['latency_p50_ms']:.2f}x QueryFusionRetriever, "
            f"{r['latency_p50_ms'] / floor_row['floor_p50_ms']:.2f}x floor "
            f"({r['latency_p50_ms'] / floor_row['pipeline_floor_p50_ms']:.2f}x the pipeline floor)"
        )
    print(f"  best hybrid: {best['system']} nDCG@10 {best['ndcg@10']:.4f}")
    cold = [r for r in rows if r["kind"] == "cold_build"]
    if cold:
        print()
        print("| cold build (first %d docs) | chunks | best s | docs/s | vs LlamaIndex (same chunks) | peak RSS MB |" % args.subset_docs)
        print("|---|---|---|---|---|---|")
        for r in cold:
            print(f"| {r['system']} | {r['chunks']} | {r['seconds_best']:.1f} | {r['docs_per_s']:.1f} | {r['speedup_vs_llamaindex_same_chunks']:.2f}x | {r['peak_rss_delta_mb']:.0f} |")
        vc = next(r for r in rows if r["kind"] == "vector_check")
        print(f"vectors: {vc['same_node_ids']} node ids in both indexes (LlamaIndex only {vc['llamaindex_only']}, ours only {vc['ours_only']}), "
              f"max |difference| {vc['max_abs_diff']:.2e}")
    meta = {
        **base,
        "kind": "environment",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "wall_s": time.perf_counter() - t_start,
        "our_params": params,
        "llama_depth": li_depth,
        "our_depth": our_depth,
    }
    rows.append(meta)
    print(f"\n[{name}] total {meta['wall_s']:.0f}s, load average at end {meta['load_avg_end']}")
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", type=Path, default=C.DEFAULT_BEIR / "scifact")
    ap.add_argument("--json", type=Path, default=None, help="write the rows (one JSON object each) here")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit-queries", type=int, default=None, help="first N queries only (quick runs)")
    ap.add_argument("--limit-docs", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=10, help="queries run once through every system before timing")
    ap.add_argument("--round-size", type=int, default=50, help="queries each system answers back to back per round")
    ap.add_argument("--subset-docs", type=int, default=500, help="documents for the cold build comparison (0: skip)")
    ap.add_argument("--build-repeats", type=int, default=2, help="cold builds per system (best is reported)")
    ap.add_argument("--llama-depth", type=int, default=130, help="similarity_top_k of the LlamaIndex rows")
    ap.add_argument("--our-depth", type=int, default=None, help="similarity_top_k (chunks) of our rows; default from chunks/doc")
    ap.add_argument("--params", default=None, help="JSON overriding our TUNED parameters (keys as in TUNED)")
    ap.add_argument("--tune", action="store_true", help="grid search on the train/dev splits instead of the benchmark")
    ap.add_argument("--chunking", action="append", default=None, help="with --tune: SIZE/OVERLAP or 'whole' (repeatable)")
    ap.add_argument("--tune-splits", default=None, help="with --tune: comma-separated splits, selection on the first")
    ap.add_argument("--tune-out", type=Path, default=None)
    ap.add_argument("--select", type=Path, default=None, help="print the parameters selected from a saved --tune JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.tune:
        chunkings = []
        for c in args.chunking or ["200/40"]:
            chunkings.append(WHOLE if c == "whole" else tuple(int(x) for x in c.split("/")))
        labels = "+".join(chunking_label(*c).replace("/", "-") for c in chunkings)
        out = args.tune_out or C.CACHE_DIR / f"tune_{args.dataset.resolve().name}_{labels}.json"
        splits = args.tune_splits.split(",") if args.tune_splits else None
        if splits and "test" in splits:
            ap.error("never tune on the test split")
        res = tune(args.dataset.resolve(), chunkings, out, splits)
        for c in chunkings:
            print(f"selected for {chunking_label(*c)}: " + json.dumps(select(res["results"], res["select_split"], chunking_label(*c))))
        return 0
    if args.select:
        saved = json.loads(args.select.read_text())
        for c in sorted({x["chunking"] for x in saved["results"]}):
            print(f"selected for {c}: " + json.dumps(select(saved["results"], saved["select_split"], c)))
        return 0
    rows = run_benchmark(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1, default=float))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
