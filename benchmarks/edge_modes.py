"""Quality (and, on an idle machine, latency) of every retriever mode with Qdrant Edge as the
embedded store, on SciFact and NFCorpus (../shared/datasets/beir), default chunking and model.

    python benchmarks/edge_modes.py [--split test] [--datasets scifact nfcorpus]

Reuses the default index of benchmarks/no_answer.py (built once into benchmarks/.cache; a
folder of the old format is migrated on open). Prints nDCG@10 and R@100 (documents: a document's
score is its best chunk's) and p50 query ms with the query embedding given.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_index.core.schema import QueryBundle  # noqa: E402

import _common as C  # noqa: E402
import no_answer  # noqa: E402

SYSTEMS: Dict[str, Dict[str, Any]] = {
    "hybrid (default: feedback fusion)": {"mode": "hybrid"},
    "hybrid_score (default before)": {"mode": "hybrid_score"},
    "hybrid_rrf": {"mode": "hybrid_rrf"},
    "dense (memory)": {"mode": "dense", "dense_search": "memory"},
    "dense (Edge)": {"mode": "dense", "dense_search": "qdrant"},
    "hybrid, dense in Edge": {"mode": "hybrid", "dense_search": "qdrant"},
    "qdrant_hybrid rrf": {"mode": "qdrant_hybrid"},
    "qdrant_hybrid rrf, leg_scores=False": {"mode": "qdrant_hybrid", "leg_scores": False},
    "qdrant_hybrid dbsf": {"mode": "qdrant_hybrid", "fusion": "dbsf"},
    "sparse (bm25s)": {"mode": "sparse"},
}


def run_dataset(name: str, split: str, limit: int) -> List[Dict[str, Any]]:
    folder = C.DEFAULT_BEIR / name
    data = C.load_split(folder, split)
    queries = dict(list(data.queries.items())[:limit]) if limit else data.queries
    vectors = C.cached_embeddings(list(queries.values()))
    rows = []
    with no_answer.open_index(folder) as index:
        for system, options in SYSTEMS.items():
            opts = dict(options)
            mode = opts.pop("mode")
            retriever = index.as_retriever(mode, similarity_top_k=100, **opts)
            run, times = {}, []
            for (qid, text), vec in zip(queries.items(), vectors):
                qb = QueryBundle(text, embedding=list(map(float, vec)))
                t0 = time.perf_counter()
                results = retriever.retrieve(qb)
                times.append((time.perf_counter() - t0) * 1000)
                run[qid] = C.docs_from_chunks((C.node_doc_id(r.node), float(r.score)) for r in results)
            metrics = C.evaluate(run, data.qrels)
            rows.append({"dataset": name, "system": system, **metrics, "p50_ms": statistics.median(times)})
            print(f"{name:9s} {system:33s} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()) + f" p50={statistics.median(times):.1f}ms", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="test")
    parser.add_argument("--datasets", nargs="+", default=["scifact", "nfcorpus"])
    parser.add_argument("--limit", type=int, default=0, help="first N queries only (0: all)")
    args = parser.parse_args()
    rows = [row for name in args.datasets for row in run_dataset(name, args.split, args.limit)]
    keys = [k for k in rows[0] if k not in ("dataset", "system")]
    print("\n| dataset | system | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for row in rows:
        print(f"| {row['dataset']} | {row['system']} | " + " | ".join(f"{row[k]:.4f}" if k != "p50_ms" else f"{row[k]:.1f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
